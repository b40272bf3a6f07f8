"""`ModelRunner`: owns the model weights and the KV cache tensors, and runs one step.

It turns a list of (sequence, new tokens, rows to score) into one flat batch — decode tokens
first, then prefill/verify chunks — with positions, slot mapping and block tables, runs the
model, and returns logits only for the rows the caller samples from.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.llama import AttentionMetadata
from pdserve.engine.model.loader import build_model
from pdserve.engine.sequence import Sequence
from pdserve.kernels import KernelOps


@dataclass(slots=True)
class BatchEntry:
    """Run tokens [start, start + num_new_tokens) of seq.token_ids + extra_token_ids, writing
    their K/V by the sequence's block table, and score the last `num_logits` of them."""

    seq: Sequence
    num_new_tokens: int
    num_logits: int  # 0: a prefill chunk that samples nothing
    start: int = -1  # -1: seq.num_computed_tokens
    extra_token_ids: list[int] = field(default_factory=list)  # draft tokens, not yet in seq

    def __post_init__(self) -> None:
        if self.start < 0:
            self.start = self.seq.num_computed_tokens


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


class ModelRunner:
    def __init__(self, cfg: ModelConfig, model_dir: Path, ops: KernelOps, dtype: torch.dtype,
                 device: torch.device, num_blocks: int, block_size: int):
        self.cfg, self.device, self.block_size = cfg, device, block_size
        self.model = build_model(cfg, model_dir, ops, dtype, device)
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        # zeros, not empty: padded attention rows read stale slots, which must be finite
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_layers)
        ]
        self.last_pass: tuple[int, float] = (0, 0.0)  # (tokens, seconds) of the latest `execute`

    @torch.inference_mode()
    def execute(self, batch: list[BatchEntry], layer_callback: Callable[[int], None] | None = None) -> torch.Tensor:
        """Logits [sum(num_logits), vocab_size] float32, rows in the order of `batch`.
        `layer_callback(i)` runs once layer i's K/V for this batch are in the cache (KV streaming)."""
        start = time.perf_counter()
        order = sorted(range(len(batch)), key=lambda i: batch[i].num_new_tokens != 1)  # decodes first
        input_ids, positions, meta, row_starts = self._prepare([batch[i] for i in order])
        hidden = self.model(input_ids, positions, self.kv_caches, meta, layer_callback)
        rows = []
        for i in range(len(batch)):  # back to the caller's order
            j = order.index(i)
            end = row_starts[j] + batch[i].num_new_tokens
            rows.extend(range(end - batch[i].num_logits, end))
        if rows:
            logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        else:
            logits = hidden.new_empty((0, self.cfg.vocab_size), dtype=torch.float32)
        self.last_pass = (len(input_ids), time.perf_counter() - start)
        return logits

    def _prepare(self, batch: list[BatchEntry]):
        ids, pos, slots, starts = [], [], [], []
        bs = self.block_size
        for e in batch:
            start = e.start
            starts.append(len(ids))
            ids.extend((e.seq.token_ids + e.extra_token_ids)[start:start + e.num_new_tokens])
            table = e.seq.block_table
            for p in range(start, start + e.num_new_tokens):
                pos.append(p)
                slots.append(table[p // bs] * bs + p % bs)
        nd = sum(1 for e in batch if e.num_new_tokens == 1)
        dev = self.device
        context_lens = [e.start + e.num_new_tokens for e in batch]
        tables = _pad_tables([e.seq.block_table for e in batch], dev)
        cu = [0]
        for e in batch[nd:]:
            cu.append(cu[-1] + e.num_new_tokens)
        lens = torch.tensor(context_lens, dtype=torch.int32, device=dev)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            num_decode_tokens=nd,
            decode_block_tables=tables[:nd], decode_context_lens=lens[:nd],
            extend_block_tables=tables[nd:], extend_cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            extend_context_lens=lens[nd:],
        )
        return (torch.tensor(ids, dtype=torch.int64, device=dev), torch.tensor(pos, dtype=torch.int64, device=dev),
                meta, starts)


def _pad_tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max((len(t) for t in tables), default=0) or 1
    padded = [t + [0] * (width - len(t)) for t in tables]
    return torch.tensor(padded, dtype=torch.int32, device=device)
