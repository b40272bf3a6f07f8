"""CUDA graphs for decode steps, one per batch-size bucket (the `cuda_graphs` capture).

Only reached on CUDA, so CI never runs it; `benchmarks/gpu_check.py` does. On an H200
(2026-12-04, `BENCHMARKS.md`) a 1.24 B Llama decoded with identical greedy tokens with and
without, 5.4x faster at batch 1 and 4.1x at batch 32 (4.1x and 3.4x before the attention
kernel's changes of that day).

How it works, as in vLLM and SGLang:

- A decode-only step (one new token per sequence, no layer-by-layer K/V hook) of n sequences
  runs in the graph of the smallest bucket b >= n (1, 2, 4, 8, 16, 32, ... up to the largest
  batch the engine schedules).
- The graph reads its inputs from `InputBuffers`' device tensors, which never move (the step
  builder copies each step's inputs into them); rows n..b-1 are padding: token 0 at position 0,
  slot -1 (the K/V write skips it), context length 1 over block 0 (finite: the cache is zeroed at
  allocation). The padded rows' outputs are dropped.
- Block tables are read at their full width (max_model_len / block_size), so the attention
  kernel's launch (grid, split-K choice) is the same for every step of a bucket. Eager decode
  steps on CUDA read them at full width too (`InputBuffers`), and the split-K choice counts a
  batch as its next power of two, so an eager step splits as its bucket's replay does and
  computes the same bits (when the two split differently, batch-1 greedy tokens of a random
  bf16 model differed between them on the H200).
- Graphs are captured at start-up, largest bucket first, into one shared memory pool, after an
  eager run of the same bucket (Triton compiles its kernels on first launch, which a capture
  must not see).
- If the input buffers ever grow (a batch larger than they were sized for), the graphs'
  addresses are stale: those steps and every later one run eagerly.

Same model code, same kernels, same inputs: a replay computes what the eager step computes.
"""
from __future__ import annotations

import logging
import time

import torch

from pdserve.engine.model.llama import AttentionMetadata
from pdserve.engine.step_inputs import InputBuffers, StepInputs

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def bucket_sizes(max_batch: int) -> list[int]:
    """The buckets up to `max_batch`, which is always one."""
    sizes = [b for b in BUCKETS if b < max_batch]
    return sizes + [max_batch]


class CudaGraphForward:
    def __init__(self, model: torch.nn.Module, kv_caches: list, inputs: InputBuffers, max_batch: int):
        self.model, self.kv_caches, self.inputs = model, kv_caches, inputs
        self.buckets = bucket_sizes(max_batch)
        inputs.reserve(self.buckets[-1], self.buckets[-1])  # sized once: captured addresses never move
        self._generation = inputs.generation
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.compile_seconds = 0.0  # capture time, reported like a compile

    def covers(self, step: StepInputs, has_layer_callback: bool) -> bool:
        n = step.input_ids.shape[0]
        if self.inputs.generation != self._generation and self._graphs:
            log.warning("a step outgrew the input buffers the CUDA graphs were captured on (sized for the "
                        "scheduler's token budget); decode steps run eagerly from now on")
            self._graphs.clear()
        return (not has_layer_callback and step.meta.num_decode_tokens == n and n <= self.buckets[-1]
                and bool(self._graphs))

    def __call__(self, step: StepInputs) -> torch.Tensor:  # [num_tokens, hidden_size]
        n = step.input_ids.shape[0]
        bucket = next(b for b in self.buckets if b >= n)
        self._pad(n, bucket)
        graph, hidden = self._graphs[bucket]
        graph.replay()
        return hidden[:n]

    def warm_up(self, step: StepInputs | None = None) -> None:
        """Capture every bucket (the step argument, for the other captures' sake, is unused)."""
        assert self.inputs.device.type == "cuda", "CUDA graphs need a CUDA device"
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.buckets):
            self._pad(0, bucket)
            args = self.static_args(bucket)
            self.model(*args)  # eager first: Triton compiles here, not inside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.model(*args)
            self._graphs[bucket] = (graph, hidden)
        torch.cuda.synchronize()
        self.compile_seconds = time.perf_counter() - start
        log.info("captured %d CUDA graphs (batch sizes %s) in %.1f s", len(self._graphs), self.buckets,
                 self.compile_seconds)

    def static_args(self, bucket: int) -> tuple:
        """The model's arguments for a bucket: views of the fixed device buffers, block tables at
        full width."""
        dev = self.inputs.dev
        meta = AttentionMetadata(
            slot_mapping=dev["slot_mapping"][:bucket], num_decode_tokens=bucket,
            decode_block_tables=dev["block_tables"][:bucket], decode_context_lens=dev["context_lens"][:bucket],
            extend_block_tables=dev["block_tables"][:0], extend_cu_seqlens_q=dev["cu_seqlens_q"][:1],
            extend_context_lens=dev["context_lens"][:0],
        )
        return dev["input_ids"][:bucket], dev["positions"][:bucket], self.kv_caches, meta

    def _pad(self, n: int, bucket: int) -> None:
        """Rows n..bucket-1 of the device inputs: harmless padding."""
        if n == bucket:
            return
        dev = self.inputs.dev
        dev["input_ids"][n:bucket].zero_()
        dev["positions"][n:bucket].zero_()
        dev["slot_mapping"][n:bucket].fill_(-1)
        dev["context_lens"][n:bucket].fill_(1)
        dev["block_tables"][n:bucket].zero_()
