"""`InputBuffers`: a step's model inputs, written into buffers allocated once and reused.

Every step needs token ids, positions, the slot mapping, block tables, context lengths and the
rows to score. Building them as fresh tensors from Python lists costs a dozen allocations and
list conversions per step, which at batch 1 on a CPU is a visible share of a step. Here they
are written through numpy views into host tensors that live as long as the runner (grown, never
shrunk, when a batch outgrows them), and the step's tensors are slices of those.

On CUDA the host buffers are pinned and copied to device buffers of the same size, which stay
at fixed addresses: what CUDA graphs replay from (`cuda_graphs.py`).

The flat batch is ordered as the model wants it: decode tokens first (one per sequence), then
the other sequences' chunks, each kind by context length; `logits_index` lists, in the caller's
order, the rows to score.
On the CPU, when every chunk is short (decode, speculative verification, a draft catching up),
the whole batch's attention runs as one dense call per layer by a `GatherPlan` made here once;
with the native attention, so do prefill chunks of any length (MAX_NATIVE_SCORES).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.model.llama import AttentionMetadata
from pdserve.kernels.gathered_attention import GatherPlan, plan_gather

MAX_GATHERED_QUERY_LEN = 16  # longer chunks (prefill) run per sequence, in `extend_attention`
# A native plan (`paged_attention_cpu`) takes longer chunks too, of any length: the op splits a
# chunk of more than 16 queries by KV head and into tiles of queries whose scores stay near the
# core's cache. Skipping what the causal mask hides, it beat the per-sequence SDPA path at every
# prompt length tried (demo target's heads, 8 on 4 KV heads of 32, and 16 on 4 of 128; AMD EPYC,
# one thread, write included in both; scratch timing): 2.3x at a 512-token prompt, 1.5x at 2048,
# 2.5x at a 2048-token chunk after 2048 cached (1.9x, 1.2x, 1.4x at head_dim 128). Before the
# tiles (an item's scores whole: heads per KV head x queries x context), it lost from about 1536
# tokens on (0.55x at 2048), and this module sent chunks past 2^21 scores to SDPA. None: no bound
# (0 while a compiled forward warms its prefill graph up).
MAX_NATIVE_SCORES: int | None = None
SHORT_CHUNK = 16  # chunks up to this many tokens are written into the step's buffers token by token

_INT64 = ("input_ids", "positions", "slot_mapping", "logits_index")  # per token
_INT32 = ("context_lens", "cu_seqlens_q")  # per sequence (+1)
# a native plan's, on the host (`_native_plan`): the block tables and context lengths as int64,
# and where each sequence's queries start
_NATIVE = ("native_block_ids", "native_context_lens", "native_query_starts")


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    logits_index: torch.Tensor | None  # [num_logits] int64 rows of the hidden states; None: every row, in order
    order: list[int]  # batch index of each sequence in the flat batch


class InputBuffers:
    def __init__(self, block_size: int, max_blocks_per_seq: int, device: torch.device, plan_on_host: bool,
                 uniform_plans: bool = False, native_plans: bool = False, group_size: int = 1,
                 full_width_decode_tables: bool | None = None):
        self.block_size, self.max_blocks, self.device = block_size, max_blocks_per_seq, device
        # decode block tables at their full width (default: on CUDA), as the CUDA graphs read them:
        # the decode kernel's split-K choice reads the width, so eager steps then split as replays do
        self.full_width_decode_tables = (device.type == "cuda" if full_width_decode_tables is None
                                         else full_width_decode_tables)
        self.plan_on_host = plan_on_host  # CPU torch path: attention by `GatherPlan`
        self.uniform_plans = uniform_plans  # every plan tensor present, for a compiled forward
        self.native_plans = native_plans  # plans for `paged_attention_cpu` (kernels/native.py)
        # chunks past MAX_GATHERED_QUERY_LEN take a native plan while group_size (heads per KV head)
        # x queries x context is within this (None: any chunk; 0 while a compiled forward warms
        # its prefill graph up on a short chunk)
        self.max_native_scores, self.group_size = MAX_NATIVE_SCORES, group_size
        self._num_tokens = self._num_seqs = 0
        self.generation = 0  # bumped whenever the buffers are reallocated (CUDA graphs hold their addresses)
        # CUDA: recorded after each build's copies, so the next build waits until they have read the host buffers
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self._grow(256, 16)

    def reserve(self, num_tokens: int, num_seqs: int) -> None:
        """Room for batches of this many tokens and sequences without reallocating."""
        if num_tokens > self._num_tokens or num_seqs > self._num_seqs:
            self._grow(num_tokens, num_seqs)

    @torch.inference_mode(False)
    def _grow(self, num_tokens: int, num_seqs: int) -> None:
        """Ordinary tensors, even when a step outgrows the buffers under inference mode: a compiled
        forward guards on the kind, and would otherwise compile again mid-request."""
        self.generation += 1
        self._num_tokens, self._num_seqs = max(num_tokens, self._num_tokens), max(num_seqs, self._num_seqs)
        pin = self.device.type == "cuda"
        shapes = {**{n: ((self._num_tokens,), torch.int64) for n in _INT64},
                  "context_lens": ((self._num_seqs,), torch.int32), "cu_seqlens_q": ((self._num_seqs + 1,), torch.int32),
                  "block_tables": ((self._num_seqs, self.max_blocks), torch.int32)}
        if self.native_plans:
            shapes |= dict(zip(_NATIVE, (((self._num_seqs * self.max_blocks,), torch.int64),  # viewed [seqs, width]
                                         ((self._num_seqs,), torch.int64), ((self._num_seqs + 1,), torch.int64))))
        self.host = {n: torch.zeros(shape, dtype=dt, pin_memory=pin) for n, (shape, dt) in shapes.items()}
        self.np = {n: t.numpy() for n, t in self.host.items()}
        self.dev = self.host if not pin else {n: torch.zeros_like(t, device=self.device) for n, t in self.host.items()}

    def build(self, batch: list) -> StepInputs:
        """batch: `BatchEntry`s, in the caller's order."""
        # decodes first; each kind by context length, so the attention plan's runs pad little
        order = sorted(range(len(batch)), key=lambda i: (batch[i].num_new_tokens != 1,
                                                         batch[i].start + batch[i].num_new_tokens))
        entries = [batch[i] for i in order]
        num_tokens = sum(e.num_new_tokens for e in entries)
        if self._copied is not None:  # the previous step's copies read these host buffers: let them finish
            self._copied.synchronize()  # at once if never recorded
        if num_tokens > self._num_tokens or len(entries) > self._num_seqs:
            self._grow(max(num_tokens, 2 * self._num_tokens), max(len(entries), 2 * self._num_seqs))
        starts = self._fill_tokens(entries)
        width = self._fill_tables(entries)
        step = StepInputs(self._out("input_ids", num_tokens), self._out("positions", num_tokens),
                          self._metadata(entries, num_tokens, width, starts), self._logits_index(batch, order, starts),
                          order)
        if self._copied is not None:
            self._copied.record()
        return step

    def _fill_tokens(self, entries: list) -> list[int]:
        ids, pos, slots = self.np["input_ids"], self.np["positions"], self.np["slot_mapping"]
        bs, t, starts = self.block_size, 0, []
        for e in entries:
            starts.append(t)
            n, start, table = e.num_new_tokens, e.start, e.seq.block_table
            if n == 1:
                ids[t], pos[t], slots[t] = _token_ids(e, start, 1)[0], start, table[start // bs] * bs + start % bs
            elif n <= SHORT_CHUNK:  # a verification: plain ints cost less than numpy's small-array calls
                ids[t:t + n] = _token_ids(e, start, n)
                for j, p in enumerate(range(start, start + n), t):
                    pos[j], slots[j] = p, table[p // bs] * bs + p % bs
            else:
                p = np.arange(start, start + n)
                ids[t:t + n], pos[t:t + n] = _token_ids(e, start, n), p
                slots[t:t + n] = np.asarray(table)[p // bs] * bs + p % bs
            t += n
        return starts

    def _fill_tables(self, entries: list) -> int:
        tables, lens, cu = self.np["block_tables"], self.np["context_lens"], self.np["cu_seqlens_q"]
        width, q_total, cu_i = 1, 0, 0
        cu[0] = 0
        for i, e in enumerate(entries):
            table = e.seq.block_table
            tables[i, :len(table)] = table
            width = max(width, len(table))
            lens[i] = e.start + e.num_new_tokens
            if e.num_new_tokens != 1:
                q_total += e.num_new_tokens
                cu_i += 1
                cu[cu_i] = q_total
        return width

    def _logits_index(self, batch: list, order: list[int], starts: list[int]) -> torch.Tensor | None:
        """Rows of the hidden states to score, in the caller's order; None when that is all of
        them in order (a batch of one decode, a prefill that scores every position)."""
        where = [0] * len(batch)
        for j, b in enumerate(order):
            where[b] = starts[j]
        rows = [r for b, e in enumerate(batch)
                for r in range(where[b] + e.num_new_tokens - e.num_logits, where[b] + e.num_new_tokens)]
        if rows == list(range(sum(e.num_new_tokens for e in batch))):
            return None
        self.np["logits_index"][:len(rows)] = rows
        return self._out("logits_index", len(rows))

    def _metadata(self, entries: list, num_tokens: int, width: int, starts: list[int]) -> AttentionMetadata:
        nd = sum(1 for e in entries if e.num_new_tokens == 1)
        ns = len(entries)
        full, lens = self._out("block_tables", ns), self._out("context_lens", ns)
        tables = full[:, :width]
        meta = AttentionMetadata(
            slot_mapping=self._out("slot_mapping", num_tokens), num_decode_tokens=nd,
            decode_block_tables=(full if self.full_width_decode_tables else tables)[:nd],
            decode_context_lens=lens[:nd],
            extend_block_tables=tables[nd:], extend_cu_seqlens_q=self._out("cu_seqlens_q", ns - nd + 1),
            extend_context_lens=lens[nd:],
        )
        if self.plan_on_host and self._plannable(entries):
            meta.plan = (self._native_plan(entries, num_tokens, width, starts)
                         if self.native_plans and self.dev is self.host else
                         plan_gather(tables, [e.start + e.num_new_tokens for e in entries],
                                     [e.num_new_tokens for e in entries], self.block_size, self.uniform_plans,
                                     self.native_plans))
        return meta

    def _native_plan(self, entries: list, num_tokens: int, width: int, starts: list[int]) -> GatherPlan:
        """`plan_gather(..., native=True)`'s plan, written into this runner's buffers: the step's
        block tables and context lengths cast to int64 in place, and its queries' starts, instead
        of fresh arrays each made a tensor. Batch-1 runs of the demo target went 1.025 / 1.028 /
        1.035x as fast plain, 1.018 / 1.028 / 1.038x speculating (draft k = 4) (Intel Xeon, one
        thread, `graph_capture="compile"`, whole 128-token runs; scratch A/B, eight interleaved
        repeats; batch 32 0.95-1.08x, within the noise); `benchmarks/profile_offline.py` (decode
        steps alone, default options) 0.98 / 1.01 / 1.03x against an A/A of 0.96 / 1.00 / 1.03x.
        Small calls run slowly right after the forward has streamed the weights through the
        caches: in the step, the first line of `argmax_rows` (three attribute checks) took 14 µs
        where a loop runs the whole function in 4 (line profiler; scratch timing). The block ids
        are contiguous, [seqs, width], as a compiled graph called straight takes them (no stride
        among its inputs). A table's entries past its sequence's blocks are stale, not -1:
        `paged_attention_cpu` reads no block past a sequence's context."""
        ns, np_ = len(entries), self.np
        np_["native_block_ids"][:ns * width].reshape(ns, width)[:] = np_["block_tables"][:ns, :width]
        np_["native_context_lens"][:ns] = np_["context_lens"][:ns]
        query_starts = np_["native_query_starts"]
        query_starts[:ns] = starts
        query_starts[ns] = num_tokens
        host = self.host
        return GatherPlan(host["native_block_ids"][:ns * width].view(ns, width), ns,
                          max(e.num_new_tokens for e in entries), max(e.start + e.num_new_tokens for e in entries),
                          None, None, None, [], context_lens=host["native_context_lens"][:ns],
                          query_starts=host["native_query_starts"][:ns + 1])

    def _plannable(self, entries: list) -> bool:
        """Whether the step's attention runs by one plan: every chunk short, or with native plans,
        any chunk (`max_native_scores` None), else every chunk's scores per KV head (group_size x
        queries x context) within it."""
        if max(e.num_new_tokens for e in entries) <= MAX_GATHERED_QUERY_LEN:
            return True
        return self.native_plans and (self.max_native_scores is None or all(
            self.group_size * e.num_new_tokens * (e.start + e.num_new_tokens) <= self.max_native_scores
            for e in entries))

    def _out(self, name: str, n: int) -> torch.Tensor:
        """The first n rows of a buffer, on the device (one copy from the pinned host buffer on CUDA,
        asynchronous: the next `build` waits for the event recorded after them before it writes)."""
        if self.dev is self.host:
            return self.host[name][:n]
        return self.dev[name][:n].copy_(self.host[name][:n], non_blocking=True)


def _token_ids(e, start: int, n: int) -> list[int]:
    """Tokens [start, start + n) of the entry's sequence followed by its draft tokens, without
    building the whole token list when they are all outputs and drafts (decode, verification)."""
    seq = e.seq
    offset, out = start - len(seq.prompt_token_ids), seq.output_token_ids
    if offset >= 0:
        if offset + n <= len(out):
            return out[offset:offset + n]
        extra = e.extra_token_ids[max(offset - len(out), 0):offset + n - len(out)]
        return out[offset:] + extra
    return (seq.token_ids + e.extra_token_ids)[start:start + n]
