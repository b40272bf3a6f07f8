"""A discrete-event simulator of a pdserve deployment, driven by a cost profile. Torch-free.

    arrival ──(request_overhead_s)──► router queue (FCFS)
        ──admission: a decode worker with a free slot and KV room (most free KV first)──►
    disaggregated: prefill worker with the fewest queued prompt tokens (chunked prefill): the
        first token goes out as it is sampled ──KV transfer (a prefill worker's one after
        another)──► decode worker: joins at its next step boundary, then continuous batching,
        plain or speculative (with a draft: the target's K/V go as the first token is sampled,
        and the request decodes plainly until the draft's land, at the prefill step's end)
    colocated: the decode worker prefills it in chunks beside its running decodes

It produces the same `RequestRecord`s as `pdserve bench`, so the same summaries, SLO
attainment and goodput apply. What it leaves out: preemption (KV for prompt + output is
reserved at admission instead), the router's queue timeout, speculation depth that adapts per
sequence (depth is fixed at k), and per-delta network costs beyond `request_overhead_s`.
"""
from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

from pdserve.loadgen.arrivals import ArrivalKind, ArrivalProcess
from pdserve.loadgen.costs import CostProfile
from pdserve.loadgen.lengths import LengthDistribution
from pdserve.loadgen.records import RequestRecord
from pdserve.loadgen.sim_workers import Clock, ColocatedWorker, Decoder, DecodeWorker, PrefillWorker, SimRequest


@dataclass(frozen=True, slots=True)
class Shape:
    """How many workers of each kind: `num_prefill` 0 means colocated (`num_decode` of them)."""

    num_prefill: int
    num_decode: int
    speculate: bool = False

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ValueError(f"a shape needs num_prefill >= 0 and num_decode >= 1, got {self.num_prefill}, {self.num_decode}")

    @property
    def is_colocated(self) -> bool:
        return self.num_prefill == 0

    @property
    def num_workers(self) -> int:
        return self.num_prefill + self.num_decode

    @property
    def label(self) -> str:
        spec = " +spec" if self.speculate else ""
        return f"{self.num_decode} colocated{spec}" if self.is_colocated else f"{self.num_prefill}P:{self.num_decode}D{spec}"


@dataclass(frozen=True, slots=True)
class SimInput:
    arrival_s: float
    prompt_len: int
    output_len: int


@dataclass(frozen=True, slots=True)
class Traffic:
    """Open-loop traffic: arrival process shape plus prompt and output length distributions."""

    prompt_len: LengthDistribution
    output_len: LengthDistribution
    arrival: ArrivalKind = ArrivalKind.POISSON
    burstiness: float = 1.0

    def inputs(self, rate: float, num_requests: int, seed: int) -> list[SimInput]:
        times = ArrivalProcess(rate, self.arrival, self.burstiness).times(num_requests, seed)
        rng = random.Random(seed + 1)
        return [SimInput(t, self.prompt_len.sample(rng), self.output_len.sample(rng)) for t in times]


@dataclass(slots=True)
class SimResult:
    records: list[RequestRecord]
    requests: list[SimRequest] = field(default_factory=list)  # stage timings, for inspection


class Router:
    def __init__(self, clock: Clock, profile: CostProfile, shape: Shape, seed: int):
        self.clock, self.profile = clock, profile
        spec = profile.speculation if shape.speculate else None
        if shape.speculate and spec is None:
            raise ValueError("the profile has no speculation costs: cannot simulate speculative decoding")
        decoder = Decoder(profile, spec, random.Random(seed))
        # with a draft, prefill fills its cache too (on the prefill worker, after the first
        # tokens are sampled, or as the draft catches up in a colocated worker's first
        # speculative step, counted here in its prefill)
        prefill = spec.prefill if spec is not None and spec.prefill is not None else profile.prefill
        if shape.is_colocated:
            self.decode = [ColocatedWorker(clock, profile, prefill, decoder, self.admit) for _ in range(shape.num_decode)]
        else:
            self.decode = [DecodeWorker(clock, profile, decoder, self.admit) for _ in range(shape.num_decode)]
        self.prefill = [PrefillWorker(clock, profile, prefill, self._prefilled, sampled_after=profile.prefill)
                        for _ in range(shape.num_prefill)]
        self.queue: deque[SimRequest] = deque()

    def arrive(self, req: SimRequest) -> None:
        self.clock.at(self.clock.now + self.profile.request_overhead_s, self._enqueue, req)

    def _enqueue(self, req: SimRequest) -> None:
        self.queue.append(req)
        self.admit()

    def admit(self) -> None:
        while self.queue:
            req = self.queue[0]
            fits = [w for w in self.decode if w.can_admit(req)]
            if not fits:
                return  # FCFS: the head waits, and so does everything behind it
            w = max(fits, key=lambda w: w.kv_free)
            self.queue.popleft()
            req.admitted_s, req.decode_worker = self.clock.now, w
            w.admit(req)
            if self.prefill:
                min(self.prefill, key=lambda p: p.queued_tokens).submit(req)

    def _prefilled(self, req: SimRequest, kv_arrival_s: float, draft_arrival_s: float | None) -> None:
        req.emit(self.clock.now, 1)  # the prefill worker's first token goes to the router at once
        if req.is_done:
            req.decode_worker.release(req)
            return
        req.draft_at_s = draft_arrival_s  # it decodes on the target's K/V, plainly until the draft's land
        self.clock.at(kv_arrival_s, req.decode_worker.kv_arrived, req)


def simulate(profile: CostProfile, shape: Shape, inputs: list[SimInput], seed: int = 0) -> SimResult:
    """Run every request to completion; those that never fit anywhere end RESOURCE_EXHAUSTED.
    A colocated shape runs on the profile's colocated steps where it has them (`for_workers`)."""
    profile = profile.for_workers(shape.is_colocated)
    clock = Clock()
    router = Router(clock, profile, shape, seed)
    requests = []
    for i, x in enumerate(inputs):
        if x.prompt_len < 1 or x.output_len < 1:
            raise ValueError(f"request {i}: prompt_len and output_len must be >= 1")
        rec = RequestRecord(i, x.arrival_s, x.output_len, x.prompt_len, sent_s=x.arrival_s)
        req = SimRequest(i, x.arrival_s, x.prompt_len, x.output_len, rec)
        requests.append(req)
        clock.at(x.arrival_s, router.arrive, req)
    clock.run()
    for req in requests:
        if not req.is_done:
            req.record.status, req.record.error = "RESOURCE_EXHAUSTED", "never fit on any worker"
            req.record.end_s = req.arrival_s
    return SimResult([r.record for r in requests], requests)


def bench_inputs(config, rate: float) -> list[SimInput]:
    """The exact traffic `pdserve bench` sends at `rate` for a `BenchConfig` (same arrival times,
    same lengths), for predicting a measured run. Needs prompts of known length (token ids)."""
    from pdserve.loadgen.workload import build_workload

    times = config.process(rate).times(config.num_requests, config.seed, config.duration_s)
    specs = build_workload(config.workload, len(times), config.seed)
    if any(s.num_prompt_tokens is None for s in specs):
        raise ValueError("simulating a bench run needs prompts of known length: token ids, or a tokenizer")
    return [SimInput(t, s.num_prompt_tokens, s.max_tokens) for t, s in zip(times, specs)]
