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

import numpy as np
import torch

from pdserve.engine.block_manager import cdiv
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.loader import build_model
from pdserve.engine.capture import CompiledForward
from pdserve.engine.draft_passes import DraftPasses
from pdserve.engine.huge_pages import zeros_on_huge_pages
from pdserve.engine.native_forward import NativeForward
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence
from pdserve.engine.step_inputs import MAX_GATHERED_QUERY_LEN, InputBuffers
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


# (num_layers, [num_blocks, block_size, num_kv_heads, head_dim], dtype, device) -> per layer (K, V),
# zero-filled; or None to decline (the runner then allocates as usual). A prefill worker passes
# one that places the cache in shared memory (serving/kv_transfer/shm.py).
KVAllocator = Callable[[int, tuple, torch.dtype, torch.device], "list[tuple[torch.Tensor, torch.Tensor]] | None"]


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


def num_kv_blocks(memory_bytes: int, max_num_seqs: int, max_model_len: int, block_size: int,
                  models: list[ModelConfig], dtype: torch.dtype) -> int:
    """KV blocks for the caches of `models` (target, then draft: a block holds a slot in each)
    in `memory_bytes`, never more than `max_num_seqs` sequences of `max_model_len` can use."""
    per_block = sum(kv_bytes_per_block(m, block_size, dtype) for m in models)
    useful = max_num_seqs * cdiv(max_model_len, block_size)
    return max(1, min(memory_bytes // per_block, useful))


class ModelRunner:
    def __init__(self, cfg: ModelConfig, model_dir: Path, ops: KernelOps, dtype: torch.dtype,
                 device: torch.device, num_blocks: int, block_size: int, capture: str = "off", max_batch: int = 64,
                 kv_allocator: KVAllocator | None = None, native_attention: bool = False,
                 native_linear: bool = False, max_tokens: int = 2048, kv_dtype: torch.dtype | None = None):
        """capture: "off", "compile" or "cuda_graphs" (`capture.py`), resolved by the caller;
        max_batch: the most sequences a step holds (CUDA graphs capture up to it);
        max_tokens: the most tokens a step holds (the scheduler's budget): the input buffers are
        sized for it at once, since growing them later moves the addresses CUDA graphs replay from;
        kv_allocator: where the KV cache lives when not in ordinary memory (see `KVAllocator`);
        native_attention: planned steps attend through `paged_attention_cpu` (`kernels/native.py`,
        loaded by the caller); native_linear: the projections run `linear_packed` (the same library);
        kv_dtype: the KV cache's dtype (None: `dtype`; `config.resolve_kv_dtype`)."""
        self.cfg, self.device, self.block_size = cfg, device, block_size
        self.model = build_model(cfg, model_dir, ops, dtype, device, packed_linears=native_linear)
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        cache_dtype = kv_dtype or dtype
        # zeros, not empty: padded attention rows read stale slots, which must be finite
        self.kv_caches = kv_allocator and kv_allocator(cfg.num_layers, shape, cache_dtype, device)
        if not self.kv_caches:
            # on the host, on 2 MiB pages where Linux gives them (`huge_pages.py`: the step reads
            # blocks all over the pool)
            zeros = ((lambda: zeros_on_huge_pages(shape, cache_dtype)) if device.type == "cpu"
                     else (lambda: torch.zeros(shape, dtype=cache_dtype, device=device)))
            self.kv_caches = [(zeros(), zeros()) for _ in range(cfg.num_layers)]
        max_blocks = -(-cfg.max_model_len // block_size)
        self.inputs = InputBuffers(block_size, max_blocks, device, plan_on_host=ops.name == "torch",
                                   uniform_plans=capture == "compile", native_plans=native_attention,
                                   group_size=cfg.num_heads // cfg.num_kv_heads)
        self.inputs.reserve(max_tokens, max_batch)
        # steps with a native attention plan in one native call where the ops allow (projections packed)
        self.native_forward = (NativeForward.of(self.model, self.kv_caches)
                               if native_attention and native_linear and device.type == "cpu" else None)
        # where the native forward takes every step (its plans take chunks of any length), a
        # compiled forward would never run: it is not built (3-6 s of start-up on the demo target)
        natives_take_all = (self.native_forward is not None and self.inputs.plan_on_host
                            and self.inputs.max_native_scores is None)
        self.capture = None if capture == "compile" and natives_take_all else self._build_capture(capture, max_batch, ops)
        self.last_pass: tuple[int, float] = (0, 0.0)  # (tokens, seconds) of the latest `execute`
        # a draft's passes run at once (`draft_passes`): the native attention's plans only; one
        # native call with the projections packed too (`native_forward.NativePasses`), else as graphs
        self.passes = (DraftPasses(self.model, self.kv_caches, block_size, compiled=capture == "compile",
                                   native=native_linear)
                       if native_attention and capture in ("off", "compile") else None)

    def _build_capture(self, kind: str, max_batch: int, ops: KernelOps):
        if kind == "off":
            return None
        if kind == "compile":
            capture = CompiledForward(self.model, self.kv_caches, prefill=self.device.type == "cpu" and ops.name == "torch")
        else:
            from pdserve.engine.cuda_graphs import CudaGraphForward  # CUDA only

            capture = CudaGraphForward(self.model, self.kv_caches, self.inputs, max_batch)
        with torch.inference_mode():
            if kind == "compile":
                step = self.inputs.build([_dummy_entry()])
                limit, self.inputs.max_native_scores = self.inputs.max_native_scores, 0  # to the prefill graph
                try:
                    prefill = self.inputs.build([_dummy_prefill(self.block_size)])
                finally:
                    self.inputs.max_native_scores = limit
                # the one-token step compiles the planned graph, which a step with a native plan
                # runs where there is no native forward (the projections not packed): skipped,
                # the first such chunk compiled it inside a request (471 ms at batch 1, scratch)
                capture.warm_up(step, prefill)
            else:
                capture.warm_up(self.inputs.build([_dummy_entry()]))
        return capture

    def row_blocks(self) -> tuple[Callable[[int], int], float] | None:
        """Where the projections work in 16-row blocks (bfloat16 panels on a CPU with AMX, from the
        fewest rows that take the tile unit: `kernels/cpu/linear.cpp`), the blocks a pass over n
        tokens multiplies in (0 below those rows) and a block's seconds over every projection of
        the model, timed now: 32 rows less 16 through each, the median of 9 rounds
        (some 30 ms on the demo target). For the adaptive depth's cost model
        (`spec_decode.costs.BatchCost`). None where they do not (float32 panels, no AMX, torch's
        linears, a GPU)."""
        from pdserve.engine.model.llama import PackedLinear

        linears = [m for m in self.model.modules() if isinstance(m, PackedLinear)]
        if (not linears or any(m.packed.dtype != torch.bfloat16 for m in linears)
                or not torch.ops.pdserve.linear_tile_rows(16)):
            return None
        gen = torch.Generator().manual_seed(0)  # not the process's random state
        rows = {m: torch.randn(32, m.in_features, generator=gen) for m in linears}

        @torch.inference_mode()
        def seconds(m_rows: int) -> float:
            start = time.perf_counter()
            for m in linears:
                m(rows[m][:m_rows])
            return time.perf_counter() - start

        seconds(32)
        rounds = [-seconds(16) + seconds(32) for _ in range(9)]
        block = max(sorted(rounds)[len(rounds) // 2], 0.0)
        return (lambda n: -(-n // 16) if torch.ops.pdserve.linear_tile_rows(n) else 0), block

    @torch.inference_mode()
    def execute(self, batch: list[BatchEntry], layer_callback: Callable[[int], None] | None = None) -> torch.Tensor:
        """Logits [sum(num_logits), vocab_size] float32, rows in the order of `batch`.
        `layer_callback(i)` runs once layer i's K/V for this batch are in the cache (KV streaming)."""
        start = time.perf_counter()
        step = self.inputs.build(batch)
        if self.native_forward is not None and self.native_forward.covers(step):
            hidden = self.native_forward(step, layer_callback)
        elif self.capture is not None and self.capture.covers(step, layer_callback is not None):
            hidden = self.capture(step)
        else:
            hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.meta, layer_callback)
        if step.logits_index is not None:
            hidden = hidden.index_select(0, step.logits_index)
        logits = self.model.compute_logits(hidden)
        self.last_pass = (len(step.input_ids), time.perf_counter() - start)
        return logits

    def can_draft_passes(self, seqs: list[Sequence], positions: list[int], num_passes: int) -> bool:
        """Whether `draft_passes` can run these passes: this runner has them (native attention),
        and every block table already reaches the last position."""
        return self.passes is not None and all(p + num_passes - 1 < len(s.block_table) * self.block_size
                                               for s, p in zip(seqs, positions))

    @torch.inference_mode()
    def draft_passes(self, seqs: list[Sequence], token_ids: list[int], positions: list[int], num_passes: int,
                     temperatures: list[float] | None = None, noise: torch.Tensor | None = None,
                     previous_ids: list[int] | None = None,
                     keep_logits: bool = False) -> list[list[int]] | tuple[list[list[int]], torch.Tensor] | None:
        """Each sequence's next num_passes tokens (`draft_passes.DraftPasses`): token_ids[i] at
        positions[i] goes in first, then each pick at the next position, their K/V written into
        the sequence's blocks. With previous_ids, the first pass is a catch-up: previous_ids[i]
        goes in at positions[i] - 1 beside token_ids[i]. Greedy picks, unless temperatures (0:
        greedy) and noise [num_passes, len(seqs), vocab_size] (each pass's Exp(1) draws) are
        given. None where `can_draft_passes` says no: the caller then runs passes one by one.
        keep_logits: also the logits each pass picked from, [num_passes, len(seqs), vocab_size]
        (the rejection sampler's q comes from them); None where the passes cannot keep them."""
        if not self.can_draft_passes(seqs, positions, num_passes):
            return None
        width = (max(positions) + num_passes - 1) // self.block_size + 1
        head = [token_ids, positions] if previous_ids is None else [previous_ids, token_ids, positions]
        state = passes_state(seqs, head, width)
        temperature = None
        if temperatures is not None:
            temperature = torch.tensor(temperatures, dtype=torch.float32, device=self.device)
        state = torch.from_numpy(state).to(self.device)
        if keep_logits:
            out = self.passes.with_logits(state, num_passes, temperature, noise, catch_up=previous_ids is not None)
            return None if out is None else (out[0].t().tolist(), out[1])
        return self.passes(state, num_passes, temperature, noise, catch_up=previous_ids is not None).t().tolist()

    def warm_up_draft_passes(self) -> None:
        """Compile every kind of pass now, on one dummy sequence in block 0, as the forward's
        warm-up does (a first sampled request would otherwise wait seconds for its graph)."""
        if self.passes is not None:
            noise = torch.ones(1, 1, self.cfg.vocab_size, device=self.device)  # made as the proposer makes it: outside
            with torch.inference_mode():                                        # inference mode (Dynamo guards on that)
                for state, catch_up in ((torch.zeros((1, 3), dtype=torch.int64, device=self.device), False),
                                        (torch.tensor([[0, 0, 1, 0]], device=self.device), True)):
                    self.passes(state, 1, catch_up=catch_up)
                    self.passes(state, 1, torch.ones(1, device=self.device), noise, catch_up=catch_up)


def passes_state(seqs: list[Sequence], head: list[list[int]], width: int) -> np.ndarray:
    """The state the native passes take (`pdserve::draft_passes`, `spec_step`): a row per
    sequence, the `head` columns (each a value per sequence), then its first `width` block ids."""
    state = np.zeros((len(seqs), len(head) + width), dtype=np.int64)
    for col, values in enumerate(head):
        state[:, col] = values
    for row, seq in zip(state, seqs):
        table = seq.block_table[:width]
        row[len(head):len(head) + len(table)] = table
    return state


def _dummy_prefill(block_size: int) -> BatchEntry:
    """A prefill chunk too long for a gather plan, in blocks 0 and 1, for warming the compiled
    prefill graph up: no sequence owns those blocks yet, and each writes its slots before reading."""
    n = MAX_GATHERED_QUERY_LEN + 1
    seq = Sequence("warm-up-prefill", [0] * n, SamplingParams(), seed=0, block_table=list(range(-(-n // block_size))))
    return BatchEntry(seq, n, 1, start=0)


def _dummy_entry() -> BatchEntry:
    """One token at position 0 in block 0, for warming captures up: its K/V land in slot 0,
    which every sequence writes before it reads."""
    seq = Sequence("warm-up", [0], SamplingParams(), seed=0, block_table=[0])
    return BatchEntry(seq, 1, 1, start=0)
