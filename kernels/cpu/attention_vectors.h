// The vector math of pdserve::paged_attention_cpu (paged_attention.cpp; decoder.h and
// draft_passes.cpp also take the exp, the softmax and the lane types, for the norms, the SwiGLU and
// a draft's picks): the exp of non-positive floats, the softmax of a row of scores, sixteen
// (AVX-512) or eight (AVX2) keys' dot products with a query row (with AVX-512 also sixteen keys
// transposed once and scored against many rows, in even passes of rows), and value rows weighted
// into accumulators held in registers. Each loop is a function of pointers and counts; what the
// attention reads, and in what order, is the includer's.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PDSERVE_AVX2 1
#if defined(__AVX512F__)
#define PDSERVE_AVX512 1
#endif
#endif

namespace {

// exp(x) for x <= 0 in plain float ops the compiler vectorizes (std::exp is a scalar call):
// 2^n * p(r), r = x - n ln 2 in [-ln2/2, ln2/2], p of degree 6 (relative error ~2e-7);
// anything below -87 gives 0.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.f);
  // round to nearest (x <= 0): truncating x * log2(e) - 0.5 toward zero; a conversion the
  // vectorizer keeps in vector registers, where std::nearbyint is a scalar call
  const float n = static_cast<float>(static_cast<int32_t>(x * 1.44269504088896341f - 0.5f));
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

#ifdef PDSERVE_AVX2
// Eight keys' dot products with one query row (float32, HD a multiple of 8): eight accumulators
// of one FMA chain each, summed across lanes together at the end (three shuffle-add levels for
// all eight, where one reduction per key took about as long as the key's FMAs).
template <int HD>
inline void dot8(const float* q, const float* keys, int64_t key_stride, float* out) {
  __m256 a[8];
  for (int k = 0; k < 8; ++k) a[k] = _mm256_setzero_ps();
  for (int d = 0; d < HD; d += 8) {
    const __m256 qd = _mm256_loadu_ps(q + d);
    for (int k = 0; k < 8; ++k) a[k] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(keys + k * key_stride + d), a[k]);
  }
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
}

inline float hsum8(__m256 v);

// exp_nonpositive on a vector's lanes, for the lane types below (Lanes8: AVX2, Lanes16:
// AVX-512): the same range reduction and polynomial, 2^n applied as the lanes allow
template <typename L>
inline typename L::V exp_lanes_nonpositive(typename L::V x) {
  using V = typename L::V;
  x = L::max(x, L::set1(-87.f));
  const V n = L::round(L::mul(x, L::set1(1.44269504088896341f)));
  const V r = L::fnmadd(n, L::set1(1.428606765330187045e-06f), L::fnmadd(n, L::set1(0.693145751953125f), x));
  V p = L::set1(1.f / 720.f);
  for (const float c : {1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f}) p = L::fmadd(p, r, L::set1(c));
  return L::times_pow2(p, n);
}

struct Lanes8 {
  using V = __m256;
  static constexpr int kWidth = 8;
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V a) { _mm256_storeu_ps(p, a); }
  static V set1(float a) { return _mm256_set1_ps(a); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V round(V a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V fnmadd(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V neg_abs(V a) { return _mm256_or_ps(a, _mm256_set1_ps(-0.f)); }  // -|a|: the sign bit set
  static V where_nonnegative(V x, V a, V b) {  // a where x >= 0, else b
    return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ));
  }
  static float sum(V a) { return hsum8(a); }
  static V times_pow2(V p, V n) {  // 2^n built in the exponent bits (n >= -126 since x >= -87: a normal float)
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  }
};

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

inline float hsum8(__m256 v) {  // the sum of the eight lanes
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

// A row of scores in place: softmax over its first `visible`, zero for the rest up to `end`
// (eight lanes at a time, the last few in scalar code).
inline void softmax_row8(float* row, int64_t visible, int64_t end) {
  const int64_t full = visible & ~int64_t{7};
  __m256 mv = _mm256_set1_ps(-INFINITY);
  for (int64_t j = 0; j < full; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(row + j));
  float m = hmax8(mv);
  for (int64_t j = full; j < visible; ++j) m = std::max(m, row[j]);
  const __m256 mx = _mm256_set1_ps(m);
  __m256 sv = _mm256_setzero_ps();
  for (int64_t j = 0; j < full; j += 8) {
    const __m256 e = exp_lanes_nonpositive<Lanes8>(_mm256_sub_ps(_mm256_loadu_ps(row + j), mx));
    _mm256_storeu_ps(row + j, e);
    sv = _mm256_add_ps(sv, e);
  }
  float sum = hsum8(sv);
  for (int64_t j = full; j < visible; ++j) sum += row[j] = exp_nonpositive(row[j] - m);
  const float inv = 1.f / sum;
  const __m256 iv = _mm256_set1_ps(inv);
  for (int64_t j = 0; j < full; j += 8) _mm256_storeu_ps(row + j, _mm256_mul_ps(_mm256_loadu_ps(row + j), iv));
  for (int64_t j = full; j < visible; ++j) row[j] *= inv;
  for (int64_t j = visible; j < end; ++j) row[j] = 0.f;
}

// acc (HD floats) += sum over the n rows of w[j] * values[j * stride]: the accumulator in
// registers for a whole block, L::kWidth lanes at a time (Lanes8: AVX2, Lanes16: AVX-512).
template <typename L, int HD>
inline void axpy_row(const float* w, const float* values, int64_t stride, int64_t n, float* acc) {
  constexpr int kW = L::kWidth;
  typename L::V a[HD / kW];
  for (int d = 0; d < HD / kW; ++d) a[d] = L::load(acc + kW * d);
  for (int64_t j = 0; j < n; ++j) {
    const typename L::V wj = L::set1(w[j]);
    for (int d = 0; d < HD / kW; ++d) a[d] = L::fmadd(wj, L::load(values + j * stride + kW * d), a[d]);
  }
  for (int d = 0; d < HD / kW; ++d) L::store(acc + kW * d, a[d]);
}
#endif

#ifdef PDSERVE_AVX512
// The sums of sixteen vectors, as the sixteen lanes of one (lane t: the sum of a[t]): four
// levels of shuffle-and-add, each halving the vectors, 45 instructions for all sixteen.
inline __m512 sum16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int p = 0; p < 8; ++p)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of the pair (a, b)
    b[p] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * p], a[2 * p + 1]), _mm512_unpackhi_ps(a[2 * p], a[2 * p + 1]));
  for (int p = 0; p < 4; ++p) {  // per 128-bit lane: that lane's sum of a[4p], ..., a[4p + 3]
    const __m512d x = _mm512_castps_pd(b[2 * p]), y = _mm512_castps_pd(b[2 * p + 1]);
    c[p] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // across the 128-bit lanes: d0 = [c0 lanes 0+1, c0 lanes 2+3, c1 lanes 0+1, c1 lanes 2+3], d1 the same of c2, c3
  d[0] = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  d[1] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
}

// Sixteen keys' dot products with one query row (HD a multiple of 16).
template <int HD>
inline void dot16(const float* q, const float* keys, int64_t key_stride, float* out) {
  __m512 qv[HD / 16], a[16];
  for (int d = 0; d < HD / 16; ++d) qv[d] = _mm512_loadu_ps(q + 16 * d);
  for (int k = 0; k < 16; ++k) {
    a[k] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(keys + k * key_stride));
    for (int d = 1; d < HD / 16; ++d) a[k] = _mm512_fmadd_ps(qv[d], _mm512_loadu_ps(keys + k * key_stride + 16 * d), a[k]);
  }
  _mm512_storeu_ps(out, sum16(a));
}

// Sixteen keys (rows `key_stride` floats apart, HD floats each) transposed into kt [HD][16]: kt
// row d holds dimension d of every key, so one query row's sixteen scores are HD multiply-adds of
// broadcast query values, with no horizontal sums. Per block of sixteen dimensions, the usual
// four levels of shuffles (64 instructions): 32-bit then 64-bit interleaves within 128-bit lanes,
// then two levels of 128-bit lane shuffles.
template <int HD>
inline void transpose16(const float* keys, int64_t key_stride, float* kt) {
  for (int d0 = 0; d0 < HD; d0 += 16) {
    __m512 r[16], a[16], b[16];
    for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_ps(keys + j * key_stride + d0);
    for (int p = 0; p < 8; ++p) {  // a[2p], a[2p+1]: rows 2p and 2p+1 interleaved, dims 4L+0,1 / 4L+2,3 of lane L
      a[2 * p] = _mm512_unpacklo_ps(r[2 * p], r[2 * p + 1]);
      a[2 * p + 1] = _mm512_unpackhi_ps(r[2 * p], r[2 * p + 1]);
    }
    for (int q = 0; q < 4; ++q) {  // b[4q+m], lane L: dimension 4L+m of rows 4q .. 4q+3
      const __m512d x0 = _mm512_castps_pd(a[4 * q]), x1 = _mm512_castps_pd(a[4 * q + 1]);
      const __m512d y0 = _mm512_castps_pd(a[4 * q + 2]), y1 = _mm512_castps_pd(a[4 * q + 3]);
      b[4 * q] = _mm512_castpd_ps(_mm512_unpacklo_pd(x0, y0));
      b[4 * q + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(x0, y0));
      b[4 * q + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(x1, y1));
      b[4 * q + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(x1, y1));
    }
    for (int m = 0; m < 4; ++m) {  // dimension 4L+m: lane L of b[m], b[4+m], b[8+m], b[12+m]
      const __m512 c0 = _mm512_shuffle_f32x4(b[m], b[4 + m], 0x44), c1 = _mm512_shuffle_f32x4(b[m], b[4 + m], 0xEE);
      const __m512 c2 = _mm512_shuffle_f32x4(b[8 + m], b[12 + m], 0x44), c3 = _mm512_shuffle_f32x4(b[8 + m], b[12 + m], 0xEE);
      _mm512_storeu_ps(kt + (d0 + m) * 16, _mm512_shuffle_f32x4(c0, c2, 0x88));
      _mm512_storeu_ps(kt + (d0 + 4 + m) * 16, _mm512_shuffle_f32x4(c0, c2, 0xDD));
      _mm512_storeu_ps(kt + (d0 + 8 + m) * 16, _mm512_shuffle_f32x4(c1, c3, 0x88));
      _mm512_storeu_ps(kt + (d0 + 12 + m) * 16, _mm512_shuffle_f32x4(c1, c3, 0xDD));
    }
  }
}

// `count` rows in passes of at most MaxR, as even as they go (ten as 5 + 5, not 4 + 4 + 1 + 1: a
// pass of one or two rows is bound by its multiply-adds' latency, not their throughput), each pass
// as f(std::integral_constant<int, R>{}, first row).
template <int MaxR, typename F>
inline void even_passes(int64_t count, F&& f) {
  static_assert(MaxR >= 1 && MaxR <= 6);
  const int64_t passes = (count + MaxR - 1) / MaxR;
  for (int64_t p = 0, m = 0; p < passes; ++p) {
    const int64_t rows = (count - m + passes - p - 1) / (passes - p);
    switch (rows) {
      case 1: f(std::integral_constant<int, 1>{}, m); break;
      case 2: if constexpr (MaxR >= 2) f(std::integral_constant<int, 2>{}, m); break;
      case 3: if constexpr (MaxR >= 3) f(std::integral_constant<int, 3>{}, m); break;
      case 4: if constexpr (MaxR >= 4) f(std::integral_constant<int, 4>{}, m); break;
      case 5: if constexpr (MaxR >= 5) f(std::integral_constant<int, 5>{}, m); break;
      default: if constexpr (MaxR >= 6) f(std::integral_constant<int, 6>{}, m); break;
    }
    m += rows;
  }
}

// R query rows' sixteen scores (q[m], HD floats) against transposed keys kt (`transpose16`), into
// out[m]: even and odd dimensions in separate accumulators (2R independent chains).
template <int R, int HD>
inline void dot16_transposed_rows(const float* const* q, float* const* out, const float* kt) {
  __m512 even[R], odd[R];
  for (int m = 0; m < R; ++m) even[m] = odd[m] = _mm512_setzero_ps();
  for (int d = 0; d < HD; d += 2) {
    const __m512 k0 = _mm512_loadu_ps(kt + d * 16), k1 = _mm512_loadu_ps(kt + (d + 1) * 16);
    for (int m = 0; m < R; ++m) {
      even[m] = _mm512_fmadd_ps(_mm512_set1_ps(q[m][d]), k0, even[m]);
      odd[m] = _mm512_fmadd_ps(_mm512_set1_ps(q[m][d + 1]), k1, odd[m]);
    }
  }
  for (int m = 0; m < R; ++m) _mm512_storeu_ps(out[m], _mm512_add_ps(even[m], odd[m]));
}

// The sixteen scores of each of `count` query rows against transposed keys, in even passes of up
// to six rows (twelve chains).
template <int HD>
inline void dot16_transposed(const float* const* q, float* const* out, int64_t count, const float* kt) {
  even_passes<6>(count, [&](auto r, int64_t m) { dot16_transposed_rows<decltype(r)::value, HD>(q + m, out + m, kt); });
}

// R rows' accumulators (HD floats each; row m's at acc + m * HD) += their weights (row m's at
// w + m * w_stride, from the first block's first key on) times the value rows of `num_blocks`
// blocks (block b's at blocks[b], rows `stride` apart: `block_size` rows, `last_n` in the last).
// Each value row is loaded once for all R rows (query rows of one KV head), and the R * HD / 16
// accumulators stay in registers as independent chains of multiply-adds (eight at R = 4, HD =
// 32: enough to keep both FMA pipes busy, where two rows' four chains waited on each other's
// latency), across every block: called per block, each call loaded and stored them again, and a
// prefill chunk's value pass ran at 64 GFLOP/s against 112 with them held across all 464 keys (a
// scratch C++ loop on the AMD EPYC, 6 rows of head_dim 32). Each accumulator sums its keys in the
// same order either way: the results are the same.
template <int R, int HD>
inline void axpy_rows_blocks(const float* w, int64_t w_stride, const float* const* blocks, int64_t num_blocks,
                             int64_t block_size, int64_t last_n, int64_t stride, float* acc) {
  constexpr int V = HD / 16;
  __m512 a[R][V];
  for (int m = 0; m < R; ++m)
    for (int d = 0; d < V; ++d) a[m][d] = _mm512_loadu_ps(acc + m * HD + 16 * d);
  for (int64_t b = 0; b < num_blocks; ++b, w += block_size) {
    const float* values = blocks[b];
    const int64_t n = b + 1 < num_blocks ? block_size : last_n;
    for (int64_t j = 0; j < n; ++j) {
      __m512 v[V];
      for (int d = 0; d < V; ++d) v[d] = _mm512_loadu_ps(values + j * stride + 16 * d);
      for (int m = 0; m < R; ++m) {
        const __m512 x = _mm512_set1_ps(w[m * w_stride + j]);
        for (int d = 0; d < V; ++d) a[m][d] = _mm512_fmadd_ps(x, v[d], a[m][d]);
      }
    }
  }
  for (int m = 0; m < R; ++m)
    for (int d = 0; d < V; ++d) _mm512_storeu_ps(acc + m * HD + 16 * d, a[m][d]);
}

// `axpy_rows_blocks` over n value rows of one block.
template <int R, int HD>
inline void axpy_rows(const float* w, int64_t w_stride, const float* values, int64_t stride, int64_t n, float* acc) {
  axpy_rows_blocks<R, HD>(w, w_stride, &values, 1, n, n, stride, acc);
}

// `count` consecutive rows as `axpy_rows` takes them, in even passes of as many rows as keep the
// accumulators within sixteen registers, six at most (HD 32: 5 + 5 for a 5-token verification's
// ten rows, where four at a time left a two-row pass waiting on its chains' latency).
template <int HD>
inline void axpy_row_run(const float* w, int64_t w_stride, const float* values, int64_t stride, int64_t n, float* acc,
                         int64_t count) {
  constexpr int kMaxRows = std::clamp(16 / (HD / 16), 1, 6);
  even_passes<kMaxRows>(count, [&](auto r, int64_t m) {
    axpy_rows<decltype(r)::value, HD>(w + m * w_stride, w_stride, values, stride, n, acc + m * HD);
  });
}

struct Lanes16 {
  using V = __m512;
  static constexpr int kWidth = 16;
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V a) { _mm512_storeu_ps(p, a); }
  static V set1(float a) { return _mm512_set1_ps(a); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V round(V a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V fnmadd(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V neg_abs(V a) {  // -|a|: the sign bit set (integer or: _mm512_or_ps needs AVX512DQ)
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(a), _mm512_set1_epi32(INT32_MIN)));
  }
  static V where_nonnegative(V x, V a, V b) {  // a where x >= 0, else b
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ), b, a);
  }
  static float sum(V a) { return _mm512_reduce_add_ps(a); }
  static V times_pow2(V p, V n) { return _mm512_scalef_ps(p, n); }
};

// A row of scores in place: softmax over its first `visible`, zero for the rest up to `end`.
inline void softmax_row16(float* row, int64_t visible, int64_t end) {
  const int64_t full = visible & ~int64_t{15};
  const __mmask16 tail = static_cast<__mmask16>((1u << (visible - full)) - 1);
  // the max in four chains: one chain of dependent maxes waited on each one's latency
  __m512 m = _mm512_set1_ps(-INFINITY), m1 = m, m2 = m, m3 = m;
  int64_t j = 0;
  for (; j + 64 <= full; j += 64) {
    m = _mm512_max_ps(m, _mm512_loadu_ps(row + j));
    m1 = _mm512_max_ps(m1, _mm512_loadu_ps(row + j + 16));
    m2 = _mm512_max_ps(m2, _mm512_loadu_ps(row + j + 32));
    m3 = _mm512_max_ps(m3, _mm512_loadu_ps(row + j + 48));
  }
  for (; j < full; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(row + j));
  m = _mm512_max_ps(_mm512_max_ps(m, m1), _mm512_max_ps(m2, m3));
  m = _mm512_max_ps(m, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail, row + full));
  const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < full; j += 16) {
    const __m512 e = exp_lanes_nonpositive<Lanes16>(_mm512_sub_ps(_mm512_loadu_ps(row + j), mx));
    _mm512_storeu_ps(row + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (tail) {
    const __m512 e = _mm512_maskz_mov_ps(tail, exp_lanes_nonpositive<Lanes16>(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, row + full), mx)));
    _mm512_mask_storeu_ps(row + full, tail, e);
    sum = _mm512_add_ps(sum, e);
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
  for (int64_t j = 0; j < full; j += 16) _mm512_storeu_ps(row + j, _mm512_mul_ps(_mm512_loadu_ps(row + j), inv));
  if (tail) _mm512_mask_storeu_ps(row + full, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, row + full), inv));
  for (int64_t j = visible; j < end; ++j) row[j] = 0.f;
}

#endif

}  // namespace
