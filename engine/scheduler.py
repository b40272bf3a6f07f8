"""`Scheduler`: iteration-level continuous batching with chunked prefill. Holds no torch.

Life cycle of a sequence:

    waiting ──admit (blocks for its first chunk, prefix-cache hits adopted)──► running
    running ──each step: its uncomputed tokens (a prefill chunk, or 1 + lookahead to decode)──► running
    running ──blocks short: the newest running sequence is preempted──► front of waiting
    running ──finished / aborted──► gone (blocks freed)

Disaggregated serving adds one more place, HELD: blocks kept outside both queues.

    prefill worker:  running ──prompt computed, first token sampled: `hold`──► held ──`finish`──► gone
    decode worker:   `reserve` (blocks for prompt + first token) ──► held ──K/V arrived: `activate`──► running

A step's token budget (`max_num_batched_tokens`) is spent on running sequences first, oldest
first, then on admitting waiting ones in arrival order (FCFS: a head that does not fit blocks
the queue). A long prompt spreads over steps in chunks and shares each step with decodes. With
`prefill_chunk_tokens`, a step that decodes anything gives prompt chunks at most that many
tokens in all, and the sequences with a cap of their own (`chunk_tokens`: a decode worker's local
tails) take at most that many in all in such a step, the oldest first: a step costs about its
prompt tokens on a CPU, so this bounds the gap prompts put between the tokens of the requests
already decoding, however many arrive at once.
Preemption is by recompute: the victim's blocks are freed and its prompt plus the tokens it has
generated are prefilled again when it is readmitted; seeded sampling makes it continue with
exactly the tokens it would have produced.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    prefill_chunk_tokens: int | None = None  # prompt tokens a step that decodes takes at most (None, 0: no cap)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.prefill_chunk_tokens is not None and self.prefill_chunk_tokens < 0:
            raise ValueError(f"prefill_chunk_tokens must be >= 0 or None, got {self.prefill_chunk_tokens}")


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens run through the model this step, starting at num_computed_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


# Extra KV slots a decoding sequence needs this step (speculative lookahead); 0 by default.
LookaheadFn = Callable[[Sequence], int]


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.held: dict[str, Sequence] = {}  # req_id -> sequence
        # prefix cache, in tokens, over admissions (vLLM's prefix_cache_queries / _hits)
        self.num_prefix_queried_tokens = 0
        self.num_prefix_hit_tokens = 0
        self.num_preemptions = 0  # over the engine's life (vLLM's num_preemptions)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """Whether a step has work: held sequences wait for something outside the engine."""
        return bool(self.waiting or self.running)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Prompt (and recompute) tokens still to run: the prefill work queued here. Read from the
        server's thread too (worker stats), possibly mid-step, when a verified sequence counts its
        draft tokens as computed before verification cuts it back: those count as none queued."""
        return sum(max(s.num_uncomputed_tokens, 0) for s in (*self.waiting, *self.running))

    @property
    def num_seqs(self) -> int:
        """Sequences holding or waiting for blocks, counted against `max_num_seqs`."""
        return len(self.waiting) + len(self.running) + len(self.held)

    def schedule(self, lookahead: LookaheadFn = lambda seq: 0) -> SchedulerOutput:
        out = SchedulerOutput()
        cap = self.config.prefill_chunk_tokens
        # prompt chunks are capped only in a step that decodes (a running sequence with one token to go)
        decodes = any(s.num_uncomputed_tokens == 1 for s in self.running)
        prompt_budget = cap if cap and decodes else None  # the step's prompt tokens, in all
        budget, prompt_budget = self._schedule_running(out, self.config.max_num_batched_tokens, prompt_budget,
                                                       decodes, lookahead)
        if not out.preempted:
            self._admit_waiting(out, budget, prompt_budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, prompt_budget: int | None, step_decodes: bool,
                          lookahead: LookaheadFn) -> tuple[int, int | None]:
        queue = list(self.running)
        own_budget = None  # tokens left this step to the sequences with a cap of their own (`chunk_tokens`)
        while queue and budget > 0:
            seq = queue.pop(0)
            decodes = seq.num_uncomputed_tokens == 1
            capped = not decodes and bool(seq.chunk_tokens) and step_decodes
            if capped and own_budget is None:  # the first such sequence's cap is the step's, for all of them
                own_budget = seq.chunk_tokens
            if not decodes and (prompt_budget == 0 or capped and own_budget == 0):
                continue  # a prompt chunk left for a later step: this step's budget for it is spent
            extra = lookahead(seq) if decodes else 0
            limit = budget if decodes or prompt_budget is None else min(budget, prompt_budget)
            if capped:
                limit = min(limit, own_budget)
            num_new = min(seq.num_uncomputed_tokens + extra, limit)
            while not self.block_manager.allocate(seq, seq.num_computed_tokens + num_new):
                victim = queue.pop() if queue else seq
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                out.scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
                if not decodes and prompt_budget is not None:
                    prompt_budget -= num_new
                if capped:
                    own_budget -= num_new
        # unscheduled ones stay running, in their order, and wait for budget
        self.running = [s for s in self.running if s.status is SequenceStatus.RUNNING]
        return budget, prompt_budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int, prompt_budget: int | None) -> None:
        bm = self.block_manager
        if prompt_budget is not None:
            budget = min(budget, prompt_budget)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            prefix = bm.match_prefix(seq)
            num_cached = len(prefix) * bm.block_size
            num_new = min(seq.num_tokens - num_cached, budget)
            if not bm.allocate(seq, num_cached + num_new, prefix):
                break
            self.waiting.popleft()
            if not seq.num_preemptions:  # a first admission, not a recompute
                self.num_prefix_queried_tokens += seq.num_tokens
                self.num_prefix_hit_tokens += num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = seq.num_cached_tokens = seq.num_draft_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    # ---- disaggregated serving ----------------------------------------------------------
    def hold(self, seq: Sequence) -> None:
        """A running sequence leaves the queues with its blocks (a prefilled prompt handed off)."""
        assert seq.status is SequenceStatus.RUNNING, f"{seq.req_id} is {seq.status}, not running"
        self.running.remove(seq)
        self._hold(seq)

    def reserve(self, seq: Sequence, num_tokens: int, prefix: list[int] = ()) -> bool:
        """Take blocks for `num_tokens` tokens of a new sequence, whole or nothing, first adopting
        `prefix` (cached blocks, `BlockManager.match_prefix`), and hold it. False when the pool or
        `max_num_seqs` has no room."""
        if self.num_seqs >= self.config.max_num_seqs or not self.block_manager.allocate(seq, num_tokens, prefix):
            return False
        if self.block_manager.enable_prefix_caching:  # a decode worker's admission: its transfer skips the hits
            self.num_prefix_queried_tokens += seq.num_tokens
            self.num_prefix_hit_tokens += seq.num_cached_tokens
        self._hold(seq)
        return True

    def activate(self, seq: Sequence) -> None:
        """A held sequence whose K/V are now in its blocks joins the running batch."""
        assert seq.status is SequenceStatus.HELD, f"{seq.req_id} is {seq.status}, not held"
        del self.held[seq.req_id]
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def _hold(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.HELD
        self.held[seq.req_id] = seq

    def finish(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence wherever it is and free its blocks. Idempotent."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.HELD:
            del self.held[seq.req_id]
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
