// pdserve::hash_uniforms: the uniforms behind the sampler's exponential race, one pass.
//
// `engine/rng.py`'s `hash_uniforms(keys, codes)` in C++, bit for bit: for row r and vocabulary
// index v, x = codes[v] ^ keys[r][0], mixed (lowbias32), xored with keys[r][1], mixed again, and
// the top 24 bits as (bits + 0.5) / 2^24 in float32. The torch version runs about a dozen passes
// over [rows, vocab] (each xor, shift and multiply its own op); here each value is made once in
// registers, in 32-bit unsigned arithmetic (which wraps as the int32 tensors' does), a loop the
// compiler vectorises. The float steps are the same exact ones: a 24-bit integer converted, 0.5
// added in float32 (rounding as torch's add does), a power of two multiplied. The logarithm
// stays torch's (`rng.exponentials`): a vectorised log here could differ in its last bit.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

namespace {

inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

at::Tensor hash_uniforms(const at::Tensor& keys, const at::Tensor& codes) {
  TORCH_CHECK(keys.dim() == 2 && keys.size(1) == 2 && keys.scalar_type() == at::kInt && keys.is_contiguous(),
              "hash_uniforms: keys must be contiguous [rows, 2] int32, got ", keys.sizes(), " ", keys.scalar_type());
  TORCH_CHECK(codes.dim() == 1 && codes.scalar_type() == at::kInt && codes.is_contiguous(),
              "hash_uniforms: codes must be contiguous [vocab_size] int32, got ", codes.sizes(), " ",
              codes.scalar_type());
  const int64_t rows = keys.size(0), vocab = codes.size(0);
  at::Tensor out = at::empty({rows, vocab}, keys.options().dtype(at::kFloat));
  const uint32_t* key = reinterpret_cast<const uint32_t*>(keys.data_ptr<int32_t>());
  const uint32_t* code = reinterpret_cast<const uint32_t*>(codes.data_ptr<int32_t>());
  float* dst = out.data_ptr<float>();
  const float scale = 1.0f / 16777216.0f;  // 2^-24
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint32_t k0 = key[2 * r], k1 = key[2 * r + 1];
      float* row = dst + r * vocab;
      for (int64_t v = 0; v < vocab; ++v) {
        const uint32_t x = mix32(mix32(code[v] ^ k0) ^ k1);
        const float bits = static_cast<float>(static_cast<int32_t>((x >> 8) & 0xFFFFFFu));
        row[v] = (bits + 0.5f) * scale;
      }
    }
  });
  return out;
}

}  // namespace

#ifndef PDSERVE_OP_NAMESPACE
#define PDSERVE_OP_NAMESPACE pdserve
#endif

TORCH_LIBRARY_FRAGMENT(PDSERVE_OP_NAMESPACE, m) {
  m.def("hash_uniforms(Tensor keys, Tensor codes) -> Tensor");
}

TORCH_LIBRARY_IMPL(PDSERVE_OP_NAMESPACE, CPU, m) {
  m.impl("hash_uniforms", &hash_uniforms);
}
