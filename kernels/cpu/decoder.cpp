// pdserve::decoder_forward: a Llama model's layers (decoder.h) for one engine step (decode, a
// speculative verification, a prefill chunk), returning the final norm's output; for the target,
// whose step through a compiled graph spent about a third of a batch-1 decode step on op dispatch
// and the graph's own calls, and took 1.06-1.15x as long over a 64-128-token prompt's prefill.
// pdserve::decoder_layer: one of those layers, for a step that streams each layer's K/V as it lands.
// A draft's passes run the same layers in draft_passes.cpp.
#include <torch/library.h>

#include "decoder.h"  // Decoder, Scratch

namespace {

// The step's positions [T] int64, checked against the rotary table, with slot_mapping's shape.
at::Tensor checked_positions(const char* op, const Decoder& d, const at::Tensor& positions,
                             const at::Tensor& slot_mapping, int64_t rows) {
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == rows && positions.scalar_type() == at::kLong &&
                  slot_mapping.sizes() == positions.sizes(),
              op, ": positions and slot_mapping must be int64 [", rows, "] (one per row), got ", positions.sizes(),
              " and ", slot_mapping.sizes());
  const at::Tensor pos = positions.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(pp[r] >= 0 && pp[r] < d.max_position, op, ": position ", pp[r], " is outside the rotary table");
  return pos;
}

// pdserve::decoder_forward: one step's forward (decode, a speculative verification, a draft's
// catch-up, prefill chunks), every layer in C++, for the engine's ModelRunner: the final
// norm's output [tokens, hidden], the lm_head left to the caller (it scores only the rows it
// samples). input_ids and positions [T] int64; slot_mapping, block_ids, context_lens and
// query_starts as paged_attention_cpu takes them; weights: the embedding, the final norm, then
// kWeightsPerLayer per layer.
at::Tensor decoder_forward(const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& slot_mapping,
                           const at::Tensor& block_ids, const at::Tensor& context_lens, const at::Tensor& query_starts,
                           at::TensorList weights, at::TensorList kv_caches, const at::Tensor& cos,
                           const at::Tensor& sin, int64_t num_heads, int64_t num_kv_heads, double eps, double scale) {
  const Decoder d("decoder_forward", 2, weights, kv_caches, cos, sin, num_heads, num_kv_heads, eps, scale);
  TORCH_CHECK(input_ids.dim() == 1 && input_ids.scalar_type() == at::kLong,
              "decoder_forward: input_ids must be int64 [tokens], got ", input_ids.sizes());
  const int64_t rows = input_ids.size(0), hidden = d.hidden;
  const at::Tensor pos = checked_positions("decoder_forward", d, positions, slot_mapping, rows);
  const auto f32 = weights[0].options();
  const at::Tensor ids = input_ids.contiguous();
  const int64_t* idp = ids.data_ptr<int64_t>();
  const at::Tensor res = at::empty({rows, hidden}, f32);
  const Scratch scratch = d.scratch(rows, f32);
  d.forward("decoder_forward", idp, rows, res.data_ptr<float>(), pos.data_ptr<int64_t>(), slot_mapping, block_ids,
            context_lens, query_starts, scratch);
  return scratch.normed;  // the call's own buffer: the layers are done with it
}

// pdserve::decoder_layer: decoder_forward's layer `layer` alone, on the rows' residual streams
// `residual` [T, hidden] float32 (the embeddings before layer 0), updated in place, the layer's K/V
// written into its cache; `workspace`: float32, at least T times `decoder_scratch_per_row` floats,
// the layer's scratch (the caller's for every layer of a step: a 512-token prefill through eight
// calls that each allocated their own took 1.01-1.08x the time of one decoder_forward, with one
// workspace 0.98-1.04x; scratch A/B, ten interleaved repeats, one thread). For a step that hands
// each layer's K/V on as it lands (a prefill worker's, `native_forward.NativeForward` with a layer
// callback): the caller embeds, calls each layer in turn, and applies the final norm.
void decoder_layer(at::Tensor& residual, at::Tensor& workspace, const at::Tensor& positions,
                   const at::Tensor& slot_mapping, const at::Tensor& block_ids, const at::Tensor& context_lens,
                   const at::Tensor& query_starts, at::TensorList weights, at::TensorList kv_caches,
                   const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads, int64_t num_kv_heads, double eps,
                   double scale, int64_t layer) {
  const Decoder d("decoder_layer", 2, weights, kv_caches, cos, sin, num_heads, num_kv_heads, eps, scale);
  TORCH_CHECK(layer >= 0 && layer < d.num_layers, "decoder_layer: layer ", layer, " of a model of ", d.num_layers);
  TORCH_CHECK(residual.dim() == 2 && residual.size(1) == d.hidden && residual.scalar_type() == at::kFloat &&
                  residual.is_contiguous(),
              "decoder_layer: residual must be a contiguous float32 [tokens, ", d.hidden, "], got ", residual.sizes());
  const int64_t rows = residual.size(0);
  TORCH_CHECK(workspace.dim() == 1 && workspace.scalar_type() == at::kFloat && workspace.is_contiguous() &&
                  workspace.numel() >= rows * d.scratch_per_row(),
              "decoder_layer: workspace must be a contiguous float32 [>= ", rows * d.scratch_per_row(), "], got ",
              workspace.sizes());
  const at::Tensor pos = checked_positions("decoder_layer", d, positions, slot_mapping, rows);
  d.layers(residual.data_ptr<float>(), rows, pos.data_ptr<int64_t>(), slot_mapping, block_ids, context_lens,
           query_starts, d.scratch(rows, workspace), layer, layer + 1);
}

}  // namespace

#ifndef PDSERVE_OP_NAMESPACE
#define PDSERVE_OP_NAMESPACE pdserve
#endif

TORCH_LIBRARY_FRAGMENT(PDSERVE_OP_NAMESPACE, m) {
  m.def("decoder_forward(Tensor input_ids, Tensor positions, Tensor slot_mapping, Tensor block_ids, "
        "Tensor context_lens, Tensor query_starts, Tensor[] weights, Tensor(a!)[] kv_caches, Tensor cos, Tensor sin, "
        "int num_heads, int num_kv_heads, float eps, float scale) -> Tensor");
  m.def("decoder_layer(Tensor(a!) residual, Tensor(c!) workspace, Tensor positions, Tensor slot_mapping, "
        "Tensor block_ids, Tensor context_lens, Tensor query_starts, Tensor[] weights, Tensor(b!)[] kv_caches, "
        "Tensor cos, Tensor sin, int num_heads, int num_kv_heads, float eps, float scale, int layer) -> ()");
  m.def("decoder_scratch_per_row(int hidden, int num_heads, int num_kv_heads, int head_dim, int intermediate) -> int",
        &decoder_scratch_per_row);
}

TORCH_LIBRARY_IMPL(PDSERVE_OP_NAMESPACE, CPU, m) {
  m.impl("decoder_forward", &decoder_forward);
  m.impl("decoder_layer", &decoder_layer);
}
