// pdserve::linear_packed: a float32 linear layer, y = x W^T + b, over a weight packed once at
// load time into column panels, for the CPU. The panels are float32 or bfloat16: a bfloat16 panel
// holds a weight whose every value is a bfloat16 (a bfloat16 checkpoint computed in float32), at
// half the bytes, and each value is widened exactly to float32 as it is read, so the sums are the
// float32 panel's, bit for bit.
//
// Why: a decode step multiplies a few rows (1 at batch 1, k + 1 in a speculative verification,
// the batch size at most) by every weight matrix. The BLAS's small-M path streams the weight at
// about half of what one core can read, and a 5-row product costs it three times a 1-row one
// (measured on the demo target's shapes with the weights out of cache). Here every weight row is
// read once per step whatever M, from memory laid out in the order the loop reads it.
//
// Why bfloat16 panels: at batch 1 the step reads every weight once and does little else with it,
// so it runs at the memory's speed: the demo target's 29 MB of float32 projections took 3.5 ms
// at M = 1 (8.4 GB/s), what a plain sum over the same bytes reads at on this VM (9.0 GB/s; a
// 1 MB panel set that stays in L2 ran at 48 GB/s). Half the bytes: at one row the bfloat16 panels
// took 0.34-0.62x the float32 time (scratch timings; BENCHMARKS.md, step cost by change).
//
// Layout: W [N, K] becomes [ceil(N / 64), K, 64]: panel j holds output columns [64 j, 64 j + 64)
// as K contiguous rows of 64 values (zero beyond N). One pass over a panel computes up to six rows
// of x against its 64 columns: 24 vector accumulators, four loads and six broadcasts per k. More
// rows take further passes, as even as they go (`panel_blocks`), reading the panel from L1 or L2.
// One row (a batch-1 step) takes four panels at a time (`panels_row`): four streams from memory.
// Panels are split between threads. Each k of a pass also prefetches the panel 8 KB ahead
// (kAheadBytes). Each output sums k = 0 .. K-1 in order, with fused multiply-adds, then adds the
// bias: the same sum as the BLAS's up to float rounding. With AVX-512 a bfloat16 panel is widened
// in registers by every pass (`panel_all_rows_bf16`); with AVX2, by passes of up to six rows, and
// for more rows (a prefill) once into a float32 copy that stays in L2.
//
// The vector loops need AVX-512, or AVX2 with FMA (eight 8-float vectors span a panel; with
// sixteen registers one row takes the whole panel, more rows take it in two 32-column halves,
// three rows at a time). `linear_packed_available()` says whether this build has either (the
// engine packs only then). Without them the op still answers, through one BLAS call per panel.
// Tensor and the few ops used, not <ATen/ATen.h>: every op's header took a third to half the compile.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "native_ops.h"

#include <algorithm>
#include <cstring>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define PDSERVE_LINEAR_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PDSERVE_LINEAR_AVX2 1
#endif

namespace {

constexpr int64_t kPanel = 64;  // output columns per panel: four 16-float vectors
constexpr int64_t kMinTaskMultiplyAdds = int64_t{1} << 20;  // the least work worth another thread

int64_t num_panels(int64_t n) { return (n + kPanel - 1) / kPanel; }

// A bfloat16 panel row pairs its columns so that widening needs no shuffle: each half of the row
// (32 columns) is 16 32-bit words, word i holding column i in its low 16 bits and column 16 + i in
// its high 16 bits. A bfloat16 is the top half of a float32, so one 64-byte load gives columns
// 0-15 by a shift left and 16-31 by a mask: two cheap ops where widening 16 consecutive bfloat16
// takes a cross-lane shuffle each (the batch-1 pass over a panel was bound by those: 0.77x the
// float32 time at half the bytes, against 0.55x paired; scratch timing of the demo target's shapes).
constexpr int64_t kHalf = 32;  // columns per paired group

// `count` values of paired panel rows (a multiple of kPanel) widened to float32 rows in column order.
void widen(const uint16_t* src, int64_t count, float* dst) {
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

at::Tensor linear_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "linear_pack: weight must be [out_features, in_features], got ",
              weight.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "linear_pack: weight must be float32 or bfloat16, got ", weight.scalar_type());
  const int64_t n = weight.size(0), k = weight.size(1);
  at::Tensor packed = at::zeros({num_panels(n), k, kPanel}, weight.options());
  const at::Tensor wt = weight.t();  // [K, N]
  for (int64_t j = 0; j < packed.size(0); ++j) {
    const int64_t cols = std::min(kPanel, n - j * kPanel);
    packed[j].narrow(1, 0, cols).copy_(wt.narrow(1, j * kPanel, cols));
  }
  if (weight.scalar_type() == at::kBFloat16)  // pair the columns: (half, i) -> word i of the half
    packed = packed.view({packed.size(0), k, 2, 2, kHalf / 2}).transpose(3, 4).contiguous().view(packed.sizes());
  return packed;
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
// (25 MB) read at 29 GB/s whatever S. In order, a panel's sums do not depend on its group, so a
// split between threads gives the same results.
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
template <typename W>
void panel_all_rows(const float* x, int64_t m_len, int64_t k_len, const W* panel, float* y, int64_t ldy,
                    int64_t cols, const float* bias) {
  const PanelMasks masks(cols);
  if (m_len == 1) return panels_row<1>(x, panel, k_len, y, bias, &masks);
  panel_blocks(x, m_len, k_len, panel, y, ldy, bias, masks);
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
void panel_all_rows_bf16(const float* x, int64_t m_len, int64_t k_len, const uint16_t* panel, float* y,
                         int64_t ldy, int64_t cols, const float* bias) {
  panel_all_rows(x, m_len, k_len, panel, y, ldy, cols, bias);
}
#else
constexpr int64_t kWidenInRegisters = 6;  // rows up to which a bfloat16 panel is widened as it is read

// One panel, bfloat16: widened as read for a few rows; for more, once, into a float32 copy (the
// AVX-512 loops dropped their copy in 4e4695b; these were not measured again then).
void panel_all_rows_bf16(const float* x, int64_t m_len, int64_t k_len, const uint16_t* panel, float* y,
                         int64_t ldy, int64_t cols, const float* bias) {
  if (m_len <= kWidenInRegisters) return panel_all_rows(x, m_len, k_len, panel, y, ldy, cols, bias);
  thread_local std::vector<float> wide;
  wide.resize(k_len * kPanel);
  widen(panel, k_len * kPanel, wide.data());
  panel_all_rows(x, m_len, k_len, static_cast<const float*>(wide.data()), y, ldy, cols, bias, false);
}
#endif
#endif

bool linear_packed_available() {
#ifdef PDSERVE_LINEAR_VECTOR
  return true;
#else
  return false;
#endif
}

// What linear_rows needs of a packed weight for n output features, and of its bias (undefined:
// none): refused with the reason, in `op`'s name.
void check_packed(const char* op, const at::Tensor& packed, const at::Tensor& bias, int64_t n) {
  const bool half = packed.scalar_type() == at::kBFloat16;
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && (half || packed.scalar_type() == at::kFloat) &&
                  packed.is_contiguous(),
              op, ": packed must be a contiguous float32 or bfloat16 [panels, in_features, ", kPanel,
              "] tensor from linear_pack");
  TORCH_CHECK(n >= 1 && num_panels(n) == packed.size(0), op, ": ", n, " output features do not fit ",
              packed.size(0), " panels");
  TORCH_CHECK(!bias.defined() || (bias.scalar_type() == at::kFloat && bias.numel() == n && bias.is_contiguous()),
              op, ": bias must be float32 [", n, "]");
}

// x [m_len, K] (contiguous) times a checked packed weight into y [m_len, n] (contiguous), plus
// bias [n] or none: linear_packed's loops on raw pointers, for callers that hold their buffers
// (decoder.h's layers, through native_ops.h: no tensor made or viewed per call).
void linear_rows(const float* xp, int64_t m_len, const at::Tensor& packed, const float* bp, int64_t n, float* yp) {
  const bool half = packed.scalar_type() == at::kBFloat16;
  const int64_t k_len = packed.size(1);
#ifdef PDSERVE_LINEAR_VECTOR
  const void* pp = packed.data_ptr();
  // panels per thread: at least kMinTaskMultiplyAdds each, or the fork and join cost more than
  // they save (a batch-1 step's projections, 4 to 48 panels of a few microseconds each)
  const int64_t grain = std::max<int64_t>(1, kMinTaskMultiplyAdds / (m_len * k_len * kPanel));
  at::parallel_for(0, packed.size(0), grain, [&](int64_t first, int64_t last) {
#ifdef PDSERVE_LINEAR_AVX512
    if (m_len == 1) {  // several panels at once (`panels_row`)
      if (half)
        row_panels(xp, static_cast<const uint16_t*>(pp), k_len, first, last, n, bp, yp);
      else
        row_panels(xp, static_cast<const float*>(pp), k_len, first, last, n, bp, yp);
      return;
    }
#endif
    for (int64_t j = first; j < last; ++j) {
      const int64_t cols = std::min(kPanel, n - j * kPanel), offset = j * k_len * kPanel;
      const float* bj = bp == nullptr ? nullptr : bp + j * kPanel;
      if (half)
        panel_all_rows_bf16(xp, m_len, k_len, static_cast<const uint16_t*>(pp) + offset, yp + j * kPanel, n, cols, bj);
      else
        panel_all_rows(xp, m_len, k_len, static_cast<const float*>(pp) + offset, yp + j * kPanel, n, cols, bj);
    }
  });
#else
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const at::Tensor x2 = at::from_blob(const_cast<float*>(xp), {m_len, k_len}, f32);
  at::Tensor y = at::from_blob(yp, {m_len, n}, f32);
  for (int64_t j = 0; j < packed.size(0); ++j) {
    const int64_t cols = std::min(kPanel, n - j * kPanel);
    at::Tensor out = y.narrow(1, j * kPanel, cols);
    at::Tensor panel = packed[j];
    if (half) {
      panel = at::empty({k_len, kPanel}, f32);
      widen(static_cast<const uint16_t*>(packed[j].data_ptr()), k_len * kPanel, panel.data_ptr<float>());
    }
    at::mm_out(out, x2, panel.narrow(1, 0, cols));
  }
  if (bp != nullptr) y.add_(at::from_blob(const_cast<float*>(bp), {n}, f32));
#endif
}

// x [..., K] float32; packed from `linear_pack` of a [N, K] weight; bias [N] or none.
at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         int64_t n) {
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  check_packed("linear_packed", packed, b, n);
  const int64_t k_len = packed.size(1);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1 && x.size(-1) == k_len,
              "linear_packed: x must be float32 [..., ", k_len, "], got ", x.scalar_type(), " ", x.sizes());
  const at::Tensor x2 = x.reshape({-1, k_len}).contiguous();
  const int64_t m_len = x2.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  at::Tensor y = at::empty({m_len, n}, x.options());
  if (m_len > 0)
    linear_rows(x2.data_ptr<float>(), m_len, packed, b.defined() ? b.data_ptr<float>() : nullptr, n, y.data_ptr<float>());
  return y.view(out_shape);
}

}  // namespace

at::Tensor pdserve_native::linear_packed(const at::Tensor& x, const at::Tensor& packed,
                                         const c10::optional<at::Tensor>& bias, int64_t n) {
  return ::linear_packed(x, packed, bias, n);
}

void pdserve_native::check_packed(const char* op, const at::Tensor& packed, const at::Tensor& bias, int64_t n) {
  ::check_packed(op, packed, bias, n);
}

void pdserve_native::linear_rows(const float* x, int64_t rows, const at::Tensor& packed, const float* bias, int64_t n,
                                 float* y) {
  ::linear_rows(x, rows, packed, bias, n, y);
}

#ifndef PDSERVE_OP_NAMESPACE
#define PDSERVE_OP_NAMESPACE pdserve
#endif

TORCH_LIBRARY_FRAGMENT(PDSERVE_OP_NAMESPACE, m) {
  m.def("linear_pack(Tensor weight) -> Tensor");
  m.def("linear_packed(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("linear_packed_available() -> bool", &linear_packed_available);
}

TORCH_LIBRARY_IMPL(PDSERVE_OP_NAMESPACE, CPU, m) {
  m.impl("linear_pack", &linear_pack);
  m.impl("linear_packed", &linear_packed);
}
