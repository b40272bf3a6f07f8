// The layers that pdserve::decoder_forward and decoder_layer (decoder.cpp) and pdserve::draft_passes
// (draft_passes.cpp) share: a Llama model's rows through every layer's RMS norms, rotary, the
// projections (linear_packed's loops), the K/V write and attention (paged_attention_cpu, both
// called straight through native_ops.h) and the SwiGLU (`Decoder::layers`), a model's tensors
// checked once per call (`Decoder`), and a call's buffers (`Scratch`). The math is the model's
// (engine/model/llama.py), in float32, the norms' sums in another order. In an anonymous
// namespace, as attention_vectors.h: each file that includes it gets its own copy, none exported.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "attention_vectors.h"  // exp_nonpositive, exp_lanes_nonpositive, the lane types
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

// The vector lanes the loops below use: AVX-512's sixteen or AVX2's eight (attention_vectors.h).
#if defined(PDSERVE_AVX512)
using Lanes = Lanes16;
#elif defined(PDSERVE_AVX2)
using Lanes = Lanes8;
#endif

// out[m] = rms_norm(x[m]) * weight, over `rows` rows of `width`. The squares are summed in vector
// lanes and then across them (a scalar sum is one chain of `width` dependent adds: about a
// microsecond a row at width 256, seventeen norms a step).
inline void rms_norm(const float* x, const float* weight, float eps, int64_t rows, int64_t width, float* out) {
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
inline void rotate(float* row, int64_t heads, int64_t d, const float* cos, const float* sin) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h, row += d)
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = row[i], x2 = row[half + i];
      row[i] = x1 * cos[i] - x2 * sin[i];
      row[half + i] = x2 * cos[i] + x1 * sin[i];
    }
}

// out[i] = silu(gate[i]) * up[i] over n values, silu(g) = g * sigmoid(g) with the exp of -|g|:
// in vector lanes (the plain loop below stays scalar: its branch on g's sign kept the compiler
// from vectorizing it, a tenth of a speculative step's time with AVX-512), the rest in it.
inline void silu_times(const float* gate, const float* up, int64_t n, float* out) {
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
inline int64_t decoder_scratch_per_row(int64_t hidden, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
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

// A model's tensors for the ops, checked once per call: `weights` from its first `head`
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
    const auto cache_type = k0.scalar_type();
    TORCH_CHECK(k0.dim() == 4 && (cache_type == at::kFloat || cache_type == at::kBFloat16 || cache_type == at::kHalf),
                op, ": the caches must be float32, bfloat16 or float16 [blocks, block_size, heads, head_dim]");
    block_size = k0.size(1), head_dim = k0.size(3);
    const auto check_norm = [&](int64_t i) {  // the norms' weights; the projections check their own
      TORCH_CHECK(weights[i].scalar_type() == at::kFloat && weights[i].is_contiguous() && weights[i].numel() == hidden,
                  op, ": weight ", i, " must be a float32 norm weight [", hidden, "]");
    };
    check_norm(1);
    for (int64_t first = head; first < int64_t(weights.size()); first += kWeightsPerLayer)
      check_norm(first), check_norm(first + 5);
    for (const at::Tensor& c : kv_caches)
      TORCH_CHECK(c.sizes() == k0.sizes() && c.scalar_type() == cache_type && c.is_contiguous(),
                  op, ": every cache must be a contiguous tensor shaped like the first, of its dtype");
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

  // Rows' tokens `ids` (each checked against the vocabulary, refused in op's name) embedded into
  // `res` [rows, hidden], through every layer (`layers`' arguments), then the final norm: the
  // normed rows in s.normed [rows, hidden]. decoder_forward's step, spec_step's verification.
  void forward(const char* op, const int64_t* ids, int64_t rows, float* res, const int64_t* pos,
               const at::Tensor& slots, const at::Tensor& block_ids, const at::Tensor& lens, const at::Tensor& starts,
               const Scratch& s) const {
    const float* emb = weights[0].data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) {
      TORCH_CHECK(ids[r] >= 0 && ids[r] < vocab, op, ": token ", ids[r], " out of range");
      std::copy(emb + ids[r] * hidden, emb + (ids[r] + 1) * hidden, res + r * hidden);
    }
    layers(res, rows, pos, slots, block_ids, lens, starts, s);
    float* out = s.normed.data_ptr<float>();
    row_blocks(rows, [&](int64_t b, int64_t e) {
      rms_norm(res + b * hidden, weights[1].data_ptr<float>(), eps, e - b, hidden, out + b * hidden);
    });
  }
};

}  // namespace
