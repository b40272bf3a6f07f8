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
//
// pdserve::hash_rows: the same uniforms with each row's key made here too, from (seed, position,
// stream) as `engine/rng.py`'s `row_key` makes it (two splitmix64 rounds on 64-bit words, which
// wrap as Python's masked arithmetic does): the key loop in Python and the tensor built from it
// cost as much as the hash of 40 rows of the demo's 4096 entries (about 45 µs against 65).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

#include "noise.h"  // row_key, hash_row

namespace {

void check_codes(const char* op, const at::Tensor& codes) {
  TORCH_CHECK(codes.dim() == 1 && codes.scalar_type() == at::kInt && codes.is_contiguous(), op,
              ": codes must be contiguous [vocab_size] int32, got ", codes.sizes(), " ", codes.scalar_type());
}

at::Tensor hash_uniforms(const at::Tensor& keys, const at::Tensor& codes) {
  TORCH_CHECK(keys.dim() == 2 && keys.size(1) == 2 && keys.scalar_type() == at::kInt && keys.is_contiguous(),
              "hash_uniforms: keys must be contiguous [rows, 2] int32, got ", keys.sizes(), " ", keys.scalar_type());
  check_codes("hash_uniforms", codes);
  const int64_t rows = keys.size(0), vocab = codes.size(0);
  at::Tensor out = at::empty({rows, vocab}, keys.options().dtype(at::kFloat));
  const uint32_t* key = reinterpret_cast<const uint32_t*>(keys.data_ptr<int32_t>());
  const uint32_t* code = reinterpret_cast<const uint32_t*>(codes.data_ptr<int32_t>());
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      hash_row(key[2 * r], key[2 * r + 1], code, dst + r * vocab, vocab);
  });
  return out;
}

// rows [n, 3] int64: each row's seed (its 64 bits), position and stream, as `rng.row_key` takes them
at::Tensor hash_rows(const at::Tensor& rows_t, const at::Tensor& codes) {
  TORCH_CHECK(rows_t.dim() == 2 && rows_t.size(1) == 3 && rows_t.scalar_type() == at::kLong && rows_t.is_contiguous(),
              "hash_rows: rows must be contiguous [rows, 3] int64 (seed, position, stream), got ", rows_t.sizes(), " ",
              rows_t.scalar_type());
  check_codes("hash_rows", codes);
  const int64_t rows = rows_t.size(0), vocab = codes.size(0);
  const uint64_t* spec = reinterpret_cast<const uint64_t*>(rows_t.data_ptr<int64_t>());
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(static_cast<int64_t>(spec[3 * r + 1]) >= 0 && static_cast<int64_t>(spec[3 * r + 2]) >= 0,
                "hash_rows: row ", r, " has a negative position or stream");
  at::Tensor out = at::empty({rows, vocab}, codes.options().dtype(at::kFloat));
  const uint32_t* code = reinterpret_cast<const uint32_t*>(codes.data_ptr<int32_t>());
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint64_t key = row_key(spec[3 * r], spec[3 * r + 1], spec[3 * r + 2]);
      hash_row(static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32), code, dst + r * vocab, vocab);
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
  m.def("hash_rows(Tensor rows, Tensor codes) -> Tensor");
}

TORCH_LIBRARY_IMPL(PDSERVE_OP_NAMESPACE, CPU, m) {
  m.impl("hash_uniforms", &hash_uniforms);
  m.impl("hash_rows", &hash_rows);
}
