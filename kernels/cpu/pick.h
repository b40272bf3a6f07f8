// How the library's ops turn a row of logits into a token or a distribution: the argmax (the first
// largest), the softmax at a temperature, and the exponential race of that softmax against a row of
// Exp(1) noise. draft_passes.cpp's passes and verification pick with these, pdserve::race_rows is
// the sampler's CPU path through them, and rejection.cpp's rule reads the distributions they make,
// so a token drawn on any of those paths is drawn from the same numbers. In an anonymous namespace,
// as attention_vectors.h: each file that includes it gets its own copy, none exported.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attention_vectors.h"  // softmax_row16 / softmax_row8, exp_nonpositive

namespace {

// The first index of the largest of n values (as torch.argmax: NaN apart, which no row holds).
inline int64_t first_max(const float* v, int64_t n) {
#ifdef PDSERVE_AVX512
  if (n >= 16) {  // the largest value, then the first lane holding it: two passes over a row in L1
    __m512 top = _mm512_loadu_ps(v);
    int64_t i = 16;
    for (; i + 16 <= n; i += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(v + i));
    float m = _mm512_reduce_max_ps(top);
    for (; i < n; ++i) m = std::max(m, v[i]);
    const __m512 mv = _mm512_set1_ps(m);
    for (i = 0; i + 16 <= n; i += 16)
      if (const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(v + i), mv, _CMP_EQ_OQ))
        return i + __builtin_ctz(hit);
    for (; i < n; ++i)
      if (v[i] == m) return i;
  }
#endif
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (v[i] > v[best]) best = i;
  return best;
}

// probs[0, n): the distribution a row samples from at temperature t, softmax(logits / t); at t <= 0
// one-hot on the argmax (a greedy row's).
inline void temperature_probs(const float* logits, int64_t n, float t, float* probs) {
  if (t <= 0.f) {
    std::fill(probs, probs + n, 0.f);
    probs[first_max(logits, n)] = 1.f;
    return;
  }
  for (int64_t i = 0; i < n; ++i) probs[i] = logits[i] / t;
#if defined(PDSERVE_AVX512)
  softmax_row16(probs, n, n);
#elif defined(PDSERVE_AVX2)
  softmax_row8(probs, n, n);
#else
  const float top = *std::max_element(probs, probs + n);
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += probs[i] = exp_nonpositive(probs[i] - top);
  for (int64_t i = 0; i < n; ++i) probs[i] /= sum;
#endif
}

// The exponential race of a distribution against a row of Exp(1) noise: the first largest p / E
// (`kernels/sampling.race_ref`). ratio: n floats of scratch.
inline int64_t race_probs(const float* probs, const float* noise, int64_t n, float* ratio) {
  for (int64_t i = 0; i < n; ++i) ratio[i] = probs[i] / noise[i];
  return first_max(ratio, n);
}

// The exponential race over softmax(logits / t), t > 0.
inline int64_t race(const float* logits, const float* noise, int64_t n, float t, std::vector<float>& probs) {
  probs.resize(n);
  temperature_probs(logits, n, t, probs.data());
  return race_probs(probs.data(), noise, n, probs.data());
}

// A row's pick, as every op here picks: at temperature t <= 0 the argmax (the first largest, noise
// unread: it may be null), else the race against the row's noise.
inline int64_t pick(const float* logits, const float* noise, int64_t n, float t, std::vector<float>& probs) {
  return t <= 0.f ? first_max(logits, n) : race(logits, noise, n, t, probs);
}

}  // namespace
