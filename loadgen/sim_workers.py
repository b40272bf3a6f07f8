"""The simulator's workers: each runs one engine step at a time, its cost from the profile.

Prefill worker (disaggregated):   queued ──chunks, FCFS, under the token budget──► done (first token sampled)
Decode worker (disaggregated):    reserved (at admission; the first token went out when the prefill worker
                                  sampled it) ──KV arrived──► joining ──step boundary──► running
                                  ──last token──► finished
Colocated worker:                 waiting (prefill chunks beside the running decodes) ──► running ──► finished

A step's sequences are chosen when it starts and get their tokens when it ends, as in the
engine: a request whose KV arrives mid-step joins at the next boundary. Decodes come first in a
colocated step's token budget, then prefill chunks in arrival order (the engine's scheduler).
"""
from __future__ import annotations

import heapq
import random
from dataclasses import dataclass
from typing import Callable

from pdserve.loadgen.costs import CostProfile, SpeculationCost, StepCost, chunk_attention
from pdserve.loadgen.records import RequestRecord


class Clock:
    """A discrete-event loop: callbacks run in time order (ties in the order scheduled)."""

    def __init__(self):
        self.now = 0.0
        self._events: list = []
        self._num_scheduled = 0

    def at(self, t: float, fn: Callable, *args) -> None:
        self._num_scheduled += 1
        heapq.heappush(self._events, (t, self._num_scheduled, fn, args))

    def run(self) -> None:
        while self._events:
            self.now, _, fn, args = heapq.heappop(self._events)
            fn(*args)


@dataclass(slots=True)
class SimRequest:
    """One request's progress; `emit` records what its client would see."""

    index: int
    arrival_s: float
    prompt_len: int
    output_len: int
    record: RequestRecord
    admitted_s: float | None = None
    prefill_start_s: float | None = None
    prefill_end_s: float | None = None
    num_computed: int = 0  # prompt tokens prefilled
    num_generated: int = 0
    decode_worker: "DecodeWorker | None" = None
    draft_at_s: float | None = None  # when its draft's K/V land on the decode worker (None: no draft to wait for)

    @property
    def kv_tokens(self) -> int:
        return self.prompt_len + self.output_len

    @property
    def is_done(self) -> bool:
        return self.num_generated >= self.output_len

    @property
    def context_len(self) -> int:
        return self.prompt_len + self.num_generated

    def emit(self, now: float, num_tokens: int) -> None:
        num_tokens = min(num_tokens, self.output_len - self.num_generated)
        self.record.add_delta(now, num_tokens)
        self.num_generated += num_tokens
        if self.is_done:
            self.record.end_s = now


class Decoder:
    """Decode steps of a batch, plain or speculative; shared by decode and colocated workers."""

    def __init__(self, profile: CostProfile, speculation: SpeculationCost | None, rng: random.Random):
        self.decode, self.speculation, self.rng = profile.decode, speculation, rng

    @property
    def tokens_per_seq(self) -> int:
        """Budget tokens one decoding sequence uses in a step."""
        return 1 + (self.speculation.num_speculative_tokens if self.speculation else 0)

    def seconds(self, batch: list[SimRequest]) -> float:
        attention = sum(r.context_len for r in batch)
        if self.speculation is not None:
            return self.speculation.step_seconds(self.decode, len(batch), attention)
        return self.decode.seconds(len(batch), len(batch), attention)

    def num_tokens(self) -> int:
        """Tokens one sequence gets from one step: accepted drafts (until the first rejection) + 1."""
        spec = self.speculation
        if spec is None:
            return 1
        accepted = 0
        while accepted < spec.num_speculative_tokens and self.rng.random() < spec.acceptance_rate:
            accepted += 1
        return accepted + 1


class PrefillWorker:
    """Prefills prompts in chunks, then hands each prompt's K/V over, one prompt at a time: a
    worker's sends share its link (and, on the CPU, the core its serving loop runs on), so the
    prompts one step completes arrive one after another. With a draft, a step's first tokens are
    sampled after the target's pass, and the target's K/V go then, while the draft's pass over
    the same tokens runs (`LLMEngine.defer_draft_handoff`): the decode worker starts on them, and
    the draft's K/V land at the step's end (their bytes, a fraction of the target's, left out of
    the link's time); the next step starts then."""

    def __init__(self, clock: Clock, profile: CostProfile, cost: StepCost,
                 on_done: Callable[[SimRequest, float, float | None], None], sampled_after: StepCost | None = None):
        """on_done(request, kv_arrival_s, draft_arrival_s): a prompt is prefilled, its first
        token sampled now; its target's K/V arrive at kv_arrival_s, its draft's at draft_arrival_s
        (None without a draft). cost: a step's whole, the draft's pass included where there is
        one; sampled_after: the part of it after which the first tokens are sampled (None: all of
        it, and no draft)."""
        self.clock, self.cost, self.limits, self.on_done = clock, cost, profile.limits, on_done
        self.sampled_after = sampled_after or cost
        self.has_draft = sampled_after is not None and sampled_after != cost
        self.transfer = profile.transfer
        self.jobs: list[SimRequest] = []
        self.queued_tokens = 0
        self.is_busy = False
        self.link_free_s = 0.0  # when the hand-over under way ends

    def submit(self, req: SimRequest) -> None:
        self.jobs.append(req)
        self.queued_tokens += req.prompt_len
        if not self.is_busy:
            self._step()

    def _step(self) -> None:
        chunks = take_chunks(self.jobs, self.limits.max_num_batched_tokens, self.limits.max_num_seqs)
        self.is_busy = bool(chunks)
        if chunks:
            now = self.clock.now
            whole = prefill_seconds(self.cost, chunks, True, now)
            sampled = min(whole, prefill_seconds(self.sampled_after, chunks, True, now))
            self.clock.at(now + sampled, self._finish, chunks, now + whole)

    def _finish(self, chunks: list[tuple[SimRequest, int]], step_end_s: float) -> None:
        """The step's first tokens are sampled now, and the target's K/V go; it ends (the
        draft's K/V go) at step_end_s."""
        for req, n in chunks:
            req.num_computed += n
            self.queued_tokens -= n
            if req.num_computed == req.prompt_len:
                self.jobs.remove(req)
                req.prefill_end_s = self.clock.now
                self.link_free_s = max(self.link_free_s, self.clock.now) + self.transfer.seconds(req.prompt_len)
                self.on_done(req, self.link_free_s, max(self.link_free_s, step_end_s) if self.has_draft else None)
        if step_end_s > self.clock.now:
            self.clock.at(step_end_s, self._step)
        else:
            self._step()


def take_chunks(queue: list[SimRequest], budget: int, max_seqs: int) -> list[tuple[SimRequest, int]]:
    """Prefill chunks for one step, in arrival order, under a token budget."""
    chunks = []
    for req in queue:
        if budget <= 0 or len(chunks) >= max_seqs:
            break
        n = min(req.prompt_len - req.num_computed, budget)
        chunks.append((req, n))
        budget -= n
    return chunks


def prefill_seconds(cost: StepCost, chunks: list[tuple[SimRequest, int]], with_fixed: bool, now: float) -> float:
    for req, _ in chunks:
        if req.prefill_start_s is None:
            req.prefill_start_s = now
    args = (len(chunks), sum(n for _, n in chunks), sum(chunk_attention(r.num_computed, n) for r, n in chunks))
    return cost.seconds(*args) if with_fixed else cost.marginal(*args)


class DecodeWorker:
    """Disaggregated decode: blocks reserved at admission, joins once its KV has arrived."""

    def __init__(self, clock: Clock, profile: CostProfile, decoder: Decoder, on_free: Callable[[], None]):
        self.clock, self.limits, self.decoder, self.on_free = clock, profile.limits, decoder, on_free
        self.running: list[SimRequest] = []
        self.joining: list[SimRequest] = []
        self.num_reserved = 0
        self.kv_used = 0
        self.is_busy = False

    @property
    def kv_free(self) -> int:
        return self.limits.kv_capacity_tokens - self.kv_used

    def can_admit(self, req: SimRequest) -> bool:
        num_seqs = len(self.running) + len(self.joining) + self.num_reserved
        return num_seqs < self.limits.max_num_seqs and req.kv_tokens <= self.kv_free

    def admit(self, req: SimRequest) -> None:
        self.num_reserved += 1
        self.kv_used += req.kv_tokens

    def kv_arrived(self, req: SimRequest) -> None:
        self.num_reserved -= 1
        self.joining.append(req)
        if not self.is_busy:
            self._step()

    def release(self, req: SimRequest) -> None:
        """A reservation whose request ended with its first token (sampled by the prefill worker)."""
        self.num_reserved -= 1
        self._free(req)

    def _step(self) -> None:
        self.running.extend(self.joining)
        self.joining.clear()
        self.is_busy = bool(self.running)
        if self.running:
            batch = list(self.running)
            self.clock.at(self.clock.now + self.decoder.seconds(batch), self._finish, batch, self.clock.now)

    def _finish(self, batch: list[SimRequest], started_s: float) -> None:
        """A step that began at started_s ends: a request whose draft's K/V had not landed by
        then decoded plainly (one token)."""
        for req in batch:
            landed = req.draft_at_s is None or req.draft_at_s <= started_s
            req.emit(self.clock.now, self.decoder.num_tokens() if landed else 1)
        self.running = [r for r in self.running if not r.is_done]
        for req in batch:
            if req.is_done:
                self._free(req)
        self._step()

    def _free(self, req: SimRequest) -> None:
        self.kv_used -= req.kv_tokens
        self.on_free()


class ColocatedWorker:
    """Prefill and decode in the same steps: decodes first, then prefill chunks in the budget."""

    def __init__(self, clock: Clock, profile: CostProfile, prefill: StepCost, decoder: Decoder,
                 on_free: Callable[[], None]):
        self.clock, self.prefill, self.limits, self.decoder = clock, prefill, profile.limits, decoder
        self.on_free = on_free
        self.waiting: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.kv_used = 0
        self.is_busy = False

    @property
    def kv_free(self) -> int:
        return self.limits.kv_capacity_tokens - self.kv_used

    def can_admit(self, req: SimRequest) -> bool:
        num_seqs = len(self.running) + len(self.waiting)
        return num_seqs < self.limits.max_num_seqs and req.kv_tokens <= self.kv_free

    def admit(self, req: SimRequest) -> None:
        self.kv_used += req.kv_tokens
        self.waiting.append(req)
        if not self.is_busy:
            self._step()

    def _step(self) -> None:
        budget = self.limits.max_num_batched_tokens
        decodes = self.running[:max(1, budget // self.decoder.tokens_per_seq)]
        budget -= len(decodes) * self.decoder.tokens_per_seq
        chunks = take_chunks(self.waiting, budget, self.limits.max_num_seqs)
        self.is_busy = bool(decodes or chunks)
        if not self.is_busy:
            return
        seconds = self.decoder.seconds(decodes) if decodes else 0.0
        if chunks:
            seconds += prefill_seconds(self.prefill, chunks, not decodes, self.clock.now)
        self.clock.at(self.clock.now + seconds, self._finish, decodes, chunks)

    def _finish(self, decodes: list[SimRequest], chunks: list[tuple[SimRequest, int]]) -> None:
        now = self.clock.now
        for req in decodes:
            req.emit(now, self.decoder.num_tokens())
        for req, n in chunks:
            req.num_computed += n
            if req.num_computed == req.prompt_len:  # the step that completes a prompt samples its first token
                self.waiting.remove(req)
                req.prefill_end_s = now
                req.emit(now, 1)
                self.running.append(req)
        done = [r for r in self.running if r.is_done]
        self.running = [r for r in self.running if not r.is_done]
        for req in done:
            self.kv_used -= req.kv_tokens
            self.on_free()
        self._step()
