// The library's ops as plain C++ functions, for ops of the same library that call them straight
// (decoder.h's layers, draft_passes.cpp's lm_head): no dispatcher, no Python between them. Hidden
// from the library's exports, so a second build of a source beside the loaded library (a narrower
// instruction set, in a test or a benchmark) keeps its own.
#pragma once

#include <ATen/core/Tensor.h>

namespace pdserve_native {

// pdserve::linear_packed (linear.cpp): x [..., K] float32 times a packed [N, K] weight, plus bias.
__attribute__((visibility("hidden"))) at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& packed,
                                                               const c10::optional<at::Tensor>& bias, int64_t n);

// linear_packed's loops on raw pointers: x [rows, K] and y [rows, n] contiguous float32, bias [n] or
// null, packed as check_packed accepts it (no tensor is made per call: for callers holding buffers).
__attribute__((visibility("hidden"))) void linear_rows(const float* x, int64_t rows, const at::Tensor& packed,
                                                       const float* bias, int64_t n, float* y);

// Refuses, with the reason in op's name, a packed weight that is not n output features of
// linear_pack's layout, or a bias (undefined: none) that is not contiguous float32 [n].
__attribute__((visibility("hidden"))) void check_packed(const char* op, const at::Tensor& packed,
                                                        const at::Tensor& bias, int64_t n);

// pdserve::paged_attention_cpu (paged_attention.cpp): the step's K/V written, then its attention.
__attribute__((visibility("hidden"))) at::Tensor paged_attention(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
    const at::Tensor& slot_mapping, const at::Tensor& block_ids, const at::Tensor& context_lens,
    const at::Tensor& query_starts, double scale);

// The rejection sampler's rule (rejection.cpp, pdserve::rejection_rows, which checks what it is
// given): S sequences' acceptance tests and last tokens. probs [sum(depths) + S, vocab] and
// draft_probs [sum(depths), vocab] contiguous float32, codes `rng._vocab_codes` int32 [vocab];
// accepted and last [S] are written.
__attribute__((visibility("hidden"))) void rejection_rule(const at::Tensor& probs, const at::Tensor& draft_probs,
                                                          const int64_t* drafts, const int64_t* depths,
                                                          const int64_t* seeds, const int64_t* positions,
                                                          const float* temperature, int64_t num_seqs,
                                                          const at::Tensor& codes, int64_t* accepted, int64_t* last);

}  // namespace pdserve_native
