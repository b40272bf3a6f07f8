// The library's ops as plain C++ functions, for ops of the same library that call them straight
// (decoder.cpp): no dispatcher, no Python between them. Hidden from the library's exports, so a
// second build of a source beside the loaded library (a narrower instruction set, in a test or a
// benchmark) keeps its own.
#pragma once

#include <ATen/core/Tensor.h>

namespace pdserve_native {

// pdserve::linear_packed (linear.cpp): x [..., K] float32 times a packed [N, K] weight, plus bias.
__attribute__((visibility("hidden"))) at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& packed,
                                                               const c10::optional<at::Tensor>& bias, int64_t n);

// pdserve::paged_attention_cpu (paged_attention.cpp): the step's K/V written, then its attention.
__attribute__((visibility("hidden"))) at::Tensor paged_attention(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
    const at::Tensor& slot_mapping, const at::Tensor& block_ids, const at::Tensor& context_lens,
    const at::Tensor& query_starts, double scale);

}  // namespace pdserve_native
