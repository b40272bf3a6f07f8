// The rejection sampler's rule in C++ (`engine/spec_decode/rejection_sampler.py`'s `verify_batch`,
// whose readable reference is `verify_one`), for every sequence of a step at once:
//
// - pdserve::temperature_probs(logits [R, vocab] f32, temperature [R] f32): each row's distribution
//   at its temperature (one-hot on the argmax at t <= 0), as pick.h makes it: the distribution the
//   draft's and the sampler's native races draw from, so that q and p here are the numbers the
//   tokens were raced against.
// - pdserve::rejection_rows(probs, draft_probs, drafts, depths, seeds, positions, temperature, codes):
//   sequence s verifies k = depths[s] drafts; its rows of `probs` are p at its input token and each
//   draft (k + 1, sequence after sequence), its rows of `draft_probs` q of each draft (k), `drafts`
//   its draft ids (k), positions[s] the position the first of its rows predicts. Draft i is accepted
//   while p(x) > 0 and (q(x) <= 0 or u < p(x) / q(x)), u the (seed, position + i) uniform of the
//   acceptance stream, in float64; the last token is raced over the residual max(0, p - q) at the
//   first rejection (p itself where that has no mass), or over p after the last draft, against the
//   row of Exp(1) noise of the residual or the sample stream at its position (`rng.exponentials`:
//   the hash here, the logarithm torch's own, so the row is the one Python would draw). A row at
//   temperature <= 0 (p and q one-hot) takes the argmax without noise. Returns the accepted counts
//   and the last tokens, int64 [S] each.
//
// Why: in Python the rule cost about 0.6 ms a step at batch 1 (filtering p, padding the rows,
// stacking q, a uniform per position, two host copies), as much as the demo target's verification
// forward; with the draft's passes and the verification in one call too (draft_passes.cpp's
// spec_step_rejection), a rejection step is one native call, as a coupled one is.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

#include "native_ops.h"
#include "noise.h"  // row_key, key_uniform, hash_key_row
#include "pick.h"   // temperature_probs, race_probs, first_max

namespace pdserve_native {

void rejection_rule(const at::Tensor& probs, const at::Tensor& draft_probs, const int64_t* drafts,
                    const int64_t* depths, const int64_t* seeds, const int64_t* positions, const float* temperature,
                    int64_t num_seqs, const at::Tensor& codes, int64_t* accepted, int64_t* last) {
  constexpr double kEmpty = 1e-12;  // rejection_sampler._EMPTY: a residual with less mass is float noise
  const int64_t vocab = probs.size(1);
  const float* p = probs.data_ptr<float>();
  const float* q = draft_probs.data_ptr<float>();
  std::vector<int64_t> first_row(num_seqs), first_draft(num_seqs);
  int64_t num_sampled = 0;
  for (int64_t s = 0, row = 0, draft = 0; s < num_seqs; ++s) {
    first_row[s] = row;
    first_draft[s] = draft;
    int64_t a = 0;
    const uint64_t seed = static_cast<uint64_t>(seeds[s]);
    for (; a < depths[s]; ++a) {
      const int64_t x = drafts[draft + a];
      const float pv = p[(row + a) * vocab + x], qv = q[(draft + a) * vocab + x];
      const double u = key_uniform(row_key(seed, static_cast<uint64_t>(positions[s] + a), kAcceptStream));
      if (!(pv > 0.f && (qv <= 0.f || u < static_cast<double>(pv) / static_cast<double>(qv)))) break;
    }
    accepted[s] = a;
    row += depths[s] + 1;
    draft += depths[s];
    num_sampled += temperature[s] > 0.f;
  }
  // the sampled rows' last-token noise, made as rng.exponentials makes it: the uniforms hashed,
  // then torch's log over the whole [rows, vocab] tensor, as Python's call for these rows would
  at::Tensor noise = at::empty({num_sampled, vocab}, probs.options());
  const uint32_t* code = reinterpret_cast<const uint32_t*>(codes.data_ptr<int32_t>());
  for (int64_t s = 0, i = 0; s < num_seqs; ++s)
    if (temperature[s] > 0.f) {
      const uint64_t stream = accepted[s] == depths[s] ? kSampleStream : kResidualStream;
      hash_key_row(row_key(static_cast<uint64_t>(seeds[s]), static_cast<uint64_t>(positions[s] + accepted[s]), stream),
                   code, noise.data_ptr<float>() + i++ * vocab, vocab);
    }
  noise.log_().neg_();
  std::vector<float> residual(vocab), ratio(vocab);
  for (int64_t s = 0, i = 0; s < num_seqs; ++s) {
    const int64_t a = accepted[s];
    const float* dist = p + (first_row[s] + a) * vocab;
    if (a < depths[s]) {  // rejected: the residual max(0, p - q), unless it has no mass
      const float* qa = q + (first_draft[s] + a) * vocab;
      double mass = 0.0;
      for (int64_t v = 0; v < vocab; ++v) mass += residual[v] = std::max(dist[v] - qa[v], 0.f);
      if (mass > kEmpty) dist = residual.data();
    }
    last[s] = temperature[s] > 0.f ? race_probs(dist, noise.data_ptr<float>() + i++ * vocab, vocab, ratio.data())
                                   : first_max(dist, vocab);
  }
}

}  // namespace pdserve_native

namespace {

at::Tensor temperature_probs_op(const at::Tensor& logits, const at::Tensor& temperature) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && temperature.dim() == 1 &&
                  temperature.size(0) == logits.size(0) && temperature.scalar_type() == at::kFloat,
              "temperature_probs: logits must be float32 [rows, vocab] and temperature float32 [rows], got ",
              logits.sizes(), " and ", temperature.sizes());
  const at::Tensor l = logits.contiguous(), t = temperature.contiguous();
  const int64_t rows = l.size(0), vocab = l.size(1);
  at::Tensor out = at::empty({rows, vocab}, l.options());
  for (int64_t r = 0; r < rows; ++r)
    temperature_probs(l.data_ptr<float>() + r * vocab, vocab, t.data_ptr<float>()[r], out.data_ptr<float>() + r * vocab);
  return out;
}

std::tuple<at::Tensor, at::Tensor> rejection_rows(const at::Tensor& probs, const at::Tensor& draft_probs,
                                                  const at::Tensor& drafts, const at::Tensor& depths,
                                                  const at::Tensor& seeds, const at::Tensor& positions,
                                                  const at::Tensor& temperature, const at::Tensor& codes) {
  const auto is_long = [](const at::Tensor& t, int64_t n) {
    return t.dim() == 1 && t.size(0) == n && t.scalar_type() == at::kLong;
  };
  TORCH_CHECK(depths.dim() == 1 && depths.scalar_type() == at::kLong,
              "rejection_rows: depths must be int64 [seqs], got ", depths.sizes());
  const int64_t num_seqs = depths.size(0);
  const at::Tensor ks = depths.contiguous();
  int64_t num_drafts = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(ks.data_ptr<int64_t>()[s] >= 0, "rejection_rows: depth ", ks.data_ptr<int64_t>()[s], " of sequence ",
                s, " is negative");
    num_drafts += ks.data_ptr<int64_t>()[s];
  }
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == at::kFloat && probs.size(0) == num_drafts + num_seqs,
              "rejection_rows: probs must be float32 [", num_drafts + num_seqs, " (each sequence's depth + 1), vocab], got ",
              probs.sizes());
  const int64_t vocab = probs.size(1);
  TORCH_CHECK(draft_probs.dim() == 2 && draft_probs.scalar_type() == at::kFloat && draft_probs.size(0) == num_drafts &&
                  draft_probs.size(1) == vocab,
              "rejection_rows: draft_probs must be float32 [", num_drafts, ", ", vocab, "], got ", draft_probs.sizes());
  TORCH_CHECK(is_long(drafts, num_drafts) && is_long(seeds, num_seqs) && is_long(positions, num_seqs),
              "rejection_rows: drafts must be int64 [", num_drafts, "], seeds and positions int64 [", num_seqs, "], got ",
              drafts.sizes(), ", ", seeds.sizes(), " and ", positions.sizes());
  TORCH_CHECK(temperature.dim() == 1 && temperature.size(0) == num_seqs && temperature.scalar_type() == at::kFloat,
              "rejection_rows: temperature must be float32 [", num_seqs, "], got ", temperature.sizes());
  TORCH_CHECK(codes.dim() == 1 && codes.size(0) == vocab && codes.scalar_type() == at::kInt,
              "rejection_rows: codes must be int32 [", vocab, "], got ", codes.sizes());
  const at::Tensor d = drafts.contiguous(), pos = positions.contiguous();
  for (int64_t i = 0; i < num_drafts; ++i)
    TORCH_CHECK(d.data_ptr<int64_t>()[i] >= 0 && d.data_ptr<int64_t>()[i] < vocab, "rejection_rows: draft token ",
                d.data_ptr<int64_t>()[i], " out of range [0, ", vocab, ")");
  for (int64_t s = 0; s < num_seqs; ++s)
    TORCH_CHECK(pos.data_ptr<int64_t>()[s] >= 0, "rejection_rows: position of sequence ", s, " is negative");
  at::Tensor accepted = at::empty({num_seqs}, ks.options()), last = at::empty({num_seqs}, ks.options());
  pdserve_native::rejection_rule(probs.contiguous(), draft_probs.contiguous(), d.data_ptr<int64_t>(),
                                 ks.data_ptr<int64_t>(), seeds.contiguous().data_ptr<int64_t>(), pos.data_ptr<int64_t>(),
                                 temperature.contiguous().data_ptr<float>(), num_seqs, codes.contiguous(),
                                 accepted.data_ptr<int64_t>(), last.data_ptr<int64_t>());
  return {accepted, last};
}

}  // namespace

#ifndef PDSERVE_OP_NAMESPACE
#define PDSERVE_OP_NAMESPACE pdserve
#endif

TORCH_LIBRARY_FRAGMENT(PDSERVE_OP_NAMESPACE, m) {
  m.def("temperature_probs(Tensor logits, Tensor temperature) -> Tensor");
  m.def("rejection_rows(Tensor probs, Tensor draft_probs, Tensor drafts, Tensor depths, Tensor seeds, "
        "Tensor positions, Tensor temperature, Tensor codes) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(PDSERVE_OP_NAMESPACE, CPU, m) {
  m.impl("temperature_probs", &temperature_probs_op);
  m.impl("rejection_rows", &rejection_rows);
}
