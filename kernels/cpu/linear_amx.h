// linear_packed's tile path (linear.cpp, whose first lines say what the op computes): bfloat16
// panels times many rows of x on Intel's AMX tile unit, where the CPU has one and the kernel lets
// this process use it. Included by linear.cpp alone.
//
// Why: from some 16 rows up (a batch's decode step, its verifications, a prefill) the vector
// loops are bound by their float32 multiply-adds (about 190 GFLOP/s a core here), not by the
// weight's bytes; one tile instruction does 16 x 16 x 32 bfloat16 products with float32 sums.
//
// Exact inputs: a bfloat16 panel's weights are exact (linear.cpp), and each float32 value of x is
// split into three bfloat16 whose sum is that value exactly (x = x1 + x2 + x3: each part the
// rounding of what the parts before it left, 8 significant bits each, 24 in all). Every product of
// a part and a weight is exact in float32, so the output differs from the float32 loops' only by
// the order and rounding of its float32 sums (the tile unit adds pairs of products, then the pair
// to the sum): what a BLAS's blocking also changes. Three tile products per weight tile, and still
// 1.05-1.7x the vector loops' speed at 32 rows and 1.8-2.6x at 160 with each panel rewritten per
// call (scratch timing, the demo target's shapes, one thread, Intel Xeon with AMX; the 768-deep
// down projection gains least; the instruction's peak is some 16 times an AVX-512 multiply-add's,
// so loads and the panel's rewrite, not the products, bound it); 1.5x at 8 rows and 2.7x at 32
// with the rewrite done once, at packing (linear.cpp, `with_tiled_copy`). Inputs under 2^-126
// (subnormal) count as zero in the tile unit.
//
// Layout: the tile unit's second operand holds two consecutive k of 16 columns in each 64-byte
// row, so a panel (K rows of 64 paired columns, linear_loops.h) is rewritten into that order
// (`tile_panel`, a few shifts and blends per 64 bytes: once at packing, kept beside the panels by
// linear.cpp's `with_tiled_copy`, or by each thread per call for panels without), and every 16 rows
// of x are multiplied by it: four 16 x 16 float32 sums (the panel's 64 columns) in four tiles, x's three parts
// for 32 k in three more, the weight's 32 k x 16 columns in the last. x's parts are laid out tile
// by tile (1 KB each, contiguous): 1.2x faster tile loads than rows of x in place (scratch timing).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BF16__) && \
    defined(__linux__)
#define PDSERVE_LINEAR_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>

#include "linear_loops.h"  // kPanel: a panel's 64 columns, four sum tiles wide

namespace pdserve_linear {

constexpr int64_t kTileRows = 16;  // rows of x per tile, and k pairs per weight tile
constexpr int64_t kTileK = 32;     // k per tile product
constexpr int kParts = 3;          // bfloat16 parts of a float32

// Whether this process may use the tile unit: Linux gives the tile registers' state only to a
// process that asks (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA, kernel 5.16 and later).
inline bool tiles_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
}

// Every tile 16 rows of 64 bytes: a sum tile's 16 floats, a part's 32 bfloat16, a weight tile's 16
// columns of k pairs.
inline void configure_tiles() {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = kTileRows;
  _tile_loadconfig(&config);
}

inline __m512 bf16_to_float(__m256bh h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16));
}

// The first 64-byte boundary at or after p (a buffer allocated kAlignSlack halves longer than it
// needs): a tile load whose rows straddle cache lines takes about twice as long (scratch timing,
// Intel Xeon with AMX: the tile path's inner loop at 7.3 ns a tile product with x's parts 64-byte
// aligned, 14-15 with them 16 or 32 bytes off, as malloc's 16-byte alignment leaves them).
constexpr int64_t kAlignSlack = 32;
inline uint16_t* aligned_tiles(uint16_t* p) {
  return reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
}

// x [m_len, k_len] float32 into parts: kParts planes of m_pad x k_pad bfloat16 (zero in the
// padding; m_pad a multiple of kTileRows, k_pad of kTileK), each laid out tile by tile: the tile
// of rows [r0, r0 + 16) and k [k0, k0 + 32) is the 1 KB at r0 * k_pad + k0 * 16, row-major.
inline void split_rows(const float* x, int64_t m_len, int64_t k_len, int64_t m_pad, int64_t k_pad, uint16_t* parts) {
  for (int64_t m = 0; m < m_pad; ++m)
    for (int64_t k = 0; k < k_pad; k += 16) {  // every value written once: the padding as zeros
      const int64_t n = m < m_len ? std::clamp<int64_t>(k_len - k, 0, 16) : 0;
      const __mmask16 live = n == 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
      __m512 rest = _mm512_maskz_loadu_ps(live, x + m * k_len + k);  // no access where masked off
      const int64_t at = (m / kTileRows) * kTileRows * k_pad + (k / kTileK) * kTileK * kTileRows +
                         (m % kTileRows) * kTileK + k % kTileK;
      for (int p = 0; p < kParts; ++p) {
        const __m256bh part = _mm512_cvtneps_pbh(rest);  // round to nearest even
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(parts + p * m_pad * k_pad + at), (__m256i)part);
        rest = _mm512_sub_ps(rest, bf16_to_float(part));  // exact
      }
    }
}

// A paired panel (K rows of 64 bfloat16, linear_loops.h's pairing) as weight tiles' rows:
// word [p][c] = (k = 2p, column c) in its low half, (2p + 1, c) in its high half, p < k_pad / 2.
inline void tile_panel(const uint16_t* panel, int64_t k_len, int64_t k_pad, uint32_t* out) {
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t p = 0; p < k_pad / 2; ++p)
    for (int h = 0; h < 2; ++h) {  // each half's word i pairs its columns i and 16 + i
      const int64_t k0 = 2 * p, k1 = k0 + 1;
      const __m512i a = k0 < k_len ? _mm512_loadu_si512(panel + k0 * kPanel + 32 * h) : zero;
      const __m512i b = k1 < k_len ? _mm512_loadu_si512(panel + k1 * kPanel + 32 * h) : zero;
      const __m512i low = _mm512_mask_blend_epi16(0xAAAAAAAA, a, _mm512_slli_epi32(b, 16));
      const __m512i high = _mm512_mask_blend_epi16(0xAAAAAAAA, _mm512_srli_epi32(a, 16), b);
      _mm512_storeu_si512(out + p * kPanel + 32 * h, low);
      _mm512_storeu_si512(out + p * kPanel + 32 * h + 16, high);
    }
}

// Sum tile `sum` (a literal: the compiler's tile intrinsics name their tiles in the instruction)
// gets the three parts (tiles 4-6) times the weight tile at w (into tile 7).
#define PDSERVE_COLUMN_TILE(sum, w, stride) \
  do {                                      \
    _tile_loadd(7, (w), (stride));          \
    _tile_dpbf16ps(sum, 4, 7);              \
    _tile_dpbf16ps(sum, 5, 7);              \
    _tile_dpbf16ps(sum, 6, 7);              \
  } while (0)

// One tiled panel (`tile_panel`) times the parts of x: y [m_len, ldy] gets the panel's `cols`
// columns, plus bias (or none). The tiles are configured on this thread. Per 16 rows, the panel's
// four 16-column sums take the three parts of each 32 k in turn.
// (Scratch timings of other orders, the demo's shapes, 32-160 rows, with x's parts still in rows:
// each part's own sums, or two row blocks by two column tiles, 10-60% slower than this one; it
// loads the fewest tiles.)
inline void tile_panel_rows(const uint16_t* parts, int64_t m_len, int64_t m_pad, int64_t k_pad, const uint32_t* tiled,
                            float* y, int64_t ldy, int64_t cols, const float* bias) {
  const int64_t plane = m_pad * k_pad;
  alignas(64) float sums[kTileRows * kPanel];
  constexpr int64_t kStride = 64, kWeightStride = kPanel * 4;  // bytes from a tile row to the next
  for (int64_t r0 = 0; r0 < m_len; r0 += kTileRows) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint16_t* a = parts + r0 * k_pad;
    for (int64_t k = 0; k < k_pad; k += kTileK) {
      _tile_loadd(4, a + k * kTileRows, kStride);
      _tile_loadd(5, a + plane + k * kTileRows, kStride);
      _tile_loadd(6, a + 2 * plane + k * kTileRows, kStride);
      const uint32_t* w = tiled + (k / 2) * kPanel;
      PDSERVE_COLUMN_TILE(0, w, kWeightStride);
      PDSERVE_COLUMN_TILE(1, w + 16, kWeightStride);
      PDSERVE_COLUMN_TILE(2, w + 32, kWeightStride);
      PDSERVE_COLUMN_TILE(3, w + 48, kWeightStride);
    }
    _tile_stored(0, sums, kPanel * 4);
    _tile_stored(1, sums + 16, kPanel * 4);
    _tile_stored(2, sums + 32, kPanel * 4);
    _tile_stored(3, sums + 48, kPanel * 4);
    const int64_t rows = std::min(kTileRows, m_len - r0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; c += 16) {
        const __mmask16 live = cols - c >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (cols - c)) - 1);
        __m512 v = _mm512_loadu_ps(sums + r * kPanel + c);
        if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(live, bias + c));
        _mm512_mask_storeu_ps(y + (r0 + r) * ldy + c, live, v);
      }
  }
}

}  // namespace pdserve_linear

#undef PDSERVE_COLUMN_TILE

#endif  // PDSERVE_LINEAR_AMX
