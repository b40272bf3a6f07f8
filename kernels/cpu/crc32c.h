// The CRC-32C engine of pdserve's KV copies (kv_copy.cpp, which registers the ops):
// `checksum` and `copy_checksum`, raw registers in and out. Included by kv_copy.cpp alone.
//
// A transfer moves each layer's K and V as rows (one token's [num_kv_heads, head_dim]) between a
// KV cache's slots and a contiguous buffer, or between two caches (the shared-memory path), and
// checksums them: K rows in order, then V rows. Copying first and checksumming after reads the
// bytes twice, and one CRC-32C chain (the crc32 instruction has a latency of 3 cycles for 8
// bytes) runs slower than a copy. Here every 8-byte word is loaded once, stored, and fed to one
// of three independent CRC chains, over three lanes of each stretch of the buffer; the three
// registers are then joined by "shifting" the first over the second lane's length of zero bytes
// (a linear map of the 32-bit register, applied through four 256-entry tables built at load)
// and xoring in the next. Where AVX2 is there, a long copy stores with streaming 32-byte stores,
// which skip reading the destination's lines first: on this project's Xeon that copy-and-checksum
// ran at about 1.3x the speed of glibc's memcpy of the same 64 MiB.
//
// Where the CPU has carry-less multiplication (PCLMULQDQ), the checksum does not use the crc32
// chains above but folds: four 16-byte accumulators (four 64-byte ones with VPCLMULQDQ and
// AVX-512), each multiplied (carry-less) by a power of x mod P and xored into the words of the
// next stretch as they are loaded (and stored, for a copy), then folded into one and reduced by
// two crc32 instructions. On the AMD EPYC (Zen 4) this project moved to, the three
// crc32 chains checksummed at about 13 GB/s and copied-and-checksummed at about 12.7 GB/s, against
// 19 GB/s for torch's plain copy: below the copy, where on the Xeon they were above it. Folded,
// the checksum ran at 43 GB/s in cache and the copy-and-check at the plain copy's speed.
//
// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) as iSCSI and google-crc32c define it:
// the register starts at ~crc and the result is ~register, so crc(a + b) = extend(crc(a), b).
// x86 SSE4.2 and ARMv8 CRC instructions when compiled for them, a byte table otherwise.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>

#if defined(__SSE4_2__)
#include <nmmintrin.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__PCLMUL__)
#include <wmmintrin.h>
#define PDSERVE_CRC_FOLD 1
#if defined(__AVX512F__) && defined(__VPCLMULQDQ__)
#include <immintrin.h>
#define PDSERVE_CRC_FOLD512 1
#endif
#endif
#elif defined(__ARM_FEATURE_CRC32)
#include <arm_acle.h>
#endif

namespace pdserve_crc {

#if !defined(__SSE4_2__) && !defined(__ARM_FEATURE_CRC32)
constexpr uint32_t kPoly = 0x82F63B78u;

inline const std::array<uint32_t, 256>& byte_table() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = c & 1 ? (c >> 1) ^ kPoly : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  return table;
}
#endif

// The raw register update (no inversion) by one byte and by one little-endian 8-byte word.
inline uint32_t step1(uint32_t c, uint8_t b) {
#if defined(__SSE4_2__)
  return _mm_crc32_u8(c, b);
#elif defined(__ARM_FEATURE_CRC32)
  return __crc32cb(c, b);
#else
  return byte_table()[(c ^ b) & 0xFF] ^ (c >> 8);
#endif
}

inline uint32_t step8(uint32_t c, uint64_t w) {
#if defined(__SSE4_2__)
  return static_cast<uint32_t>(_mm_crc32_u64(c, w));
#elif defined(__ARM_FEATURE_CRC32)
  return __crc32cd(c, w);
#else
  for (int k = 0; k < 8; ++k) c = step1(c, static_cast<uint8_t>(w >> (8 * k)));
  return c;
#endif
}

// The register after `Bytes` zero bytes, as a table lookup per byte of the register (the map is
// linear over GF(2), so it is the xor of its images of the register's set bits).
struct Shift {
  uint32_t t[4][256];
  inline uint32_t operator()(uint32_t c) const {
    return t[0][c & 0xFF] ^ t[1][(c >> 8) & 0xFF] ^ t[2][(c >> 16) & 0xFF] ^ t[3][c >> 24];
  }
};

template <size_t Bytes>
const Shift& zeros_shift() {
  static const Shift shift = [] {
    uint32_t image[32];
    for (int bit = 0; bit < 32; ++bit) {
      uint32_t c = 1u << bit;
      for (size_t i = 0; i < Bytes; i += 8) c = step8(c, 0);
      image[bit] = c;
    }
    Shift s{};
    for (int k = 0; k < 4; ++k)
      for (uint32_t v = 0; v < 256; ++v) {
        uint32_t r = 0;
        for (int bit = 0; bit < 8; ++bit)
          if (v >> bit & 1) r ^= image[8 * k + bit];
        s.t[k][v] = r;
      }
    return s;
  }();
  return shift;
}

inline uint64_t load8(const uint8_t* p) {
  uint64_t w;
  std::memcpy(&w, p, 8);
  return w;
}

// Rounds of three `Lane`-byte lanes while at least one round is left; returns the bytes used.
template <size_t Lane, bool Copy>
inline size_t three_lanes(const uint8_t* src, uint8_t* dst, size_t n, uint32_t& c) {
  const Shift& shift = zeros_shift<Lane>();
  size_t done = 0;
  for (; n - done >= 3 * Lane; done += 3 * Lane) {
    const uint8_t* s = src + done;
    uint32_t c1 = 0, c2 = 0;
    for (size_t i = 0; i < Lane; i += 8) {
      const uint64_t a = load8(s + i), b = load8(s + Lane + i), d = load8(s + 2 * Lane + i);
      if constexpr (Copy) {
        std::memcpy(dst + done + i, &a, 8);
        std::memcpy(dst + done + Lane + i, &b, 8);
        std::memcpy(dst + done + 2 * Lane + i, &d, 8);
      }
      c = step8(c, a);
      c1 = step8(c1, b);
      c2 = step8(c2, d);
    }
    c = shift(c) ^ c1;
    c = shift(c) ^ c2;
  }
  return done;
}

#if defined(__AVX2__)
// The same rounds for a copy with streaming (non-temporal) 32-byte stores, `dst` 32-byte aligned:
// written lines go to memory without first being read into the cache, which a plain copy of a
// large buffer pays for. Each lane's words are checksummed from the lines just loaded.
template <size_t Lane>
inline size_t three_lanes_streaming(const uint8_t* src, uint8_t* dst, size_t n, uint32_t& c) {
  static_assert(Lane % 32 == 0);
  const Shift& shift = zeros_shift<Lane>();
  size_t done = 0;
  for (; n - done >= 3 * Lane; done += 3 * Lane) {
    const uint8_t* s = src + done;
    uint8_t* d = dst + done;
    uint32_t c1 = 0, c2 = 0;
    for (size_t i = 0; i < Lane; i += 32) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i)));
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d + Lane + i),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + Lane + i)));
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 2 * Lane + i),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 2 * Lane + i)));
      for (size_t k = 0; k < 32; k += 8) {
        c = step8(c, load8(s + i + k));
        c1 = step8(c1, load8(s + Lane + i + k));
        c2 = step8(c2, load8(s + 2 * Lane + i + k));
      }
    }
    c = shift(c) ^ c1;
    c = shift(c) ^ c2;
  }
  return done;
}
#endif

#ifdef PDSERVE_CRC_FOLD
// Folding. A 16-byte chunk of the stream, loaded little-endian, is the polynomial whose x^127
// coefficient is the stream's first bit (bit 0 of byte 0) and x^0 its last: its low 64-bit word
// Q0 holds x^127..x^64, its high word Q1 x^63..x^0. The chunk's share of the CRC does not change
// if it is replaced by any polynomial congruent modulo P to chunk * x^D, added into the chunk D
// bits later: Q0 * (x^(D+64) mod P) + Q1 * (x^D mod P), both products under 96 bits. A carry-less
// multiply of two such words gives their product times x (the bit order is reversed), so the
// multiplier words hold x^(D+63) mod P and x^(D-1) mod P, each a 32-bit register value placed in
// the word's upper half. What is left at the end, one chunk R congruent to the whole prefix, has
// the register R * x^32 mod P: the crc32 instruction over R's 16 bytes from a zero register.

// x^e mod P as a fold multiplier word (the register's bit i is the coefficient of x^(31 - i)).
inline uint64_t xpow_word(int e) {
  uint32_t r = 0x80000000u;  // the polynomial 1
  for (int i = 0; i < e; ++i) r = (r >> 1) ^ (r & 1 ? 0x82F63B78u : 0u);  // times x, mod P
  return static_cast<uint64_t>(r) << 32;
}

// The multiplier pair folding a chunk D bits ahead: low word for Q0, high word for Q1.
__m128i fold_by(int d) {
  return _mm_set_epi64x(static_cast<long long>(xpow_word(d - 1)), static_cast<long long>(xpow_word(d + 63)));
}

struct FoldConstants {
  __m128i by512 = fold_by(512), by128 = fold_by(128);  // 64 and 16 bytes ahead
#ifdef PDSERVE_CRC_FOLD512
  // the same pairs in each of a 64-byte register's four chunks: 256 and 64 bytes ahead
  __m512i by2048x4 = _mm512_broadcast_i32x4(fold_by(2048)), by512x4 = _mm512_broadcast_i32x4(fold_by(512));
#endif
};

inline const FoldConstants& fold_constants() {
  static const FoldConstants k;
  return k;
}

inline __m128i fold(__m128i acc, __m128i by, __m128i next) {
  return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(acc, by, 0x00), _mm_clmulepi64_si128(acc, by, 0x11)), next);
}

#ifdef PDSERVE_CRC_FOLD512
// Four chunks at once (VPCLMULQDQ): on the Zen 4 EPYC one 16-byte carry-less multiply every
// other cycle left the 16-byte folds as slow as the crc32 chains (about 13 GB/s).
inline __m512i fold4(__m512i acc, __m512i by, __m512i next) {
  return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(acc, by, 0x00), _mm512_clmulepi64_epi128(acc, by, 0x11),
                                   next, 0x96);  // a ^ b ^ c
}
#endif

// The register after the leading multiple of 16 bytes of src (at least 128 bytes, else nothing
// is done and 0 returned), continuing from `c`, copying them to dst when Copy (with streaming
// stores when Stream: dst 64-byte aligned); returns the bytes done.
template <bool Copy, bool Stream>
inline size_t fold_bulk(const uint8_t* src, uint8_t* dst, size_t n, uint32_t& c) {
  if (n < 128) return 0;
  const FoldConstants& k = fold_constants();
  auto load = [&](size_t at) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + at));
    if constexpr (Copy) {
      if constexpr (Stream)
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + at), v);
      else
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + at), v);
    }
    return v;
  };
  // the register enters as the first four bytes xored with it (crc from c = crc from 0 of that)
  const __m128i first = _mm_cvtsi32_si128(static_cast<int>(c));
  size_t done = 0;
  __m128i x;
#ifdef PDSERVE_CRC_FOLD512
  if (n >= 512) {  // Stream: dst 64-byte aligned
    auto load64 = [&](size_t at) {
      const __m512i v = _mm512_loadu_si512(src + at);
      if constexpr (Copy) {
        if constexpr (Stream)
          _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + at), v);
        else
          _mm512_storeu_si512(dst + at, v);
      }
      return v;
    };
    __m512i a0 = _mm512_xor_si512(load64(0), _mm512_zextsi128_si512(first)), a1 = load64(64), a2 = load64(128),
            a3 = load64(192);
    for (done = 256; n - done >= 256; done += 256) {
      a0 = fold4(a0, k.by2048x4, load64(done));
      a1 = fold4(a1, k.by2048x4, load64(done + 64));
      a2 = fold4(a2, k.by2048x4, load64(done + 128));
      a3 = fold4(a3, k.by2048x4, load64(done + 192));
    }
    __m512i a = fold4(fold4(fold4(a0, k.by512x4, a1), k.by512x4, a2), k.by512x4, a3);
    for (; n - done >= 64; done += 64) a = fold4(a, k.by512x4, load64(done));
    x = fold(fold(fold(_mm512_extracti32x4_epi32(a, 0), k.by128, _mm512_extracti32x4_epi32(a, 1)), k.by128,
                  _mm512_extracti32x4_epi32(a, 2)),
             k.by128, _mm512_extracti32x4_epi32(a, 3));
  } else
#endif
  {
    __m128i x0 = _mm_xor_si128(load(0), first), x1 = load(16), x2 = load(32), x3 = load(48);
    for (done = 64; n - done >= 64; done += 64) {
      x0 = fold(x0, k.by512, load(done));
      x1 = fold(x1, k.by512, load(done + 16));
      x2 = fold(x2, k.by512, load(done + 32));
      x3 = fold(x3, k.by512, load(done + 48));
    }
    x = fold(fold(fold(x0, k.by128, x1), k.by128, x2), k.by128, x3);
  }
  for (; n - done >= 16; done += 16) x = fold(x, k.by128, load(done));
  const uint64_t lo = static_cast<uint64_t>(_mm_cvtsi128_si64(x));
  const uint64_t hi = static_cast<uint64_t>(_mm_cvtsi128_si64(_mm_unpackhi_epi64(x, x)));
  c = step8(step8(0, lo), hi);
  return done;
}
#endif  // PDSERVE_CRC_FOLD

// The raw register after the `n` bytes from `done` on, copying them to `dst` when Copy.
template <bool Copy>
inline uint32_t finish(const uint8_t* src, uint8_t* dst, size_t done, size_t n, uint32_t c) {
#ifdef PDSERVE_CRC_FOLD
  done += fold_bulk<Copy, false>(src + done, Copy ? dst + done : nullptr, n - done, c);
#endif
  done += three_lanes<256, Copy>(src + done, Copy ? dst + done : nullptr, n - done, c);
  for (; n - done >= 8; done += 8) {
    const uint64_t w = load8(src + done);
    if constexpr (Copy) std::memcpy(dst + done, &w, 8);
    c = step8(c, w);
  }
  for (; done < n; ++done) {
    if constexpr (Copy) dst[done] = src[done];
    c = step1(c, src[done]);
  }
  return c;
}

// The raw register after `n` bytes of `src`, continuing from `c`.
inline uint32_t checksum(const uint8_t* src, size_t n, uint32_t c) {
#ifdef PDSERVE_CRC_FOLD
  return finish<false>(src, nullptr, 0, n, c);
#else
  const size_t done = three_lanes<4096, false>(src, nullptr, n, c);
  return finish<false>(src, nullptr, done, n, c);
#endif
}

// `n` bytes copied from `src` to `dst`, and the raw register after them, continuing from `c`.
inline uint32_t copy_checksum(const uint8_t* src, uint8_t* dst, size_t n, uint32_t c) {
  size_t done = 0;
#if defined(__AVX2__)
  constexpr size_t kLane = 4096;
  if (n >= 3 * kLane + 32) {
    done = (64 - reinterpret_cast<uintptr_t>(dst) % 64) % 64;  // up to dst's first 64-byte boundary
    for (size_t i = 0; i < done; ++i) {
      dst[i] = src[i];
      c = step1(c, src[i]);
    }
#ifdef PDSERVE_CRC_FOLD
    done += fold_bulk<true, true>(src + done, dst + done, n - done, c);
#else
    done += three_lanes_streaming<kLane>(src + done, dst + done, n - done, c);
#endif
    _mm_sfence();  // the streamed stores are visible before anything that follows
  }
#endif
#ifndef PDSERVE_CRC_FOLD
  done += three_lanes<4096, true>(src + done, dst + done, n - done, c);
#endif
  return finish<true>(src, dst, done, n, c);
}

}  // namespace pdserve_crc
