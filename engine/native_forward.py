"""The natives beside graph capture (`capture.py`): a model run by one call of an op of
`kernels/cpu/decoder.cpp` or `draft_passes.cpp` (their layers shared, `decoder.h`) instead of op by
op, where the native CPU ops allow it (projections packed, float32). `NativeForward` runs an engine
step of short chunks (`pdserve::decoder_forward`, used by `ModelRunner`); `NativePasses` runs a
draft's passes (`pdserve::draft_passes`, used by `draft_passes.DraftPasses`). `native_weights` lists a
model's tensors as both ops take them.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.engine.step_inputs import StepInputs


class _NativeModel:
    """A model's tensors as an op of `kernels/cpu/decoder.cpp` or `draft_passes.cpp` takes them
    (`native_weights`), with its caches flat, its rotary tables and its shape."""

    OP: str  # the op's name in torch.ops.pdserve
    WITH_HEAD: bool  # whether the op computes the logits (then it takes the lm_head)

    def __init__(self, model: torch.nn.Module, kv_caches: list, weights: list[torch.Tensor]):
        cfg = model.cfg
        self.weights = weights
        self.caches = [t for pair in kv_caches for t in pair]
        self.cos, self.sin = model.rope
        self.shape = (cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps, cfg.head_dim ** -0.5)

    @classmethod
    def of(cls, model: torch.nn.Module, kv_caches: list):
        """The model's native op, or None where it cannot run the model: the native library not
        loaded, a projection not packed (`cpu_linear`), or anything not float32 (but a 16-bit KV cache)."""
        weights = native_weights(model, kv_caches, cls.OP, with_head=cls.WITH_HEAD)
        return None if weights is None else cls(model, kv_caches, weights)


class NativePasses(_NativeModel):
    """A draft's passes as one call of `pdserve::draft_passes` (`kernels/cpu/draft_passes.cpp`): the
    whole forward and the pick of every pass in C++, the projections through `linear_packed` and
    the attention through `paged_attention_cpu`, called straight rather than op by op. The graph
    of a pass (`DraftPasses` compiled) spent most of a pass on fixed costs: on the demo draft at
    batch 1 its arithmetic is about 20 µs, the graph took about 115 µs (AMD EPYC, one thread).

    The same inputs and picks as `DraftPasses`' graphs: a greedy row takes the argmax, a sampled
    row (temperature only) races its softmax against the pass's noise. The sums run in another
    order than the model's ops (the norms, the softmax), so a pick may differ from the graph's
    where two logits nearly tie: a proposal only, which the target verifies."""

    OP, WITH_HEAD = "draft_passes", True

    def __call__(self, state: torch.Tensor, num_passes: int, temperature: torch.Tensor | None = None,
                 noise: torch.Tensor | None = None, catch_up: bool = False) -> torch.Tensor:
        """As `DraftPasses.__call__`: the picks [num_passes, num_seqs]."""
        heads, kv_heads, eps, scale = self.shape
        return torch.ops.pdserve.draft_passes(state, num_passes, catch_up, self.weights, self.caches, self.cos,
                                              self.sin, heads, kv_heads, eps, scale, temperature, noise)

    def with_logits(self, state: torch.Tensor, num_passes: int, temperature: torch.Tensor | None = None,
                    noise: torch.Tensor | None = None,
                    catch_up: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The picks, and the logits each pass picked from [num_passes, num_seqs, vocab_size]
        (`pdserve::draft_passes_logits`, built from the same source as `draft_passes`)."""
        heads, kv_heads, eps, scale = self.shape
        return torch.ops.pdserve.draft_passes_logits(state, num_passes, catch_up, self.weights, self.caches, self.cos,
                                                     self.sin, heads, kv_heads, eps, scale, temperature, noise)


def native_weights(model: torch.nn.Module, kv_caches: list, op: str, with_head: bool) -> list[torch.Tensor] | None:
    """The model's tensors as the ops of `kernels/cpu/decoder.cpp` and `draft_passes.cpp` take them:
    the embedding, the final norm's weight, with_head the lm_head (packed, a tied one copied and
    packed: a draft's is small) and its bias, then per layer the input norm, qkv, o, the
    post-attention norm, gate_up and down (each projection packed and its bias, an empty tensor for
    none). None where `op` cannot run the model: the native library not loaded, a projection not
    packed (`cpu_linear`), or anything not float32 (but a 16-bit KV cache)."""
    from pdserve.engine.model.llama import PackedLinear
    from pdserve.kernels import native

    if not native.loaded() or not hasattr(torch.ops.pdserve, op):
        return None
    inner = model.model
    if (kv_caches[0][0].dtype not in (torch.float32, torch.bfloat16, torch.float16)
            or inner.embed_tokens.weight.dtype != torch.float32):
        return None

    def linear(module) -> list[torch.Tensor]:
        bias = module.bias if module.bias is not None else torch.empty(0)
        return [module.packed, bias.float()]

    weights = [inner.embed_tokens.weight, inner.norm.weight]
    if with_head:
        head = model.lm_head
        weights += linear(head if isinstance(head, PackedLinear) else PackedLinear(head))
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not all(isinstance(m, PackedLinear) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)):
            return None
        weights += [layer.input_layernorm.weight, *linear(attn.qkv_proj), *linear(attn.o_proj),
                    layer.post_attention_layernorm.weight, *linear(mlp.gate_up_proj), *linear(mlp.down_proj)]
    return weights


class NativeForward(_NativeModel):
    """A step's forward as one call of `pdserve::decoder_forward` (`kernels/cpu/decoder.cpp`), for
    every step with a native attention plan (decode, a speculative verification, a draft's
    catch-up, prefill chunks of any length: `step_inputs.MAX_NATIVE_SCORES`): every layer in
    C++, the projections through `linear_packed` and the attention through `paged_attention_cpu`
    called straight, the norms, rotary and SwiGLU as loops over the rows.
    The same result as the model's forward up to float rounding (the norms sum in another order):
    greedy decoding stays token-identical to transformers in the tests, as with the compiled
    graph, whose own generated loops also sum in their own order. Why: through the compiled graph
    a batch-1 decode step of the demo target spent about a third of its time outside the
    projections and the attention, on the graph's call, its guards and 41 op dispatches; a prompt's
    prefill (64-128 tokens of code, batch 1, one thread, Intel Xeon, seven interleaved repeats of
    eight prompts) took 1.06-1.15x as long through the compiled graph (1.42-1.55x with default
    options and two threads; the draft's 1.12-1.25x, one thread)."""

    OP, WITH_HEAD = "decoder_forward", False

    def __init__(self, model: torch.nn.Module, kv_caches: list, weights: list[torch.Tensor]):
        super().__init__(model, kv_caches, weights)
        cfg, norm = model.cfg, model.model.norm
        # a streamed step's (`decoder_layer`): its workspace's floats a row, and the final norm
        self.scratch_per_row = torch.ops.pdserve.decoder_scratch_per_row(
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size)
        self.final_norm = lambda x: model.ops.rms_norm(x, norm.weight, norm.eps)  # noqa: E731

    @staticmethod
    def covers(step: StepInputs) -> bool:
        """Whether the step's attention is one native plan (what this forward runs)."""
        plan = step.meta.plan
        return plan is not None and plan.query_starts is not None

    def __call__(self, step: StepInputs, layer_callback: Callable[[int], None] | None = None) -> torch.Tensor:
        """The final norm's output [num_tokens, hidden_size], as the model's forward gives it.
        With layer_callback, layer by layer (`pdserve::decoder_layer`): callback(i) runs once
        layer i's K/V are in the cache, before layer i + 1 starts (a prefill worker's KV streaming)."""
        plan, (heads, kv_heads, eps, scale) = step.meta.plan, self.shape
        args = (step.meta.slot_mapping, plan.block_ids, plan.context_lens, plan.query_starts, self.weights,
                self.caches, self.cos, self.sin, heads, kv_heads, eps, scale)
        if layer_callback is None:
            return torch.ops.pdserve.decoder_forward(step.input_ids, step.positions, *args)
        residual = torch.nn.functional.embedding(step.input_ids, self.weights[0])
        workspace = residual.new_empty(len(residual) * self.scratch_per_row)  # every layer's, once
        for layer in range(len(self.caches) // 2):
            torch.ops.pdserve.decoder_layer(residual, workspace, step.positions, *args, layer)
            layer_callback(layer)
        return self.final_norm(residual)
