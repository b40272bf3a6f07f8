// pdserve::linear_packed: a float32 linear layer, y = x W^T + b, over a weight packed once at
// load time into column panels, for the CPU.
//
// Why: a decode step multiplies a few rows (1 at batch 1, k + 1 in a speculative verification,
// the batch size at most) by every weight matrix. The BLAS's small-M path streams the weight at
// about half of what one core can read, and a 5-row product costs it three times a 1-row one
// (measured on the demo target's shapes with the weights out of cache). Here every weight row is
// read once per step whatever M, from memory laid out in the order the loop reads it.
//
// Layout: W [N, K] becomes [ceil(N / 64), K, 64]: panel j holds output columns [64 j, 64 j + 64)
// as K contiguous rows of 64 floats (zero beyond N). One pass over a panel computes up to six rows
// of x against its 64 columns: 24 vector accumulators, four loads and six broadcasts per k. Rows
// beyond six take further passes, reading the panel from L2. Panels are split between threads.
// Each output sums k = 0 .. K-1 in order, with fused multiply-adds, then adds the bias: the same
// sum as the BLAS's up to float rounding.
//
// The vector loops need AVX-512, or AVX2 with FMA (eight 8-float vectors span a panel; with
// sixteen registers one row takes the whole panel, more rows take it in two 32-column halves,
// three rows at a time). `linear_packed_available()` says whether this build has either (the
// engine packs only then). Without them the op still answers, through one BLAS call per panel.
// Tensor and the few ops used, not <ATen/ATen.h>: every op's header took a third to half the compile.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
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

int64_t num_panels(int64_t n) { return (n + kPanel - 1) / kPanel; }

at::Tensor linear_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "linear_pack: weight must be [out_features, in_features], got ",
              weight.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kFloat, "linear_pack: weight must be float32, got ",
              weight.scalar_type());
  const int64_t n = weight.size(0), k = weight.size(1);
  at::Tensor packed = at::zeros({num_panels(n), k, kPanel}, weight.options());
  const at::Tensor wt = weight.t();  // [K, N]
  for (int64_t j = 0; j < packed.size(0); ++j) {
    const int64_t cols = std::min(kPanel, n - j * kPanel);
    packed[j].narrow(1, 0, cols).copy_(wt.narrow(1, j * kPanel, cols));
  }
  return packed;
}

#ifdef PDSERVE_LINEAR_AVX512

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
template <int MR>
void panel_rows(const float* x, int64_t ldx, const float* b, int64_t k_len, float* y, int64_t ldy,
                const float* bias, const PanelMasks& masks) {
  __m512 acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_len; ++k, b += kPanel) {
    const __m512 w0 = _mm512_loadu_ps(b), w1 = _mm512_loadu_ps(b + 16), w2 = _mm512_loadu_ps(b + 32),
                 w3 = _mm512_loadu_ps(b + 48);
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

// One row: even and odd k in separate accumulators (eight independent chains, not four), summed
// at the end. The one case whose order differs from k = 0 .. K-1, by float rounding only.
void panel_row(const float* x, const float* b, int64_t k_len, float* y, const float* bias,
               const PanelMasks& masks) {
  __m512 even[4], odd[4];
  for (int v = 0; v < 4; ++v) even[v] = odd[v] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 2 <= k_len; k += 2, b += 2 * kPanel) {
    const __m512 x0 = _mm512_set1_ps(x[k]), x1 = _mm512_set1_ps(x[k + 1]);
    for (int v = 0; v < 4; ++v) {
      even[v] = _mm512_fmadd_ps(x0, _mm512_loadu_ps(b + 16 * v), even[v]);
      odd[v] = _mm512_fmadd_ps(x1, _mm512_loadu_ps(b + kPanel + 16 * v), odd[v]);
    }
  }
  if (k < k_len) {
    const __m512 x0 = _mm512_set1_ps(x[k]);
    for (int v = 0; v < 4; ++v) even[v] = _mm512_fmadd_ps(x0, _mm512_loadu_ps(b + 16 * v), even[v]);
  }
  for (int v = 0; v < 4; ++v) even[v] = _mm512_add_ps(even[v], odd[v]);
  store_row(y, even, bias, masks);
}

// Every row of x [M, K] against one panel; y points at the panel's first column, row stride ldy.
void panel_all_rows(const float* x, int64_t m_len, int64_t k_len, const float* panel, float* y, int64_t ldy,
                    int64_t cols, const float* bias) {
  const PanelMasks masks(cols);
  if (m_len == 1) return panel_row(x, panel, k_len, y, bias, masks);
  int64_t m = 0;
  for (; m + 6 <= m_len; m += 6) panel_rows<6>(x + m * k_len, k_len, panel, k_len, y + m * ldy, ldy, bias, masks);
  const float* xr = x + m * k_len;
  float* yr = y + m * ldy;
  switch (m_len - m) {
    case 1: panel_rows<1>(xr, k_len, panel, k_len, yr, ldy, bias, masks); break;
    case 2: panel_rows<2>(xr, k_len, panel, k_len, yr, ldy, bias, masks); break;
    case 3: panel_rows<3>(xr, k_len, panel, k_len, yr, ldy, bias, masks); break;
    case 4: panel_rows<4>(xr, k_len, panel, k_len, yr, ldy, bias, masks); break;
    case 5: panel_rows<5>(xr, k_len, panel, k_len, yr, ldy, bias, masks); break;
    default: break;
  }
}

#endif  // PDSERVE_LINEAR_AVX512

#ifdef PDSERVE_LINEAR_AVX2

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
template <int MR, int NV>
void panel_rows8(const float* x, int64_t ldx, const float* b, int64_t k_len, float* y, int64_t ldy,
                 const float* bias, const __m256i* masks, const float* other = nullptr) {
  __m256 acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k_len; ++k, b += kPanel) {
    if (other != nullptr) {
      _mm_prefetch(reinterpret_cast<const char*>(other + k * kPanel), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(other + k * kPanel + 16), _MM_HINT_T0);
    }
    __m256 xm[MR];
    for (int m = 0; m < MR; ++m) xm[m] = _mm256_broadcast_ss(x + m * ldx + k);
    for (int v = 0; v < NV; ++v) {
      const __m256 w = _mm256_loadu_ps(b + 8 * v);
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
void panel_all_rows(const float* x, int64_t m_len, int64_t k_len, const float* panel, float* y, int64_t ldy,
                    int64_t cols, const float* bias) {
  const PanelMasks8 masks(cols);
  if (m_len == 1) return panel_rows8<1, 8>(x, k_len, panel, k_len, y, ldy, bias, masks.m);
  for (int half = 0; half < 2; ++half) {
    const int64_t c0 = 32 * half;
    if (c0 >= cols) break;
    const float* b = panel + c0;
    const float* bh = bias == nullptr ? nullptr : bias + c0;
    // the first pass over the first half brings the second half in too (when it has columns)
    const float* other = half == 0 && cols > 32 ? panel + 32 : nullptr;
    int64_t m = 0;
    for (; m + 3 <= m_len; m += 3, other = nullptr)
      panel_rows8<3, 4>(x + m * k_len, k_len, b, k_len, y + m * ldy + c0, ldy, bh, masks.m + 4 * half, other);
    if (m_len - m == 2)
      panel_rows8<2, 4>(x + m * k_len, k_len, b, k_len, y + m * ldy + c0, ldy, bh, masks.m + 4 * half, other);
    else if (m_len - m == 1)
      panel_rows8<1, 4>(x + m * k_len, k_len, b, k_len, y + m * ldy + c0, ldy, bh, masks.m + 4 * half, other);
  }
}

#endif  // PDSERVE_LINEAR_AVX2

#if defined(PDSERVE_LINEAR_AVX512) || defined(PDSERVE_LINEAR_AVX2)
#define PDSERVE_LINEAR_VECTOR 1
#endif

bool linear_packed_available() {
#ifdef PDSERVE_LINEAR_VECTOR
  return true;
#else
  return false;
#endif
}

// x [..., K] float32; packed from `linear_pack` of a [N, K] weight; bias [N] or none.
at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         int64_t n) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.scalar_type() == at::kFloat &&
                  packed.is_contiguous(),
              "linear_packed: packed must be a contiguous float32 [panels, in_features, ", kPanel,
              "] tensor from linear_pack");
  TORCH_CHECK(n >= 1 && num_panels(n) == packed.size(0), "linear_packed: ", n, " output features do not fit ",
              packed.size(0), " panels");
  const int64_t k_len = packed.size(1);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1 && x.size(-1) == k_len,
              "linear_packed: x must be float32 [..., ", k_len, "], got ", x.scalar_type(), " ", x.sizes());
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  TORCH_CHECK(!b.defined() || (b.scalar_type() == at::kFloat && b.numel() == n),
              "linear_packed: bias must be float32 [", n, "]");
  const at::Tensor x2 = x.reshape({-1, k_len}).contiguous();
  const int64_t m_len = x2.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  at::Tensor y = at::empty({m_len, n}, x.options());
  if (m_len == 0) return y.view(out_shape);
#ifdef PDSERVE_LINEAR_VECTOR
  const float* xp = x2.data_ptr<float>();
  const float* pp = packed.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, packed.size(0), 1, [&](int64_t first, int64_t last) {
    for (int64_t j = first; j < last; ++j)
      panel_all_rows(xp, m_len, k_len, pp + j * k_len * kPanel, yp + j * kPanel, n, std::min(kPanel, n - j * kPanel),
                     bp == nullptr ? nullptr : bp + j * kPanel);
  });
#else
  for (int64_t j = 0; j < packed.size(0); ++j) {
    const int64_t cols = std::min(kPanel, n - j * kPanel);
    at::Tensor out = y.narrow(1, j * kPanel, cols);
    at::mm_out(out, x2, packed[j].narrow(1, 0, cols));
  }
  if (b.defined()) y.add_(b);
#endif
  return y.view(out_shape);
}

}  // namespace

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
