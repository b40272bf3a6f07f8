// K/V rows between a step's dtype and its cache's, for pdserve::paged_attention_cpu
// (paged_attention.cpp): the step's rows written into their slots (rounded where the cache is
// narrower: `EngineConfig.kv_cache_dtype`), and a 16-bit cache's rows widened to float32 as the
// attention reads them. In an anonymous namespace, as attention_vectors.h.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "attention_vectors.h"  // PDSERVE_AVX512 (and <immintrin.h> with it)

namespace {

// The step's K or V rows into their cache slots, rounded to the cache's dtype C where it is
// narrower than the rows' T (a 16-bit cache under a float32 model: round to nearest even, as
// torch's `.to()` rounds, so the torch path's caches hold the same bits), and into a float16
// cache saturated at its largest finite value (as `kernels/kv_write.as_cache_dtype`): an infinity
// left in a block would outlive its request, and padded attention rows of later ones read stale
// slots.
template <typename T, typename C>
void write_rows(const at::Tensor& src, at::Tensor& cache, const int64_t* slots, int64_t num_tokens) {
  // src [T, Hkv, D] with (Hkv, D) contiguous; cache [num_blocks, block_size, Hkv, D] contiguous
  const int64_t row = cache.size(2) * cache.size(3);
  const int64_t num_slots = cache.size(0) * cache.size(1);
  const T* s = src.data_ptr<T>();
  C* c = cache.data_ptr<C>();
  const int64_t stride = src.stride(0);
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "paged_attention_cpu: slot ", slots[t], " out of range");
    if constexpr (std::is_same_v<T, C>)
      std::copy(s + t * stride, s + t * stride + row, c + slots[t] * row);
    else if constexpr (std::is_same_v<C, c10::Half>)
      for (int64_t x = 0; x < row; ++x)
        c[slots[t] * row + x] = static_cast<C>(std::clamp(static_cast<float>(s[t * stride + x]), -65504.f, 65504.f));
    else
      for (int64_t x = 0; x < row; ++x) c[slots[t] * row + x] = static_cast<C>(static_cast<float>(s[t * stride + x]));
  }
}

// n cache values as float32: in vector registers for a 16-bit cache where the CPU has AVX-512
// (bfloat16: the top half of a float's bits; float16: the F16C conversion), else one by one.
template <typename C>
inline void widen(const C* src, float* dst, int64_t n) {
  int64_t x = 0;
#ifdef PDSERVE_AVX512
  if constexpr (std::is_same_v<C, c10::BFloat16>)
    for (; x + 16 <= n; x += 16) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + x));
      _mm512_storeu_ps(dst + x, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
    }
  if constexpr (std::is_same_v<C, c10::Half>)
    for (; x + 16 <= n; x += 16)
      _mm512_storeu_ps(dst + x, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + x))));
#endif
  for (; x < n; ++x) dst[x] = static_cast<float>(src[x]);
}

}  // namespace
