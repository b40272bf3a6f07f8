"""The Llama-family decoder (Llama 2/3, Qwen2, Mistral) over a paged KV cache.

It runs one flat batch of tokens from many sequences (prefill chunks and decode tokens mixed),
with every op taken from one `KernelOps` chosen at construction. Parameter names follow the
Hugging Face checkpoints, except that q/k/v and gate/up are stored fused (`loader.py` splits).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.model.config import ModelConfig
from pdserve.kernels import KernelOps, build_rope_cache
from pdserve.kernels.gathered_attention import GatherPlan, gathered_attention
from pdserve.kernels.rotary import rope_at


@dataclass(slots=True)
class AttentionMetadata:
    """Where a step's tokens go in the cache and what they attend to.

    The batch is ordered decode tokens first (one per sequence, `paged_decode_attention`), then
    the query chunks of the other sequences (`extend_attention`).
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [num_decode_seqs, max_blocks] int32
    decode_context_lens: torch.Tensor  # [num_decode_seqs] int32
    extend_block_tables: torch.Tensor  # [num_extend_seqs, max_blocks] int32
    extend_cu_seqlens_q: torch.Tensor  # [num_extend_seqs + 1] int32
    extend_context_lens: torch.Tensor  # [num_extend_seqs] int32
    # CPU: every token's attention as one dense call per layer, planned once per step (set when
    # every chunk is short); the decode/extend ops otherwise
    plan: GatherPlan | None = None


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: KernelOps):
        super().__init__()
        self.ops = ops
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.split = (q_size, kv_size, kv_size)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x, rope, kv_cache, meta: AttentionMetadata):
        num_tokens = x.shape[0]
        # [num_tokens, q heads | k heads | v heads, head_dim]: q and k rotate in one call
        qkv = self.qkv_proj(x).view(num_tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k = self.ops.apply_rotary(qkv[:, :self.num_heads + self.num_kv_heads], *rope).split(
            (self.num_heads, self.num_kv_heads), dim=1)
        v = qkv[:, self.num_heads + self.num_kv_heads:]
        k_cache, v_cache, p = *kv_cache, meta.plan
        if p is not None and p.query_starts is not None:  # the native op, eager or traced (kernels/native.py)
            out = torch.ops.pdserve.paged_attention_cpu(q, k, v, k_cache, v_cache, meta.slot_mapping, p.block_ids,
                                                        p.context_lens, p.query_starts, self.scale)
        elif torch.compiler.is_compiling():  # one opaque op for the tracer
            out = (torch.ops.pdserve.write_and_attend(q, k, v, k_cache, v_cache, meta.slot_mapping, p.block_ids,
                                                      p.mask, p.pad_index, p.unpad_index, p.groups_tensor, self.scale)
                   if p is not None else
                   torch.ops.pdserve.write_and_split_attend(
                       q, k, v, k_cache, v_cache, meta.slot_mapping, meta.decode_block_tables,
                       meta.decode_context_lens, meta.extend_block_tables, meta.extend_cu_seqlens_q,
                       meta.extend_context_lens, self.scale))
        else:
            self.ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            out = (gathered_attention(q, k_cache, v_cache, p, self.scale) if p is not None
                   else self._split_attention(q, k_cache, v_cache, meta))
        return self.o_proj(out.reshape(num_tokens, -1))

    def _split_attention(self, q, k_cache, v_cache, meta: AttentionMetadata):
        """Decode tokens through paged decode attention, the rest through extend attention."""
        nd, num_tokens = meta.num_decode_tokens, q.shape[0]
        if nd == num_tokens:
            return self.ops.paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables,
                                                   meta.decode_context_lens, self.scale)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self.ops.paged_decode_attention(
                q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, self.scale)
        out[nd:] = self.ops.extend_attention(
            q[nd:], k_cache, v_cache, meta.extend_block_tables, meta.extend_cu_seqlens_q,
            meta.extend_context_lens, self.scale)
        return out


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class PackedLinear(nn.Module):
    """A float32 `nn.Linear` on the CPU whose weight is packed into column panels once, at load
    (`kernels/cpu/linear.cpp`); it runs `pdserve::linear_packed`. Made from a loaded `nn.Linear`
    by `loader.py` when the engine asks for it; only the packed copy is kept.

    A weight whose every value is a bfloat16 (a bfloat16 checkpoint, as the demo pair and most
    published ones are, computed in float32) is packed in bfloat16: the same numbers at half the
    bytes, and the same results bit for bit on the vector loops. A decode step reads every weight
    once, so it runs at the memory's speed, and half the bytes take about half the time
    (BENCHMARKS.md). On a CPU with AMX, 7 rows and more of such a weight run on the tile unit,
    exact products summed in another order (`kernels/cpu/linear_amx.h`), from a second copy of
    the weight in the tile unit's order that the packing keeps (so the buffer's storage holds the
    weight's bytes twice)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        half = weight.to(torch.bfloat16)
        if torch.equal(half.float(), weight):  # exactly representable: nothing is lost
            weight = half
        self.register_buffer("packed", torch.ops.pdserve.linear_pack(weight), persistent=False)
        self.bias = linear.bias

    def forward(self, x):
        return torch.ops.pdserve.linear_packed(x, self.packed, self.bias, self.out_features)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: KernelOps):
        super().__init__()
        self.ops = ops
        self.self_attn = Attention(cfg, ops)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, rope, kv_cache, meta):
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        if residual is None:
            residual, x = x, self.ops.rms_norm(x, ln1.weight, ln1.eps)
        else:
            x, residual = self.ops.fused_add_rms_norm(x, residual, ln1.weight, ln1.eps)
        x = self.self_attn(x, rope, kv_cache, meta)
        x, residual = self.ops.fused_add_rms_norm(x, residual, ln2.weight, ln2.eps)
        return self.mlp(x), residual


class _Embedding(nn.Embedding):
    """An `nn.Embedding` that leaves its weight uninitialized: the checkpoint fills it. Its
    random initialization on the meta device, where the model is built, imports
    `torch._dynamo` (`normal_` runs through a reference implementation that does): 3.0 s of a
    3.2 s load of the tiny test model, on every worker's start and restart."""

    def reset_parameters(self) -> None:
        pass


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: KernelOps):
        super().__init__()
        self.embed_tokens = _Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, ops) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """`forward` gives final hidden states for every token; `compute_logits` only for the rows
    that are sampled (the last token of each sequence, or every verified position)."""

    def __init__(self, cfg: ModelConfig, ops: KernelOps):
        super().__init__()
        self.cfg, self.ops = cfg, ops
        self.model = DecoderModel(cfg, ops)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_rope(self, max_position: int, device: torch.device) -> None:
        cos, sin = build_rope_cache(self.cfg.head_dim, max_position, self.cfg.rope_theta, self.cfg.rope_scaling_dict)
        self.rope = (cos.to(device), sin.to(device))

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        layer_callback: Callable[[int], None] | None = None,  # called with i once layer i is done
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        x, residual = self.model.embed_tokens(input_ids), None
        rope = rope_at(*self.rope, positions, x.dtype)  # this step's rows, for every layer
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            x, residual = layer(x, residual, rope, kv_cache, meta)
            if layer_callback is not None:
                layer_callback(i)
        norm = self.model.norm
        x, _ = self.ops.fused_add_rms_norm(x, residual, norm.weight, norm.eps)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, vocab_size] float32
        return self.lm_head(hidden).float()
