// pdserve::draft_passes: a draft model's passes of a speculative step, every one in one native call:
// pass j's pick is pass j + 1's input token, at the next position. The whole Llama forward of a
// few rows (embedding, RMS norms, rotary, the projections through linear_packed, the K/V write and
// attention through paged_attention_cpu, the MLP, the lm_head) and the pick, in C++.
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
// an empty tensor where the model has none. kv_caches: each layer's K then V, float32
// [blocks, block_size, kv_heads, head_dim]. temperature [S] float32 and noise [passes, S, vocab]
// float32, or none: a row with temperature <= 0 takes the argmax (the first largest), another the
// exponential race over its softmax at its temperature (`kernels/sampling.race_ref`). Returns the
// picks [passes, S].
//
// pdserve::decoder_forward (below): the same layers for one engine step (decode, a speculative
// verification, a prefill chunk), returning the final norm's output; for the target, whose step
// through a compiled graph spent about a third of a batch-1 decode step on op dispatch and the
// graph's own calls, and took 1.06-1.15x as long over a 64-128-token prompt's prefill.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "attention_vectors.h"  // exp_nonpositive, softmax_row16 / softmax_row8
#include "native_ops.h"

namespace {

// Rows per task of the row loops (norms, rotary, SwiGLU, residual adds): a long chunk (a prefill)
// splits them between threads, as the projections and the attention split theirs; a step of a few
// rows runs them inline, where a fork and join would cost more than the loops.
constexpr int64_t kRowGrain = 64;

// f(begin, end) over [0, rows), in tasks of kRowGrain rows or more between threads.
template <typename F>
void row_blocks(int64_t rows, const F& f) {
  at::parallel_for(0, rows, kRowGrain, f);
}

constexpr int64_t kWeightsPerLayer = 10;  // ln1, qkv (packed, bias), o (packed, bias), ln2, gate_up (.., ..), down (.., ..)
constexpr int64_t kHeadWeights = 4;       // embedding, final norm, lm_head (packed, bias)

c10::optional<at::Tensor> bias_of(const at::Tensor& t) {  // an empty tensor stands for none
  return t.numel() == 0 ? c10::optional<at::Tensor>() : c10::optional<at::Tensor>(t);
}

// The vector lanes the loops below use: AVX-512's sixteen or AVX2's eight (attention_vectors.h).
#if defined(PDSERVE_AVX512)
using Lanes = Lanes16;
#elif defined(PDSERVE_AVX2)
using Lanes = Lanes8;
#endif

// out[m] = rms_norm(x[m]) * weight, over `rows` rows of `width`. The squares are summed in vector
// lanes and then across them (a scalar sum is one chain of `width` dependent adds: about a
// microsecond a row at width 256, seventeen norms a step).
void rms_norm(const float* x, const float* weight, float eps, int64_t rows, int64_t width, float* out) {
  for (int64_t m = 0; m < rows; ++m, x += width, out += width) {
    float sum = 0.f;
    int64_t i = 0;
#if defined(PDSERVE_AVX2)
    Lanes::V lanes = Lanes::set1(0.f);
    for (; i + Lanes::kWidth <= width; i += Lanes::kWidth) {
      const Lanes::V v = Lanes::load(x + i);
      lanes = Lanes::fmadd(v, v, lanes);
    }
    sum = Lanes::sum(lanes);
#endif
    for (; i < width; ++i) sum += x[i] * x[i];
    const float r = 1.f / std::sqrt(sum / float(width) + eps);
    for (i = 0; i < width; ++i) out[i] = weight[i] * (x[i] * r);
  }
}

// Rotate-half rotary on `heads` heads of one row (head_dim d): x1' = x1 c - x2 s, x2' = x2 c + x1 s.
void rotate(float* row, int64_t heads, int64_t d, const float* cos, const float* sin) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h, row += d)
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = row[i], x2 = row[half + i];
      row[i] = x1 * cos[i] - x2 * sin[i];
      row[half + i] = x2 * cos[i] + x1 * sin[i];
    }
}

// The first index of the largest of n values (as torch.argmax: NaN apart, which no row holds).
int64_t first_max(const float* v, int64_t n) {
#ifdef PDSERVE_AVX512
  if (n >= 16) {  // the largest value, then the first lane holding it: two passes over a row in L1
    __m512 top = _mm512_loadu_ps(v);
    int64_t i = 16;
    for (; i + 16 <= n; i += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(v + i));
    float m = _mm512_reduce_max_ps(top);
    for (; i < n; ++i) m = std::max(m, v[i]);
    const __m512 mv = _mm512_set1_ps(m);
    for (i = 0; i + 16 <= n; i += 16)
      if (const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(v + i), mv, _CMP_EQ_OQ))
        return i + __builtin_ctz(hit);
    for (; i < n; ++i)
      if (v[i] == m) return i;
  }
#endif
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (v[i] > v[best]) best = i;
  return best;
}

// The exponential race over softmax(logits / t): the first largest p / E.
int64_t race(const float* logits, const float* noise, int64_t n, float t, std::vector<float>& probs) {
  probs.resize(n);
  for (int64_t i = 0; i < n; ++i) probs[i] = logits[i] / t;
#if defined(PDSERVE_AVX512)
  softmax_row16(probs.data(), n, n);
#elif defined(PDSERVE_AVX2)
  softmax_row8(probs.data(), n, n);
#else
  const float top = *std::max_element(probs.begin(), probs.end());
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += probs[i] = exp_nonpositive(probs[i] - top);
  for (int64_t i = 0; i < n; ++i) probs[i] /= sum;
#endif
  for (int64_t i = 0; i < n; ++i) probs[i] /= noise[i];
  return first_max(probs.data(), n);
}

// out[i] = silu(gate[i]) * up[i] over n values, silu(g) = g * sigmoid(g) with the exp of -|g|:
// in vector lanes (the plain loop below stays scalar: its branch on g's sign kept the compiler
// from vectorizing it, a tenth of a speculative step's time with AVX-512), the rest in it.
void silu_times(const float* gate, const float* up, int64_t n, float* out) {
  int64_t i = 0;
#if defined(PDSERVE_AVX2)
  const Lanes::V one = Lanes::set1(1.f);
  for (; i + Lanes::kWidth <= n; i += Lanes::kWidth) {
    const Lanes::V g = Lanes::load(gate + i);
    const Lanes::V e = exp_lanes_nonpositive<Lanes>(Lanes::neg_abs(g));
    const Lanes::V sig = Lanes::div(Lanes::where_nonnegative(g, one, e), Lanes::add(one, e));
    Lanes::store(out + i, Lanes::mul(Lanes::mul(g, sig), Lanes::load(up + i)));
  }
#endif
  for (; i < n; ++i) {
    const float g = gate[i], e = exp_nonpositive(-std::fabs(g));
    out[i] = g * ((g >= 0.f ? 1.f : e) / (1.f + e)) * up[i];
  }
}

// pdserve::decoder_scratch_per_row: the floats of scratch a row takes (decoder_layer's workspace):
// the norms' output, qkv, gate_up, the SwiGLU's output and a projection's.
int64_t decoder_scratch_per_row(int64_t hidden, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                int64_t intermediate) {
  return hidden + (num_heads + 2 * num_kv_heads) * head_dim + 2 * intermediate + intermediate + hidden;
}

// A call's buffers for the layers' rows: the norms' output, the projections' outputs, and q, k and
// v as views of qkv. Made once per call for its most rows (`Decoder::scratch`); `first` narrows
// them to fewer (a draft's passes after the catch-up's two rows a sequence).
struct Scratch {
  at::Tensor normed, qkv, gate_up, act, out, q, k, v;

  Scratch first(int64_t rows) const {
    const auto n = [rows](const at::Tensor& t) { return t.narrow(0, 0, rows); };
    return Scratch{n(normed), n(qkv), n(gate_up), n(act), n(out), n(q), n(k), n(v)};
  }
};

// A model's tensors for the ops below, checked once per call: `weights` from its first `head`
// tensors (the embedding, the final norm, then for draft_passes the lm_head, packed, and its bias)
// on, kWeightsPerLayer per layer (as `engine/native_forward.py`'s `native_weights` lists them).
struct Decoder {
  at::TensorList weights, kv_caches;
  int64_t head, num_layers, vocab, hidden, inter, block_size, num_heads, num_kv_heads, head_dim;
  const float* cos;
  const float* sin;
  int64_t max_position;
  float eps;
  double scale;

  Decoder(const char* op, int64_t head_weights, at::TensorList weights_, at::TensorList caches, const at::Tensor& cos_t,
          const at::Tensor& sin_t, int64_t heads, int64_t kv_heads, double eps_, double scale_)
      : weights(weights_), kv_caches(caches), head(head_weights), num_heads(heads), num_kv_heads(kv_heads),
        eps(float(eps_)), scale(scale_) {
    num_layers = int64_t(kv_caches.size()) / 2;
    TORCH_CHECK(num_layers >= 1 && int64_t(kv_caches.size()) == 2 * num_layers &&
                    int64_t(weights.size()) == head + kWeightsPerLayer * num_layers,
                op, ": ", weights.size(), " weights and ", kv_caches.size(), " caches do not make a model");
    const at::Tensor& embed = weights[0];
    TORCH_CHECK(embed.dim() == 2 && embed.scalar_type() == at::kFloat && embed.is_contiguous(),
                op, ": the embedding must be a contiguous float32 [vocab, hidden]");
    vocab = embed.size(0), hidden = embed.size(1);
    const at::Tensor& k0 = kv_caches[0];
    TORCH_CHECK(k0.dim() == 4 && k0.scalar_type() == at::kFloat,
                op, ": the caches must be float32 [blocks, block_size, heads, head_dim]");
    block_size = k0.size(1), head_dim = k0.size(3);
    const auto check_norm = [&](int64_t i) {  // the norms' weights; the projections check their own
      TORCH_CHECK(weights[i].scalar_type() == at::kFloat && weights[i].is_contiguous() && weights[i].numel() == hidden,
                  op, ": weight ", i, " must be a float32 norm weight [", hidden, "]");
    };
    check_norm(1);
    for (int64_t first = head; first < int64_t(weights.size()); first += kWeightsPerLayer)
      check_norm(first), check_norm(first + 5);
    for (const at::Tensor& c : kv_caches)
      TORCH_CHECK(c.sizes() == k0.sizes() && c.scalar_type() == at::kFloat && c.is_contiguous(),
                  op, ": every cache must be a contiguous float32 tensor shaped like the first");
    TORCH_CHECK(num_heads >= 1 && num_kv_heads >= 1 && k0.size(2) == num_kv_heads && num_heads % num_kv_heads == 0 &&
                    head_dim % 2 == 0,
                op, ": head counts do not match the cache");
    TORCH_CHECK(cos_t.dim() == 2 && cos_t.sizes() == sin_t.sizes() && cos_t.size(1) == head_dim / 2 &&
                    cos_t.scalar_type() == at::kFloat && sin_t.scalar_type() == at::kFloat && cos_t.is_contiguous() &&
                    sin_t.is_contiguous(),
                op, ": cos and sin must be contiguous float32 [positions, head_dim / 2]");
    cos = cos_t.data_ptr<float>(), sin = sin_t.data_ptr<float>(), max_position = cos_t.size(0);
    TORCH_CHECK(weights[head + 8].dim() == 3, op, ": the down projection must be packed (linear_pack)");
    inter = weights[head + 8].size(1);  // the down projection's in_features (its panels' rows)
    // every projection as linear_rows takes it, once here rather than per call: (weight index,
    // in_features, out_features) of qkv, o, gate_up and down
    const int64_t q_size = num_heads * head_dim, qkv_size = q_size + 2 * num_kv_heads * head_dim;
    const int64_t shapes[4][3] = {{1, hidden, qkv_size}, {3, q_size, hidden}, {6, hidden, 2 * inter}, {8, inter, hidden}};
    for (int64_t first = head; first < int64_t(weights.size()); first += kWeightsPerLayer)
      for (const auto& [i, in, out] : shapes) {
        const at::Tensor& bias = weights[first + i + 1];
        pdserve_native::check_packed(op, weights[first + i], bias.numel() == 0 ? at::Tensor() : bias, out);
        TORCH_CHECK(weights[first + i].size(1) == in, op, ": weight ", first + i, " takes ", weights[first + i].size(1),
                    " inputs, not ", in);
      }
  }

  int64_t scratch_per_row() const { return decoder_scratch_per_row(hidden, num_heads, num_kv_heads, head_dim, inter); }

  // The buffers for `rows` rows as views of one flat float32 buffer (`scratch_per_row` floats a
  // row at least): one allocation per call, or the caller's across calls (`decoder_layer`).
  Scratch scratch(int64_t rows, const at::Tensor& flat) const {
    const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
    int64_t offset = 0;
    const auto take = [&](int64_t width) {
      const at::Tensor t = flat.narrow(0, offset, rows * width).view({rows, width});
      offset += rows * width;
      return t;
    };
    const at::Tensor normed = take(hidden), qkv = take(q_size + 2 * kv_size), gate_up = take(2 * inter),
                     act = take(inter), out = take(hidden);
    return Scratch{normed, qkv, gate_up, act, out,
                   qkv.narrow(1, 0, q_size).view({rows, num_heads, head_dim}),
                   qkv.narrow(1, q_size, kv_size).view({rows, num_kv_heads, head_dim}),
                   qkv.narrow(1, q_size + kv_size, kv_size).view({rows, num_kv_heads, head_dim})};
  }

  Scratch scratch(int64_t rows, const at::TensorOptions& f32) const {
    return scratch(rows, at::empty({rows * scratch_per_row()}, f32));
  }

  // Rows' residual streams `res` [rows, hidden] (their embeddings in) through every layer, each
  // row's K/V written by `slots` and attending as `block_ids`, `lens` and `starts` say
  // (paged_attention_cpu's layout); row r rotated at position pos[r]; `s` holds `rows` rows. The
  // final norm is the caller's. Layers [first, end): every one unless given.
  void layers(float* res, int64_t rows, const int64_t* pos, const at::Tensor& slots, const at::Tensor& block_ids,
              const at::Tensor& lens, const at::Tensor& starts, const Scratch& s, int64_t first = 0,
              int64_t end = -1) const {
    const int64_t qkv_size = (num_heads + 2 * num_kv_heads) * head_dim;
    float* nrm = s.normed.data_ptr<float>();
    float* qkv_p = s.qkv.data_ptr<float>();
    float* gu = s.gate_up.data_ptr<float>();
    float* ap = s.act.data_ptr<float>();
    float* op = s.out.data_ptr<float>();
    const auto bias = [](const at::Tensor& t) { return t.numel() == 0 ? nullptr : t.data_ptr<float>(); };
    const auto norm = [&](const at::Tensor& weight) {
      row_blocks(rows, [&](int64_t b, int64_t e) {
        rms_norm(res + b * hidden, weight.data_ptr<float>(), eps, e - b, hidden, nrm + b * hidden);
      });
    };
    const auto add_out = [&] {  // res += op
      row_blocks(rows, [&](int64_t b, int64_t e) {
        for (int64_t i = b * hidden; i < e * hidden; ++i) res[i] += op[i];
      });
    };
    for (int64_t layer = first; layer < (end < 0 ? num_layers : end); ++layer) {
      const at::Tensor* w = weights.data() + head + layer * kWeightsPerLayer;
      norm(w[0]);
      pdserve_native::linear_rows(nrm, rows, w[1], bias(w[2]), qkv_size, qkv_p);
      row_blocks(rows, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r)  // q's and k's heads, neighbours in the row
          rotate(qkv_p + r * qkv_size, num_heads + num_kv_heads, head_dim, cos + pos[r] * (head_dim / 2),
                 sin + pos[r] * (head_dim / 2));
      });
      at::Tensor k_cache = kv_caches[2 * layer], v_cache = kv_caches[2 * layer + 1];
      const at::Tensor attn =
          pdserve_native::paged_attention(s.q, s.k, s.v, k_cache, v_cache, slots, block_ids, lens, starts, scale);
      pdserve_native::linear_rows(attn.data_ptr<float>(), rows, w[3], bias(w[4]), hidden, op);
      add_out();
      norm(w[5]);
      pdserve_native::linear_rows(nrm, rows, w[6], bias(w[7]), 2 * inter, gu);
      row_blocks(rows, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r)
          silu_times(gu + r * 2 * inter, gu + r * 2 * inter + inter, inter, ap + r * inter);
      });
      pdserve_native::linear_rows(ap, rows, w[8], bias(w[9]), hidden, op);
      add_out();
    }
  }
};

at::Tensor draft_passes(const at::Tensor& state, int64_t num_passes, bool catch_up, at::TensorList weights,
                        at::TensorList kv_caches, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
                        int64_t num_kv_heads, double eps, double scale, const c10::optional<at::Tensor>& temperature,
                        const c10::optional<at::Tensor>& noise) {
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
    for (int64_t s = 0; s < num_seqs; ++s) {
      const float t = sampled ? temperature->data_ptr<float>()[s] : 0.f;
      const int64_t pick = t <= 0.f ? first_max(lp + s * vocab, vocab)
                                    : race(lp + s * vocab, noise->data_ptr<float>() + (pass * num_seqs + s) * vocab,
                                           vocab, t, scratch);
      picks_p[pass * num_seqs + s] = pick;
      tokens[s] = pick;
      positions[s] += 1;
    }
  }
  return picks;
}

// The step's positions [T] int64, checked against the rotary table, with slot_mapping's shape.
at::Tensor checked_positions(const char* op, const Decoder& d, const at::Tensor& positions,
                             const at::Tensor& slot_mapping, int64_t rows) {
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == rows && positions.scalar_type() == at::kLong &&
                  slot_mapping.sizes() == positions.sizes(),
              op, ": positions and slot_mapping must be int64 [", rows, "] (one per row), got ", positions.sizes(),
              " and ", slot_mapping.sizes());
  const at::Tensor pos = positions.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(pp[r] >= 0 && pp[r] < d.max_position, op, ": position ", pp[r], " is outside the rotary table");
  return pos;
}

// pdserve::decoder_forward: one step's forward (decode, a speculative verification, a draft's
// catch-up, prefill chunks), every layer in C++, for the engine's ModelRunner: the final
// norm's output [tokens, hidden], the lm_head left to the caller (it scores only the rows it
// samples). input_ids and positions [T] int64; slot_mapping, block_ids, context_lens and
// query_starts as paged_attention_cpu takes them; weights: the embedding, the final norm, then
// kWeightsPerLayer per layer.
at::Tensor decoder_forward(const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& slot_mapping,
                           const at::Tensor& block_ids, const at::Tensor& context_lens, const at::Tensor& query_starts,
                           at::TensorList weights, at::TensorList kv_caches, const at::Tensor& cos,
                           const at::Tensor& sin, int64_t num_heads, int64_t num_kv_heads, double eps, double scale) {
  const Decoder d("decoder_forward", 2, weights, kv_caches, cos, sin, num_heads, num_kv_heads, eps, scale);
  TORCH_CHECK(input_ids.dim() == 1 && input_ids.scalar_type() == at::kLong,
              "decoder_forward: input_ids must be int64 [tokens], got ", input_ids.sizes());
  const int64_t rows = input_ids.size(0), hidden = d.hidden;
  const at::Tensor pos = checked_positions("decoder_forward", d, positions, slot_mapping, rows);
  const auto f32 = weights[0].options();
  const at::Tensor ids = input_ids.contiguous();
  const int64_t* idp = ids.data_ptr<int64_t>();
  const at::Tensor res = at::empty({rows, hidden}, f32);
  const Scratch scratch = d.scratch(rows, f32);
  float* rp = res.data_ptr<float>();
  const float* emb = weights[0].data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(idp[r] >= 0 && idp[r] < d.vocab, "decoder_forward: token ", idp[r], " out of range");
    std::copy(emb + idp[r] * hidden, emb + (idp[r] + 1) * hidden, rp + r * hidden);
  }
  d.layers(rp, rows, pos.data_ptr<int64_t>(), slot_mapping, block_ids, context_lens, query_starts, scratch);
  float* out = scratch.normed.data_ptr<float>();
  row_blocks(rows, [&](int64_t b, int64_t e) {
    rms_norm(rp + b * hidden, weights[1].data_ptr<float>(), d.eps, e - b, hidden, out + b * hidden);
  });
  return scratch.normed;  // the call's own buffer: the layers are done with it
}

// pdserve::decoder_layer: decoder_forward's layer `layer` alone, on the rows' residual streams
// `residual` [T, hidden] float32 (the embeddings before layer 0), updated in place, the layer's K/V
// written into its cache; `workspace`: float32, at least T times `decoder_scratch_per_row` floats,
// the layer's scratch (the caller's for every layer of a step: a 512-token prefill through eight
// calls that each allocated their own took 1.01-1.08x the time of one decoder_forward, with one
// workspace 0.98-1.04x; scratch A/B, ten interleaved repeats, one thread). For a step that hands
// each layer's K/V on as it lands (a prefill worker's, `native_forward.NativeForward` with a layer
// callback): the caller embeds, calls each layer in turn, and applies the final norm.
void decoder_layer(at::Tensor& residual, at::Tensor& workspace, const at::Tensor& positions,
                   const at::Tensor& slot_mapping, const at::Tensor& block_ids, const at::Tensor& context_lens,
                   const at::Tensor& query_starts, at::TensorList weights, at::TensorList kv_caches,
                   const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads, int64_t num_kv_heads, double eps,
                   double scale, int64_t layer) {
  const Decoder d("decoder_layer", 2, weights, kv_caches, cos, sin, num_heads, num_kv_heads, eps, scale);
  TORCH_CHECK(layer >= 0 && layer < d.num_layers, "decoder_layer: layer ", layer, " of a model of ", d.num_layers);
  TORCH_CHECK(residual.dim() == 2 && residual.size(1) == d.hidden && residual.scalar_type() == at::kFloat &&
                  residual.is_contiguous(),
              "decoder_layer: residual must be a contiguous float32 [tokens, ", d.hidden, "], got ", residual.sizes());
  const int64_t rows = residual.size(0);
  TORCH_CHECK(workspace.dim() == 1 && workspace.scalar_type() == at::kFloat && workspace.is_contiguous() &&
                  workspace.numel() >= rows * d.scratch_per_row(),
              "decoder_layer: workspace must be a contiguous float32 [>= ", rows * d.scratch_per_row(), "], got ",
              workspace.sizes());
  const at::Tensor pos = checked_positions("decoder_layer", d, positions, slot_mapping, rows);
  d.layers(residual.data_ptr<float>(), rows, pos.data_ptr<int64_t>(), slot_mapping, block_ids, context_lens,
           query_starts, d.scratch(rows, workspace), layer, layer + 1);
}

}  // namespace

#ifndef PDSERVE_OP_NAMESPACE
#define PDSERVE_OP_NAMESPACE pdserve
#endif

TORCH_LIBRARY_FRAGMENT(PDSERVE_OP_NAMESPACE, m) {
  m.def("draft_passes(Tensor state, int num_passes, bool catch_up, Tensor[] weights, Tensor(a!)[] kv_caches, "
        "Tensor cos, Tensor sin, int num_heads, int num_kv_heads, float eps, float scale, Tensor? temperature, "
        "Tensor? noise) -> Tensor");
  m.def("decoder_forward(Tensor input_ids, Tensor positions, Tensor slot_mapping, Tensor block_ids, "
        "Tensor context_lens, Tensor query_starts, Tensor[] weights, Tensor(a!)[] kv_caches, Tensor cos, Tensor sin, "
        "int num_heads, int num_kv_heads, float eps, float scale) -> Tensor");
  m.def("decoder_layer(Tensor(a!) residual, Tensor(c!) workspace, Tensor positions, Tensor slot_mapping, "
        "Tensor block_ids, Tensor context_lens, Tensor query_starts, Tensor[] weights, Tensor(b!)[] kv_caches, "
        "Tensor cos, Tensor sin, int num_heads, int num_kv_heads, float eps, float scale, int layer) -> ()");
  m.def("decoder_scratch_per_row(int hidden, int num_heads, int num_kv_heads, int head_dim, int intermediate) -> int",
        &decoder_scratch_per_row);
}

TORCH_LIBRARY_IMPL(PDSERVE_OP_NAMESPACE, CPU, m) {
  m.impl("draft_passes", &draft_passes);
  m.impl("decoder_forward", &decoder_forward);
  m.impl("decoder_layer", &decoder_layer);
}
