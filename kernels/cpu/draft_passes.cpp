// pdserve::draft_passes: a draft model's passes of a speculative step, every one in one native call:
// pass j's pick is pass j + 1's input token, at the next position. The whole Llama forward of a
// few rows (embedding, RMS norms, rotary, the projections through linear_packed, the K/V write and
// attention through paged_attention_cpu, the MLP, the lm_head) and the pick, in C++. The layers are
// decoder.h's (`Decoder::layers`), which decoder.cpp's ops run too. pdserve::spec_step (below): a
// speculative step's draft passes and the target's verification in one call, and
// pdserve::spec_step_rejection the same under the rejection sampler (its rule: rejection.cpp);
// pdserve::race_rows: the picks of logits rows as the passes and the verification pick (the
// sampler's CPU path; the picks themselves: pick.h).
//
// Why: a draft is small, so its passes are mostly fixed cost. On the demo draft (2 layers, hidden
// 128) a pass's arithmetic takes about 20 µs, while its compiled graph took about 115 µs (AMD
// EPYC, batch 1): eleven op calls and a dozen generated loops, each with a few microseconds of
// dispatch. That fixed cost is c in the speculation's speedup, (1 - a^(k+1)) / ((1 - a)(1 + k c)).
// Here a pass's ops call each other straight (native_ops.h) and its elementwise steps are loops
// over a few rows.
//
// The math is the model's (engine/model/llama.py), in float32, with sums in another order (RMS
// norm, softmax): the picks are a draft's proposals, which the target verifies, so they change how
// many drafts are accepted, never what is emitted. Tested against the model's own passes.
//
// state [S, head + W] int64: per sequence the input token, its position, then its block ids (W of
// them, those of the slots the passes write); with catch_up, head = 3: the token before the input
// token (at the position before), the input token, its position. The first pass then runs both
// tokens (their K/V written, the logits of the second). weights, as `engine/native_forward.py`'s
// `native_weights` lists them: the embedding [vocab, hidden], the final norm's weight, the
// lm_head (packed, bias), then per layer the input norm's weight, qkv (packed, bias), o (packed,
// bias), the post-attention norm's weight, gate_up (packed, bias), down (packed, bias); a bias is
// an empty tensor where the model has none. kv_caches: each layer's K then V, float32 (or
// all bfloat16, or all float16) [blocks, block_size, kv_heads, head_dim]. temperature [S]
// float32 and noise [passes, S, vocab] float32, or none: a row with temperature <= 0 takes the argmax (the first largest), another the
// exponential race over its softmax at its temperature (`kernels/sampling.race_ref`). Returns the
// picks [passes, S]. pdserve::draft_passes_logits: the same passes, and the logits each pass picked
// from [passes, S, vocab] float32: the rejection sampler needs the distribution every draft token
// was drawn from, and without them its draft ran its passes one call each (a step at batch 1,
// temperature 1: 3.39 ms against coupled's 1.50; BENCHMARKS.md, speculative decoding).
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <tuple>
#include <vector>

#include "decoder.h"  // Decoder, Scratch, rms_norm; attention_vectors.h's softmax and lanes
#include "pick.h"     // pick, race, first_max, temperature_probs

namespace {

c10::optional<at::Tensor> bias_of(const at::Tensor& t) {  // an empty tensor stands for none
  return t.numel() == 0 ? c10::optional<at::Tensor>() : c10::optional<at::Tensor>(t);
}

// The passes; where logits_out is given, each pass's logits are kept there [passes, S, vocab].
at::Tensor run_passes(const at::Tensor& state, int64_t num_passes, bool catch_up, at::TensorList weights,
                      at::TensorList kv_caches, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
                      int64_t num_kv_heads, double eps, double scale, const c10::optional<at::Tensor>& temperature,
                      const c10::optional<at::Tensor>& noise, at::Tensor* logits_out) {
  const int64_t head = catch_up ? 3 : 2;
  TORCH_CHECK(state.dim() == 2 && state.scalar_type() == at::kLong && state.size(1) > head && state.size(0) >= 1,
              "draft_passes: state must be int64 [seqs, ", head, " + block ids], got ", state.sizes());
  TORCH_CHECK(num_passes >= 1, "draft_passes: num_passes must be at least 1, got ", num_passes);
  const Decoder d("draft_passes", kHeadWeights, weights, kv_caches, cos, sin, num_heads, num_kv_heads, eps, scale);
  const int64_t vocab = d.vocab, hidden = d.hidden, block_size = d.block_size;
  const int64_t num_seqs = state.size(0), width = state.size(1) - head;
  const bool sampled = temperature.has_value();
  TORCH_CHECK(sampled == noise.has_value(), "draft_passes: temperature and noise come together");
  if (sampled)
    TORCH_CHECK(temperature->dim() == 1 && temperature->size(0) == num_seqs && temperature->scalar_type() == at::kFloat &&
                    noise->dim() == 3 && noise->size(0) >= num_passes && noise->size(1) == num_seqs &&
                    noise->size(2) == vocab && noise->scalar_type() == at::kFloat && noise->is_contiguous(),
                "draft_passes: temperature must be float32 [seqs] and noise float32 [passes, seqs, vocab]");

  const auto i64 = state.options();
  const auto f32 = weights[0].options();
  const at::Tensor st = state.contiguous();
  const int64_t* sp = st.data_ptr<int64_t>();
  const at::Tensor block_ids = st.narrow(1, head, width);
  const int64_t* ids = sp + head;
  const int64_t stride = st.size(1);

  std::vector<int64_t> tokens(num_seqs), positions(num_seqs), prev(num_seqs);
  for (int64_t s = 0; s < num_seqs; ++s) {
    tokens[s] = sp[s * stride + head - 2];
    positions[s] = sp[s * stride + head - 1];
    if (catch_up) prev[s] = sp[s * stride];
  }
  at::Tensor picks = at::empty({num_passes, num_seqs}, i64);
  int64_t* picks_p = picks.data_ptr<int64_t>();
  if (logits_out != nullptr) *logits_out = at::empty({num_passes, num_seqs, vocab}, f32);
  std::vector<float> scratch;
  // buffers for the most rows a pass has (the catch-up's two per sequence), and their views for
  // each row count: made once per call, not per pass
  const int64_t most_rows = num_seqs * (catch_up ? 2 : 1);
  const at::Tensor slots_buf = at::empty({most_rows}, i64), lens = at::empty({num_seqs}, i64),
                   starts = at::empty({num_seqs + 1}, i64), residual_buf = at::empty({most_rows, hidden}, f32),
                   last = at::empty({num_seqs, hidden}, f32);
  const Scratch most = d.scratch(most_rows, f32);
  struct Views { at::Tensor slots, residual; Scratch scratch; };
  const auto views_of = [&](int64_t rows) {
    return Views{slots_buf.narrow(0, 0, rows), residual_buf.narrow(0, 0, rows), most.first(rows)};
  };
  const Views one_each = views_of(num_seqs), two_each = catch_up ? views_of(2 * num_seqs) : one_each;
  std::vector<int64_t> row_token(most_rows), row_pos(most_rows);

  for (int64_t pass = 0; pass < num_passes; ++pass) {
    const int64_t nq = catch_up && pass == 0 ? 2 : 1, rows = num_seqs * nq;
    const Views& view = nq == 2 ? two_each : one_each;
    // each row's token and position, and where its K/V go
    int64_t* slot_p = view.slots.data_ptr<int64_t>();
    for (int64_t s = 0; s < num_seqs; ++s) {
      for (int64_t i = 0; i < nq; ++i) {
        const int64_t r = s * nq + i, pos = positions[s] - (nq - 1 - i);
        row_token[r] = nq == 2 && i == 0 ? prev[s] : tokens[s];
        row_pos[r] = pos;
        TORCH_CHECK(pos >= 0 && pos < d.max_position && pos / block_size < width, "draft_passes: position ", pos,
                    " of sequence ", s, " is outside its blocks or the rotary table");
        TORCH_CHECK(row_token[r] >= 0 && row_token[r] < vocab, "draft_passes: token ", row_token[r], " out of range");
        slot_p[r] = ids[s * stride + pos / block_size] * block_size + pos % block_size;
      }
      lens.data_ptr<int64_t>()[s] = positions[s] + 1;
      starts.data_ptr<int64_t>()[s] = s * nq;
    }
    starts.data_ptr<int64_t>()[num_seqs] = rows;

    float* res = view.residual.data_ptr<float>();
    const float* emb = weights[0].data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) std::copy(emb + row_token[r] * hidden, emb + (row_token[r] + 1) * hidden, res + r * hidden);
    d.layers(res, rows, row_pos.data(), view.slots, block_ids, lens, starts, view.scratch);

    // the final norm of each sequence's last row, the logits, the pick
    for (int64_t s = 0; s < num_seqs; ++s)
      rms_norm(res + (s * nq + nq - 1) * hidden, weights[1].data_ptr<float>(), d.eps, 1, hidden,
               last.data_ptr<float>() + s * hidden);
    at::Tensor logits = pdserve_native::linear_packed(last, weights[2], bias_of(weights[3]), vocab);
    const float* lp = logits.data_ptr<float>();
    if (logits_out != nullptr)
      std::memcpy(logits_out->data_ptr<float>() + pass * num_seqs * vocab, lp, sizeof(float) * num_seqs * vocab);
    for (int64_t s = 0; s < num_seqs; ++s) {
      const float t = sampled ? temperature->data_ptr<float>()[s] : 0.f;
      const float* row_noise = sampled ? noise->data_ptr<float>() + (pass * num_seqs + s) * vocab : nullptr;
      const int64_t picked = pick(lp + s * vocab, row_noise, vocab, t, scratch);
      picks_p[pass * num_seqs + s] = picked;
      tokens[s] = picked;
      positions[s] += 1;
    }
  }
  return picks;
}

at::Tensor draft_passes(const at::Tensor& state, int64_t num_passes, bool catch_up, at::TensorList weights,
                        at::TensorList kv_caches, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
                        int64_t num_kv_heads, double eps, double scale, const c10::optional<at::Tensor>& temperature,
                        const c10::optional<at::Tensor>& noise) {
  return run_passes(state, num_passes, catch_up, weights, kv_caches, cos, sin, num_heads, num_kv_heads, eps, scale,
                    temperature, noise, nullptr);
}

std::tuple<at::Tensor, at::Tensor> draft_passes_logits(
    const at::Tensor& state, int64_t num_passes, bool catch_up, at::TensorList weights, at::TensorList kv_caches,
    const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads, int64_t num_kv_heads, double eps, double scale,
    const c10::optional<at::Tensor>& temperature, const c10::optional<at::Tensor>& noise) {
  at::Tensor logits;
  at::Tensor picks = run_passes(state, num_passes, catch_up, weights, kv_caches, cos, sin, num_heads, num_kv_heads,
                                eps, scale, temperature, noise, &logits);
  return {picks, logits};
}

// pdserve::race_rows: each row's pick as draft_passes picks: a row with temperature <= 0 takes the
// argmax (the first largest), another the exponential race over its softmax at its temperature
// against its noise. logits and noise float32 [R, vocab], temperature float32 [R]; the picks [R]
// int64. The sampler's CPU path for rows that filter by temperature alone (`engine/sampler.py`), so
// that spec_step's verification, which picks with the same function, draws what plain sampling
// draws, bit for bit.
at::Tensor race_rows(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& noise) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && noise.sizes() == logits.sizes() &&
                  noise.scalar_type() == at::kFloat && temperature.dim() == 1 &&
                  temperature.size(0) == logits.size(0) && temperature.scalar_type() == at::kFloat,
              "race_rows: logits and noise must be float32 [rows, vocab] and temperature float32 [rows], got ",
              logits.sizes(), ", ", noise.sizes(), " and ", temperature.sizes());
  const at::Tensor l = logits.contiguous(), e = noise.contiguous(), t = temperature.contiguous();
  const int64_t rows = l.size(0), vocab = l.size(1);
  at::Tensor picks = at::empty({rows}, l.options().dtype(at::kLong));
  // rows split between threads only where a task has a quarter of a million logits or more (a
  // large vocabulary): the demo's 4096 keep a batch of 32 on the calling thread
  at::parallel_for(0, rows, std::max<int64_t>(1, (int64_t(1) << 18) / std::max<int64_t>(vocab, 1)),
                   [&](int64_t begin, int64_t end) {
                     std::vector<float> scratch;
                     for (int64_t r = begin; r < end; ++r) {
                       const float temp = t.data_ptr<float>()[r];
                       const float* row = l.data_ptr<float>() + r * vocab;
                       picks.data_ptr<int64_t>()[r] = pick(row, e.data_ptr<float>() + r * vocab, vocab, temp, scratch);
                     }
                   });
  return picks;
}

constexpr int64_t kCatchUpHead = 3;  // draft_passes' catch-up state: previous token, input token, its position

// A speculative step's state (draft_passes' catch-up state, [S, 3 + block ids] int64) and depths
// ([S] int64, each >= 0 and the deepest >= 1), checked: S, the deepest depth, and the
// verification's rows (each sequence's depth + 1).
std::tuple<int64_t, int64_t, int64_t> step_shape(const char* op, const at::Tensor& state, const at::Tensor& depths) {
  TORCH_CHECK(state.dim() == 2 && state.scalar_type() == at::kLong && state.size(1) > kCatchUpHead && state.size(0) >= 1,
              op, ": state must be int64 [seqs, 3 + block ids], got ", state.sizes());
  const int64_t num_seqs = state.size(0);
  TORCH_CHECK(depths.dim() == 1 && depths.size(0) == num_seqs && depths.scalar_type() == at::kLong, op,
              ": depths must be int64 [", num_seqs, "], got ", depths.sizes());
  const int64_t* kp = depths.data_ptr<int64_t>();
  int64_t deepest = 0, rows = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(kp[s] >= 0, op, ": depth ", kp[s], " of sequence ", s, " is negative");
    deepest = std::max(deepest, kp[s]);
    rows += kp[s] + 1;
  }
  TORCH_CHECK(deepest >= 1, op, ": no sequence has a draft to verify (every depth is 0)");
  return {num_seqs, deepest, rows};
}

// The target's verification of a speculative step: for each sequence of `state` (draft_passes'
// catch-up state), rows of its input token and its first k drafts (drafts [deepest, S], as
// draft_passes returns them) at positions p .. p + k (p: the state's position), their K/V written
// into the target's caches by the same block ids; the final norm and the lm_head. Returns the
// logits [rows, vocab], sequence after sequence.
at::Tensor verification_logits(const char* op, const Decoder& d, const at::Tensor& st, int64_t head,
                               const at::Tensor& drafts, const int64_t* kp, int64_t rows, at::TensorList weights) {
  const int64_t num_seqs = st.size(0), width = st.size(1) - head;
  const int64_t* sp = st.data_ptr<int64_t>();
  const int64_t stride = st.size(1), block_size = d.block_size;
  const int64_t* dp = drafts.data_ptr<int64_t>();
  const auto i64 = st.options();
  const at::Tensor slots = at::empty({rows}, i64), lens = at::empty({num_seqs}, i64),
                   starts = at::empty({num_seqs + 1}, i64);
  std::vector<int64_t> ids(rows), pos(rows);
  int64_t* slot_p = slots.data_ptr<int64_t>();
  for (int64_t s = 0, r = 0; s < num_seqs; ++s) {
    const int64_t p = sp[s * stride + head - 1];
    starts.data_ptr<int64_t>()[s] = r;
    lens.data_ptr<int64_t>()[s] = p + kp[s] + 1;
    for (int64_t j = 0; j <= kp[s]; ++j, ++r) {
      ids[r] = j == 0 ? sp[s * stride + head - 2] : dp[(j - 1) * num_seqs + s];
      pos[r] = p + j;
      TORCH_CHECK(pos[r] < d.max_position && pos[r] / block_size < width, op, ": position ", pos[r],
                  " of sequence ", s, " is outside its blocks or the rotary table");
      slot_p[r] = sp[s * stride + head + pos[r] / block_size] * block_size + pos[r] % block_size;
    }
  }
  starts.data_ptr<int64_t>()[num_seqs] = rows;
  const auto f32 = weights[0].options();
  const at::Tensor res = at::empty({rows, d.hidden}, f32);
  const Scratch scratch = d.scratch(rows, f32);
  d.forward(op, ids.data(), rows, res.data_ptr<float>(), pos.data(), slots, st.narrow(1, head, width), lens, starts,
            scratch);
  return pdserve_native::linear_packed(scratch.normed, weights[2], bias_of(weights[3]), d.vocab);
}

at::Tensor two_seconds(std::chrono::steady_clock::time_point start, std::chrono::steady_clock::time_point drafted,
                       std::chrono::steady_clock::time_point verified) {
  at::Tensor seconds = at::empty({2}, at::TensorOptions().dtype(at::kDouble));
  seconds.data_ptr<double>()[0] = std::chrono::duration<double>(drafted - start).count();
  seconds.data_ptr<double>()[1] = std::chrono::duration<double>(verified - drafted).count();
  return seconds;
}

// pdserve::spec_step: a speculative decode step's native work in one call, for sequences that
// decode greedily or sample by temperature alone. The draft's passes as draft_passes runs them with
// catch_up (state as it takes it, every sequence to the deepest of `depths`; temperature and noise
// as it takes them), then the target's verification of each sequence's own depth k (depths [S]
// int64, each >= 0 and the deepest >= 1; at depth 0 a sequence verifies its input token alone, as a
// plain step would, while its draft still runs to the deepest; `verification_logits`), and each
// row's pick as race_rows picks, row j of sequence s against noise[j, s] (noise [deepest + 1, S,
// vocab]: the draft's pass j raced the same row). weights: the target's, with its lm_head, as
// draft_weights are listed. Returns the drafts [S, deepest], the target's picks [sum(k + 1)]
// (sequence after sequence) and the seconds of the two parts, float64 [2] (the draft's passes, the
// verification), which the speculation gate weighs apart. The same drafts and picks as
// draft_passes, then decoder_forward, linear_packed and race_rows over the same rows: the engine's
// path, which builds the verification's inputs, splits its logits and samples them in Python between
// the calls (`engine/spec_decode/fused_step.py`, where it says what that cost).
std::tuple<at::Tensor, at::Tensor, at::Tensor> spec_step(
    const at::Tensor& state, const at::Tensor& depths, at::TensorList draft_weights, at::TensorList draft_caches,
    const at::Tensor& draft_cos, const at::Tensor& draft_sin, int64_t draft_heads, int64_t draft_kv_heads,
    double draft_eps, double draft_scale, at::TensorList weights, at::TensorList kv_caches, const at::Tensor& cos,
    const at::Tensor& sin, int64_t num_heads, int64_t num_kv_heads, double eps, double scale,
    const c10::optional<at::Tensor>& temperature, const c10::optional<at::Tensor>& noise) {
  using clock = std::chrono::steady_clock;
  const at::Tensor ks = depths.contiguous();
  const auto [num_seqs, deepest, rows] = step_shape("spec_step", state, ks);
  const Decoder d("spec_step", kHeadWeights, weights, kv_caches, cos, sin, num_heads, num_kv_heads, eps, scale);
  const bool sampled = temperature.has_value();
  TORCH_CHECK(sampled == noise.has_value(), "spec_step: temperature and noise come together");
  if (sampled)  // draft_passes checks them too, for its passes; the verification reads one row more
    TORCH_CHECK(noise->dim() == 3 && noise->size(0) == deepest + 1 && noise->size(1) == num_seqs &&
                    noise->size(2) == d.vocab && noise->scalar_type() == at::kFloat && noise->is_contiguous(),
                "spec_step: noise must be float32 [", deepest + 1, ", ", num_seqs, ", ", d.vocab, "], got ",
                noise->sizes());
  const auto start = clock::now();
  const at::Tensor drafts = draft_passes(state, deepest, true, draft_weights, draft_caches, draft_cos, draft_sin,
                                         draft_heads, draft_kv_heads, draft_eps, draft_scale, temperature,
                                         noise);  // [deepest, S]
  const auto drafted = clock::now();
  const at::Tensor st = state.contiguous();
  const int64_t* kp = ks.data_ptr<int64_t>();
  const at::Tensor logits = verification_logits("spec_step", d, st, kCatchUpHead, drafts, kp, rows, weights);
  at::Tensor picks = at::empty({rows}, st.options());
  const float* lp = logits.data_ptr<float>();
  std::vector<float> probs;
  for (int64_t s = 0, r = 0; s < num_seqs; ++s) {
    const float t = sampled ? temperature->data_ptr<float>()[s] : 0.f;
    for (int64_t j = 0; j <= kp[s]; ++j, ++r)
      picks.data_ptr<int64_t>()[r] =
          pick(lp + r * d.vocab, sampled ? noise->data_ptr<float>() + (j * num_seqs + s) * d.vocab : nullptr, d.vocab,
               t, probs);
  }
  return {drafts.t().contiguous(), picks, two_seconds(start, drafted, clock::now())};
}

// pdserve::spec_step_rejection: spec_step under the rejection sampler, for a step with sampled
// rows (temperature [S] float32: a row at t <= 0 is greedy). The draft's passes race noise [deepest,
// S, vocab] (the draft stream's rows, pass j's at position p + 1 + j) and keep their logits; the
// verification as spec_step's; then q of each sequence's drafts and p of its verified rows at its
// temperature (`temperature_probs`), and the rejection rule over them (`rejection_rule`,
// rejection.cpp), with each sequence's seed (seeds [S] int64) and `rng._vocab_codes` (codes [vocab]
// int32) for its draws, at positions p + 1 on. Returns the drafts [S, deepest], the accepted counts
// and the last tokens (int64 [S] each), and the seconds of the two parts, float64 [2] (the rule
// counts with the verification). The same tokens as the engine's path: draft_passes_logits, then
// decoder_forward and linear_packed, then temperature_probs and rejection_rows over the same rows
// (`RejectionVerifier`).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> spec_step_rejection(
    const at::Tensor& state, const at::Tensor& depths, at::TensorList draft_weights, at::TensorList draft_caches,
    const at::Tensor& draft_cos, const at::Tensor& draft_sin, int64_t draft_heads, int64_t draft_kv_heads,
    double draft_eps, double draft_scale, at::TensorList weights, at::TensorList kv_caches, const at::Tensor& cos,
    const at::Tensor& sin, int64_t num_heads, int64_t num_kv_heads, double eps, double scale,
    const at::Tensor& temperature, const at::Tensor& noise, const at::Tensor& seeds, const at::Tensor& codes) {
  using clock = std::chrono::steady_clock;
  const at::Tensor ks = depths.contiguous();
  const auto [num_seqs, deepest, rows] = step_shape("spec_step_rejection", state, ks);
  const Decoder d("spec_step_rejection", kHeadWeights, weights, kv_caches, cos, sin, num_heads, num_kv_heads, eps,
                  scale);
  const int64_t vocab = d.vocab;
  TORCH_CHECK(noise.dim() == 3 && noise.size(0) == deepest && noise.size(1) == num_seqs && noise.size(2) == vocab &&
                  noise.scalar_type() == at::kFloat && noise.is_contiguous(),
              "spec_step_rejection: noise must be float32 [", deepest, ", ", num_seqs, ", ", vocab, "], got ",
              noise.sizes());
  TORCH_CHECK(seeds.dim() == 1 && seeds.size(0) == num_seqs && seeds.scalar_type() == at::kLong,
              "spec_step_rejection: seeds must be int64 [", num_seqs, "], got ", seeds.sizes());
  TORCH_CHECK(codes.dim() == 1 && codes.size(0) == vocab && codes.scalar_type() == at::kInt && codes.is_contiguous(),
              "spec_step_rejection: codes must be int32 [", vocab, "], got ", codes.sizes());
  const auto start = clock::now();
  at::Tensor draft_logits;  // [deepest, S, vocab]
  const at::Tensor drafts = run_passes(state, deepest, true, draft_weights, draft_caches, draft_cos, draft_sin,
                                       draft_heads, draft_kv_heads, draft_eps, draft_scale, temperature, noise,
                                       &draft_logits);  // [deepest, S]; run_passes checks temperature
  const auto drafted = clock::now();
  const at::Tensor st = state.contiguous();
  const int64_t* kp = ks.data_ptr<int64_t>();
  const at::Tensor logits = verification_logits("spec_step_rejection", d, st, kCatchUpHead, drafts, kp, rows, weights);
  const float* t = temperature.data_ptr<float>();
  const at::Tensor p = at::empty({rows, vocab}, logits.options()), q = at::empty({rows - num_seqs, vocab}, logits.options());
  std::vector<int64_t> draft_ids(rows - num_seqs), positions(num_seqs);
  const int64_t* dp = drafts.data_ptr<int64_t>();
  for (int64_t s = 0, r = 0, i = 0; s < num_seqs; ++s) {
    positions[s] = st.data_ptr<int64_t>()[s * st.size(1) + kCatchUpHead - 1] + 1;
    for (int64_t j = 0; j <= kp[s]; ++j, ++r)
      temperature_probs(logits.data_ptr<float>() + r * vocab, vocab, t[s], p.data_ptr<float>() + r * vocab);
    for (int64_t j = 0; j < kp[s]; ++j, ++i) {
      temperature_probs(draft_logits.data_ptr<float>() + (j * num_seqs + s) * vocab, vocab, t[s],
                        q.data_ptr<float>() + i * vocab);
      draft_ids[i] = dp[j * num_seqs + s];
    }
  }
  at::Tensor accepted = at::empty({num_seqs}, st.options()), last = at::empty({num_seqs}, st.options());
  const at::Tensor seed = seeds.contiguous();
  pdserve_native::rejection_rule(p, q, draft_ids.data(), kp, seed.data_ptr<int64_t>(), positions.data(), t, num_seqs,
                                 codes, accepted.data_ptr<int64_t>(), last.data_ptr<int64_t>());
  return {drafts.t().contiguous(), accepted, last, two_seconds(start, drafted, clock::now())};
}

}  // namespace

#ifndef PDSERVE_OP_NAMESPACE
#define PDSERVE_OP_NAMESPACE pdserve
#endif

TORCH_LIBRARY_FRAGMENT(PDSERVE_OP_NAMESPACE, m) {
  m.def("draft_passes(Tensor state, int num_passes, bool catch_up, Tensor[] weights, Tensor(a!)[] kv_caches, "
        "Tensor cos, Tensor sin, int num_heads, int num_kv_heads, float eps, float scale, Tensor? temperature, "
        "Tensor? noise) -> Tensor");
  m.def("draft_passes_logits(Tensor state, int num_passes, bool catch_up, Tensor[] weights, Tensor(a!)[] kv_caches, "
        "Tensor cos, Tensor sin, int num_heads, int num_kv_heads, float eps, float scale, Tensor? temperature, "
        "Tensor? noise) -> (Tensor, Tensor)");
  m.def("spec_step(Tensor state, Tensor depths, Tensor[] draft_weights, Tensor(a!)[] draft_caches, "
        "Tensor draft_cos, Tensor draft_sin, int draft_heads, int draft_kv_heads, float draft_eps, float draft_scale, "
        "Tensor[] weights, Tensor(b!)[] kv_caches, Tensor cos, Tensor sin, int num_heads, int num_kv_heads, float eps, "
        "float scale, Tensor? temperature, Tensor? noise) -> (Tensor, Tensor, Tensor)");
  m.def("spec_step_rejection(Tensor state, Tensor depths, Tensor[] draft_weights, Tensor(a!)[] draft_caches, "
        "Tensor draft_cos, Tensor draft_sin, int draft_heads, int draft_kv_heads, float draft_eps, float draft_scale, "
        "Tensor[] weights, Tensor(b!)[] kv_caches, Tensor cos, Tensor sin, int num_heads, int num_kv_heads, float eps, "
        "float scale, Tensor temperature, Tensor noise, Tensor seeds, Tensor codes) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("race_rows(Tensor logits, Tensor temperature, Tensor noise) -> Tensor");
}

TORCH_LIBRARY_IMPL(PDSERVE_OP_NAMESPACE, CPU, m) {
  m.impl("draft_passes", &draft_passes);
  m.impl("draft_passes_logits", &draft_passes_logits);
  m.impl("spec_step", &spec_step);
  m.impl("spec_step_rejection", &spec_step_rejection);
  m.impl("race_rows", &race_rows);
}
