// The bits behind every random draw (`engine/rng.py`, bit for bit): a row's 64-bit key from
// (seed, position, stream), the uniform a key stands for, and the hash that spreads a key over a
// vocabulary's worth of uniforms (noise.cpp's ops; rejection.cpp's acceptance tests and last
// tokens). In an anonymous namespace, as attention_vectors.h: each including file gets its own copy.
#pragma once

#include <cstdint>

namespace {

constexpr float kScale = 1.0f / 16777216.0f;  // 2^-24

// The streams of `engine/rng.py`: independent draws at one position.
constexpr uint64_t kSampleStream = 0, kAcceptStream = 1, kResidualStream = 2;

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// `rng.row_key`: two splitmix64 rounds on 64-bit words, which wrap as Python's masked arithmetic does.
inline uint64_t row_key(uint64_t seed, uint64_t position, uint64_t stream) {
  return splitmix64(splitmix64(seed) ^ ((position << 4) | stream));
}

// `rng.uniform`: a key's top 53 bits as a double in [0, 1), exactly.
inline double key_uniform(uint64_t key) { return static_cast<double>(key >> 11) * (1.0 / 9007199254740992.0); }

inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// One row of `rng.hash_uniforms`: 512-bit vectors where the CPU has them (GCC's -march=native
// picks 256 on AVX-512 CPUs): on the Intel Xeon, 40 rows of 4096 took 50 µs against 69 (scratch
// C++ timing).
__attribute__((target("prefer-vector-width=512"))) inline void hash_row(uint32_t k0, uint32_t k1,
                                                                        const uint32_t* __restrict code,
                                                                        float* __restrict row, int64_t vocab) {
  for (int64_t v = 0; v < vocab; ++v) {
    const uint32_t x = mix32(mix32(code[v] ^ k0) ^ k1);
    const float bits = static_cast<float>(static_cast<int32_t>((x >> 8) & 0xFFFFFFu));
    row[v] = (bits + 0.5f) * kScale;
  }
}

// hash_row for a row's 64-bit key
inline void hash_key_row(uint64_t key, const uint32_t* __restrict code, float* __restrict row, int64_t vocab) {
  hash_row(static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32), code, row, vocab);
}

}  // namespace
