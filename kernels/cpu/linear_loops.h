// The vector loops of pdserve::linear_packed (linear.cpp, whose first lines say what they
// compute and why): a packed panel's layout constants, widening bfloat16 panel rows, and the
// AVX-512 and AVX2 passes of rows of x over panels. Included by linear.cpp alone.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define PDSERVE_LINEAR_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PDSERVE_LINEAR_AVX2 1
#endif

namespace pdserve_linear {

constexpr int64_t kPanel = 64;  // output columns per panel: four 16-float vectors

// A bfloat16 panel row pairs its columns so that widening needs no shuffle: each half of the row
// (32 columns) is 16 32-bit words, word i holding column i in its low 16 bits and column 16 + i in
// its high 16 bits. A bfloat16 is the top half of a float32, so one 64-byte load gives columns
// 0-15 by a shift left and 16-31 by a mask: two cheap ops where widening 16 consecutive bfloat16
// takes a cross-lane shuffle each (the batch-1 pass over a panel was bound by those: 0.77x the
// float32 time at half the bytes, against 0.55x paired; scratch timing of the demo target's shapes).
constexpr int64_t kHalf = 32;  // columns per paired group

// `count` values of paired panel rows (a multiple of kPanel) widened to float32 rows in column order.
inline void widen(const uint16_t* src, int64_t count, float* dst) {
#ifdef PDSERVE_LINEAR_AVX512
  const __m512i high = _mm512_set1_epi32(int32_t(0xFFFF0000u));
  for (int64_t g = 0; g < count; g += kHalf, src += kHalf, dst += kHalf) {
    const __m512i words = _mm512_loadu_si512(src);
    _mm512_storeu_si512(dst, _mm512_slli_epi32(words, 16));
    _mm512_storeu_si512(dst + kHalf / 2, _mm512_and_si512(words, high));
  }
#else
  for (int64_t g = 0; g < count; g += kHalf, src += kHalf, dst += kHalf)
    for (int i = 0; i < kHalf / 2; ++i) {
      const uint32_t lo = uint32_t(src[2 * i]) << 16, hi = uint32_t(src[2 * i + 1]) << 16;
      std::memcpy(dst + i, &lo, sizeof lo);
      std::memcpy(dst + kHalf / 2 + i, &hi, sizeof hi);
    }
#endif
}

#if defined(PDSERVE_LINEAR_AVX512) || defined(PDSERVE_LINEAR_AVX2)

// Software prefetch: each k asks for the panel bytes kAheadBytes past its row, into L1. The
// hardware prefetchers alone left a step's panels arriving late: with the weights out of cache
// (a 32 MB sweep before each pass over the demo target's 33 projections, bfloat16 panels, AMD EPYC,
// scratch A/B of five interleaved repeats), 8 KB ahead took one row 1.05-1.24x, five rows
// 1.23-1.62x and 32 rows 1.21-1.36x faster than none, and 256 rows 0.91-1.09x; with the weights
// in cache, 0.89-1.27x, 0.92-1.41x and 1.18-1.54x. 1, 2 and 4 KB gained less, 16 and 32 KB (into
// L1 or L2) about the same at five rows and less at one. _MM_HINT_NTA instead of T0 (to spare
// the caches the step's Python then runs from) made a batch-1 run 3.1x as long (Intel Xeon,
// scratch A/B; BENCHMARKS.md, step cost by change).
constexpr int64_t kAheadBytes = 8192;

// Asks for the panel row kAheadBytes past row b (past the panel's end, the next panel's: panels
// are contiguous), so memory streams in while the rows before it are multiplied.
template <typename W>
inline void prefetch_ahead(const W* b) {
  const char* p = reinterpret_cast<const char*>(b) + kAheadBytes;
  for (int64_t c = 0; c < kPanel * int64_t(sizeof(W)); c += 64) _mm_prefetch(p + c, _MM_HINT_T0);
}

#endif

#ifdef PDSERVE_LINEAR_AVX512

// Columns [16 v, 16 v + 16) of a panel row as floats.
inline __m512 load16(const float* row, int v) { return _mm512_loadu_ps(row + 16 * v); }
inline __m512 load16(const uint16_t* row, int v) {
  const __m512i words = _mm512_loadu_si512(row + kHalf * (v / 2));
  return _mm512_castsi512_ps(v % 2 == 0 ? _mm512_slli_epi32(words, 16)
                                        : _mm512_and_si512(words, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
}

// The four store masks of a panel with `cols` valid columns.
struct PanelMasks {
  __mmask16 m[4];
  explicit PanelMasks(int64_t cols) {
    for (int v = 0; v < 4; ++v) {
      const int64_t c = std::clamp<int64_t>(cols - 16 * v, 0, 16);
      m[v] = c == 16 ? __mmask16(0xFFFF) : __mmask16((1u << c) - 1);
    }
  }
};

inline void store_row(float* y, const __m512* acc, const float* bias, const PanelMasks& masks) {
  for (int v = 0; v < 4; ++v) {
    __m512 r = acc[v];
    if (bias != nullptr) r = _mm512_add_ps(r, _mm512_maskz_loadu_ps(masks.m[v], bias + 16 * v));
    _mm512_mask_storeu_ps(y + 16 * v, masks.m[v], r);
  }
}

// MR rows of x [.., K] (row stride ldx) against one panel b [K, 64]; y rows have stride ldy.
template <int MR, typename W>
void panel_rows(const float* x, int64_t ldx, const W* b, int64_t k_len, float* y, int64_t ldy,
                const float* bias, const PanelMasks& masks) {
  __m512 acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_len; ++k, b += kPanel) {
    prefetch_ahead(b);
    const __m512 w0 = load16(b, 0), w1 = load16(b, 1), w2 = load16(b, 2), w3 = load16(b, 3);
    for (int m = 0; m < MR; ++m) {
      const __m512 xm = _mm512_set1_ps(x[m * ldx + k]);
      acc[m][0] = _mm512_fmadd_ps(xm, w0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(xm, w1, acc[m][1]);
      acc[m][2] = _mm512_fmadd_ps(xm, w2, acc[m][2]);
      acc[m][3] = _mm512_fmadd_ps(xm, w3, acc[m][3]);
    }
  }
  for (int m = 0; m < MR; ++m) store_row(y + m * ldy, acc[m], bias, masks);
}

// One row of x against S adjacent panels at once (b: the first; y, bias and masks: the first
// panel's), 4 S accumulators, each output summed k = 0 .. K-1 in order: S streams of weights in
// flight where one row reads its weights once. From memory one stream is bound by how many
// misses a core keeps in flight: 352 MB of float32 panels, one row, in a scratch C++ loop on the
// Intel Xeon (480 MiB L3): one panel at a time 14.1-14.4 GB/s, two 15.4, four 16.3-16.5; prefetch
// distances of 4-32 KB and a second prefetch into L2 moved one stream by under 3%. Weights in L3
// (25 MB) read at 29 GB/s whatever S. In the engine, the llama-100m's batch-1 step (352 MB of
// float32 weights, from memory) went from 22.5 to 19.5 ms (BENCHMARKS.md, offline throughput).
// In order, a panel's sums do not depend on its group, so a split between threads gives the same
// results.
template <int S, typename W>
void panels_row(const float* x, const W* b, int64_t k_len, float* y, const float* bias, const PanelMasks* masks) {
  __m512 acc[S][4];
  for (int s = 0; s < S; ++s)
    for (int v = 0; v < 4; ++v) acc[s][v] = _mm512_setzero_ps();
  const int64_t stride = k_len * kPanel;  // between adjacent panels
  for (int64_t k = 0; k < k_len; ++k) {
    const __m512 xk = _mm512_set1_ps(x[k]);
    for (int s = 0; s < S; ++s) {
      const W* row = b + s * stride + k * kPanel;
      prefetch_ahead(row);
      for (int v = 0; v < 4; ++v) acc[s][v] = _mm512_fmadd_ps(xk, load16(row, v), acc[s][v]);
    }
  }
  for (int s = 0; s < S; ++s)
    store_row(y + s * kPanel, acc[s], bias == nullptr ? nullptr : bias + s * kPanel, masks[s]);
}

// One row of x against panels [first, last) of a packed weight for n outputs: four at a time.
template <typename W>
void row_panels(const float* x, const W* packed, int64_t k_len, int64_t first, int64_t last, int64_t n,
                const float* bias, float* y) {
  constexpr int S = 4;
  for (int64_t j = first; j < last;) {
    const int group = last - j >= S ? S : 1;
    PanelMasks masks[S] = {PanelMasks(n - j * kPanel), PanelMasks(n - (j + 1) * kPanel),
                           PanelMasks(n - (j + 2) * kPanel), PanelMasks(n - (j + 3) * kPanel)};
    const W* b = packed + j * k_len * kPanel;
    const float* bj = bias == nullptr ? nullptr : bias + j * kPanel;
    if (group == S)
      panels_row<S>(x, b, k_len, y + j * kPanel, bj, masks);
    else
      panels_row<1>(x, b, k_len, y + j * kPanel, bj, masks);
    j += group;
  }
}

// Rows of x [M, K] against one panel, in passes of at most six rows made as even as they go (seven
// rows as 4 + 3, not 6 + 1: a pass of one row is bound by its accumulators' latency, not by its
// multiply-adds); each row summed k = 0 .. K-1 in order; y points at the panel's first column,
// row stride ldy.
template <typename W>
void panel_blocks(const float* x, int64_t m_len, int64_t k_len, const W* panel, float* y, int64_t ldy,
                  const float* bias, const PanelMasks& masks) {
  const int64_t passes = (m_len + 5) / 6;
  for (int64_t p = 0, m = 0; p < passes; ++p) {
    const int64_t rows = (m_len - m + passes - p - 1) / (passes - p);
    const float* xr = x + m * k_len;
    float* yr = y + m * ldy;
    switch (rows) {
      case 1: panel_rows<1>(xr, k_len, panel, k_len, yr, ldy, bias, masks); break;
      case 2: panel_rows<2>(xr, k_len, panel, k_len, yr, ldy, bias, masks); break;
      case 3: panel_rows<3>(xr, k_len, panel, k_len, yr, ldy, bias, masks); break;
      case 4: panel_rows<4>(xr, k_len, panel, k_len, yr, ldy, bias, masks); break;
      case 5: panel_rows<5>(xr, k_len, panel, k_len, yr, ldy, bias, masks); break;
      default: panel_rows<6>(xr, k_len, panel, k_len, yr, ldy, bias, masks); break;
    }
    m += rows;
  }
}

// Every row of x [M, K] against one panel; y points at the panel's first column, row stride ldy.
// (One row takes `row_panels` instead, several panels at once.)
template <typename W>
void panel_all_rows(const float* x, int64_t m_len, int64_t k_len, const W* panel, float* y, int64_t ldy,
                    int64_t cols, const float* bias) {
  panel_blocks(x, m_len, k_len, panel, y, ldy, bias, PanelMasks(cols));
}

#endif  // PDSERVE_LINEAR_AVX512

#ifdef PDSERVE_LINEAR_AVX2

// Columns [8 v, 8 v + 8) of a panel row (or of a paired half, from its start) as floats.
inline __m256 load8(const float* row, int v) { return _mm256_loadu_ps(row + 8 * v); }
inline __m256 load8(const uint16_t* row, int v) {
  const int w = v % 4;  // within its half: words [8 (w % 2), + 8), low (w < 2) or high halves
  const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + kHalf * (v / 4) + 16 * (w % 2)));
  return _mm256_castsi256_ps(w < 2 ? _mm256_slli_epi32(words, 16)
                                   : _mm256_and_si256(words, _mm256_set1_epi32(int32_t(0xFFFF0000u))));
}

// The eight store masks of a panel with `cols` valid columns (lanes with the sign bit set).
struct PanelMasks8 {
  __m256i m[8];
  explicit PanelMasks8(int64_t cols) {
    for (int v = 0; v < 8; ++v) {
      alignas(32) int32_t lanes[8];
      for (int i = 0; i < 8; ++i) lanes[i] = 8 * v + i < cols ? -1 : 0;
      m[v] = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
    }
  }
};

// MR rows of x [.., K] (row stride ldx) against NV vectors of a panel's columns: b, y, bias and
// masks point at the first of them; b's rows are a panel's, kPanel floats apart.
// `other`, when given, is the other half of the same panel rows: its two cache lines of each row
// are fetched beside this half's, so the panel streams from memory once, in order. Without it the
// second half streamed from memory again: five rows of the demo target's projections took 2.4x
// the time of one row, against 1.8x with it (AMD EPYC, `benchmarks/cpu_linear.py`).
template <int MR, int NV, typename W>
void panel_rows8(const float* x, int64_t ldx, const W* b, int64_t k_len, float* y, int64_t ldy,
                 const float* bias, const __m256i* masks, const W* other = nullptr, bool ahead = false) {
  __m256 acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k_len; ++k, b += kPanel) {
    if (ahead) prefetch_ahead(b);
    if (other != nullptr) {
      _mm_prefetch(reinterpret_cast<const char*>(other + k * kPanel), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(other + k * kPanel + 16), _MM_HINT_T0);
    }
    __m256 xm[MR];
    for (int m = 0; m < MR; ++m) xm[m] = _mm256_broadcast_ss(x + m * ldx + k);
    for (int v = 0; v < NV; ++v) {
      const __m256 w = load8(b, v);
      for (int m = 0; m < MR; ++m) acc[m][v] = _mm256_fmadd_ps(xm[m], w, acc[m][v]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) {
      __m256 r = acc[m][v];
      if (bias != nullptr) r = _mm256_add_ps(r, _mm256_maskload_ps(bias + 8 * v, masks[v]));
      _mm256_maskstore_ps(y + m * ldy + 8 * v, masks[v], r);
    }
}

// Every row of x [M, K] against one panel; y points at the panel's first column, row stride ldy.
// The first pass over the panel prefetches ahead (`prefetch_ahead`) when it reads it from memory;
// the passes after it find it in L2, where prefetching cost 32 and 256 rows 6-13%. First pass only,
// with the weights out of cache: one row 1.14-1.48x, five rows 0.92-1.23x (median 1.09x), 32 and
// 256 rows 0.93-1.07x against none (this AVX2 build on the AMD EPYC, scratch A/B, five repeats).
template <typename W>
void panel_all_rows(const float* x, int64_t m_len, int64_t k_len, const W* panel, float* y, int64_t ldy,
                    int64_t cols, const float* bias, bool from_memory = true) {
  const PanelMasks8 masks(cols);
  if (m_len == 1) return panel_rows8<1, 8, W>(x, k_len, panel, k_len, y, ldy, bias, masks.m, nullptr, from_memory);
  for (int half = 0; half < 2; ++half) {
    const int64_t c0 = 32 * half;
    if (c0 >= cols) break;
    const W* b = panel + c0;
    const float* bh = bias == nullptr ? nullptr : bias + c0;
    // the first pass over the first half brings the second half in too (when it has columns)
    const W* other = half == 0 && cols > 32 ? panel + 32 : nullptr;
    int64_t m = 0;
    bool ahead = from_memory && half == 0;  // the first pass: it brings the whole panel in
    for (; m + 3 <= m_len; m += 3, other = nullptr, ahead = false)
      panel_rows8<3, 4>(x + m * k_len, k_len, b, k_len, y + m * ldy + c0, ldy, bh, masks.m + 4 * half, other, ahead);
    if (m_len - m == 2)
      panel_rows8<2, 4>(x + m * k_len, k_len, b, k_len, y + m * ldy + c0, ldy, bh, masks.m + 4 * half, other, ahead);
    else if (m_len - m == 1)
      panel_rows8<1, 4>(x + m * k_len, k_len, b, k_len, y + m * ldy + c0, ldy, bh, masks.m + 4 * half, other, ahead);
  }
}

#endif  // PDSERVE_LINEAR_AVX2

#if defined(PDSERVE_LINEAR_AVX512) || defined(PDSERVE_LINEAR_AVX2)
#define PDSERVE_LINEAR_VECTOR 1

#ifdef PDSERVE_LINEAR_AVX512
// One panel, bfloat16, widened in registers by every pass. A float32 copy of the panel made by the
// first pass for the passes after it (the loop before 4e4695b) cost more at every row count: its
// 64 KB leave L1 where the 32 KB bfloat16 panel stays, and the copy's stores cost the first
// pass. The demo target's 33 projections (bfloat16 panels, one thread, AMD EPYC Zen 5, scratch
// timing, best of seven, this change with `panel_blocks`' even passes): 8 rows 0.90 -> 0.58 ms,
// 16 rows 1.49 -> 1.04, 24 rows 1.66 -> 1.48, 64 rows 4.02 -> 3.74, 512 rows 29.3 -> 28.6.
inline void panel_all_rows_bf16(const float* x, int64_t m_len, int64_t k_len, const uint16_t* panel, float* y,
                         int64_t ldy, int64_t cols, const float* bias) {
  panel_all_rows(x, m_len, k_len, panel, y, ldy, cols, bias);
}
#else
constexpr int64_t kWidenInRegisters = 6;  // rows up to which a bfloat16 panel is widened as it is read

// One panel, bfloat16: widened as read for a few rows; for more, once, into a float32 copy (the
// AVX-512 loops dropped their copy in 4e4695b; these were not measured again then).
inline void panel_all_rows_bf16(const float* x, int64_t m_len, int64_t k_len, const uint16_t* panel, float* y,
                         int64_t ldy, int64_t cols, const float* bias) {
  if (m_len <= kWidenInRegisters) return panel_all_rows(x, m_len, k_len, panel, y, ldy, cols, bias);
  thread_local std::vector<float> wide;
  wide.resize(k_len * kPanel);
  widen(panel, k_len * kPanel, wide.data());
  panel_all_rows(x, m_len, k_len, static_cast<const float*>(wide.data()), y, ldy, cols, bias, false);
}
#endif
#endif

}  // namespace pdserve_linear
