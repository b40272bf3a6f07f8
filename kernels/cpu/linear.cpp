// pdserve::linear_packed: a float32 linear layer, y = x W^T + b, over a weight packed once at
// load time into column panels, for the CPU. The panels are float32 or bfloat16: a bfloat16 panel
// holds a weight whose every value is a bfloat16 (a bfloat16 checkpoint computed in float32), at
// half the bytes, and each value is widened exactly to float32 as it is read, so the sums are the
// float32 panel's, bit for bit (on the vector loops; the tile path below sums in its own order).
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
// On a CPU with AMX (Intel Sapphire Rapids and later) bfloat16 panels times 7 rows and more take
// the tile unit instead (`tiles_pay_tiled`; linear_amx.h), from panels that `linear_pack` also keeps
// in the tile unit's order (`with_tiled_copy`: the weight's bytes twice): x split exactly into three
// bfloat16 parts, float32 sums in the tile unit's order, so those outputs equal the vector loops'
// up to float rounding, not bit for bit; a row's output there does not depend on the rows beside it.
//
// The vector loops need AVX-512, or AVX2 with FMA (eight 8-float vectors span a panel; with
// sixteen registers one row takes the whole panel, more rows take it in two 32-column halves,
// three rows at a time). `linear_packed_available()` says whether this build has either (the
// engine packs only then). Without them the op still answers, through one BLAS call per panel.
// The loops are in linear_loops.h; this file packs, checks, splits the panels between threads and
// registers the ops.
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
#include <atomic>
#include <cstring>
#include <cstdint>
#include <vector>

#include "linear_loops.h"  // the vector loops, the panel layout's constants
#include "linear_amx.h"    // the tile path for bfloat16 panels and many rows

namespace {

using namespace pdserve_linear;

constexpr int64_t kMinTaskMultiplyAdds = int64_t{1} << 20;  // the least work worth another thread

int64_t num_panels(int64_t n) { return (n + kPanel - 1) / kPanel; }

#ifdef PDSERVE_LINEAR_AMX
// Whether m rows take the tile path: a block of 16 rows on the tile unit costs about what 10 rows
// take the vector loops, and a block is paid for whole (scratch timing, the demo target's shapes,
// Intel Xeon: 16 rows 1.05-1.25x the vector loops' speed, 17 rows on tiles 0.7x, 32 rows
// 1.05-1.7x, 160 rows 1.8-2.6x).
bool tiles_pay(int64_t m) { return m >= 10 * ((m + kTileRows - 1) / kTileRows) + 6; }

// The same for a weight packed with its tile copy (`with_tiled_copy`): no panel is rewritten per
// call, and from kMinTiledRows rows the tile unit is the faster (scratch timing, the demo target's
// shapes, one thread, Intel Xeon with AMX, vector loops / tiles in µs: the 4096 x 256 lm_head 94 /
// 102 at 6 rows, 124 / 102 at 7; the 1536 x 256 gate_up 46 / 30 at 8 rows, 81 / 32 at 16, 154 /
// 57 at 32, where a rewrite per call took 47, 68 and 108). Fewer rows stay on the vector loops: a
// batch-1 step, and its verification up to k = 5.
constexpr int64_t kMinTiledRows = 7;
bool tiles_pay_tiled(int64_t m) { return m >= kMinTiledRows; }

// A bfloat16 weight's panels in the tile unit's order (`tile_panel`), kept past the panels in the
// packed tensor's own storage, then a header that names them: the tile path then reads them as
// they are, where it rewrote every panel on every call, a pass over the whole weight that cost
// about what 10 rows of products do. The tensor the engine holds is the panels alone, shaped as
// every other packed weight; a copy of it (`clone`, `to`) holds the panels alone and takes the
// rewrite per call, with the same sums. The panels must not be written after packing.
constexpr uint64_t kTiledMagic = 0x3164656c69746470ULL;  // "pdtiled1"
constexpr int64_t kHeaderHalves = 32;                      // the header's 64 bytes, in bfloat16 units

struct TiledHeader {
  uint64_t magic;
  int64_t panels, k_len, k_pad;
};

int64_t tiled_halves(int64_t panels, int64_t k_pad) { return panels * (k_pad / 2) * kPanel * 2; }

at::Tensor with_tiled_copy(const at::Tensor& packed) {
  const int64_t panels = packed.size(0), k_len = packed.size(1);
  const int64_t k_pad = (k_len + kTileK - 1) / kTileK * kTileK, halves = packed.numel();
  at::Tensor storage = at::empty({halves + tiled_halves(panels, k_pad) + kHeaderHalves}, packed.options());
  at::Tensor panels_view = storage.narrow(0, 0, halves).view(packed.sizes());
  panels_view.copy_(packed);
  auto* base = static_cast<uint16_t*>(storage.data_ptr());
  auto* tiled = reinterpret_cast<uint32_t*>(base + halves);  // halves is a multiple of 64: aligned as the storage
  for (int64_t j = 0; j < panels; ++j)
    tile_panel(base + j * k_len * kPanel, k_len, k_pad, tiled + j * (k_pad / 2) * kPanel);
  const TiledHeader header{kTiledMagic, panels, k_len, k_pad};
  std::memcpy(base + halves + tiled_halves(panels, k_pad), &header, sizeof(header));
  return panels_view;
}

// The tile copy `with_tiled_copy` left past these panels, or null where there is none (a copy of
// the tensor, a float32 weight): known by the storage's exact size and the header's contents.
const uint32_t* tiled_copy(const at::Tensor& packed, int64_t k_len, int64_t k_pad) {
  const int64_t panels = packed.size(0), halves = packed.numel();
  const int64_t bytes = (halves + tiled_halves(panels, k_pad) + kHeaderHalves) * 2;
  if (packed.scalar_type() != at::kBFloat16 || packed.storage_offset() != 0 || !packed.has_storage() ||
      static_cast<int64_t>(packed.storage().nbytes()) != bytes)
    return nullptr;
  const auto* base = static_cast<const uint16_t*>(packed.data_ptr());
  TiledHeader header;
  std::memcpy(&header, base + halves + tiled_halves(panels, k_pad), sizeof(header));
  if (header.magic != kTiledMagic || header.panels != panels || header.k_len != k_len || header.k_pad != k_pad)
    return nullptr;
  return reinterpret_cast<const uint32_t*>(base + halves);
}
#endif

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
  if (weight.scalar_type() == at::kBFloat16) {  // pair the columns: (half, i) -> word i of the half
    packed = packed.view({packed.size(0), k, 2, 2, kHalf / 2}).transpose(3, 4).contiguous().view(packed.sizes());
#ifdef PDSERVE_LINEAR_AMX
    if (tiles_permitted()) return with_tiled_copy(packed);
#endif
  }
  return packed;
}


bool linear_packed_available() {
#ifdef PDSERVE_LINEAR_VECTOR
  return true;
#else
  return false;
#endif
}

// The tile path on or off for this process (on by default; off: the vector loops at every row
// count, for A/B timing and their tests); returns the setting before.
std::atomic<bool> tiles_on{true};

bool linear_use_tiles(bool on) { return tiles_on.exchange(on); }

#ifdef PDSERVE_LINEAR_AMX
// Whether m rows take the tile path in this process now, times panels with their tile copy
// (`pretiled`) or without.
bool takes_tiles(int64_t m, bool pretiled) {
  return tiles_on.load(std::memory_order_relaxed) && (pretiled ? tiles_pay_tiled(m) : tiles_pay(m)) &&
         tiles_permitted();
}
#endif

// Whether `rows` rows times bfloat16 panels from `linear_pack` (with their tile copy) take the
// tile path in this build and process now. A copy of such panels (no tile copy) takes it from
// more rows (`tiles_pay`).
bool linear_tile_rows(int64_t rows) {
#ifdef PDSERVE_LINEAR_AMX
  return takes_tiles(rows, true);
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
#ifdef PDSERVE_LINEAR_AMX
  const int64_t k_pad = (k_len + kTileK - 1) / kTileK * kTileK;
  const uint32_t* pretiled = half ? tiled_copy(packed, k_len, k_pad) : nullptr;
  if (half && takes_tiles(m_len, pretiled != nullptr)) {
    const int64_t m_pad = (m_len + kTileRows - 1) / kTileRows * kTileRows;
    thread_local std::vector<uint16_t> parts;  // reused: a fresh buffer of this size is a fresh mapping
    parts.resize(kParts * m_pad * k_pad + kAlignSlack);
    uint16_t* pa = aligned_tiles(parts.data());
    split_rows(xp, m_len, k_len, m_pad, k_pad, pa);
    at::parallel_for(0, packed.size(0), grain, [&](int64_t first, int64_t last) {
      thread_local std::vector<uint32_t> tiled;
      if (pretiled == nullptr) tiled.resize(k_pad / 2 * kPanel);
      configure_tiles();
      for (int64_t j = first; j < last; ++j) {
        const int64_t cols = std::min(kPanel, n - j * kPanel);
        const uint32_t* panel = tiled.data();
        if (pretiled != nullptr)
          panel = pretiled + j * (k_pad / 2) * kPanel;
        else
          tile_panel(static_cast<const uint16_t*>(pp) + j * k_len * kPanel, k_len, k_pad, tiled.data());
        tile_panel_rows(pa, m_len, m_pad, k_pad, panel, yp + j * kPanel, n, cols, bp == nullptr ? nullptr : bp + j * kPanel);
      }
      _tile_release();
    });
    return;
  }
#endif
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
  m.def("linear_tile_rows(int rows) -> bool", &linear_tile_rows);
  m.def("linear_use_tiles(bool on) -> bool", &linear_use_tiles);
}

TORCH_LIBRARY_IMPL(PDSERVE_OP_NAMESPACE, CPU, m) {
  m.impl("linear_pack", &linear_pack);
  m.impl("linear_packed", &linear_packed);
}
