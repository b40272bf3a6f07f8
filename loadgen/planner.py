"""`pdserve plan`: how many prefill and decode workers for this model profile, this traffic and
these SLOs, and what goodput each worker gives, from the simulator.

For every shape up to `max_workers` workers (P prefill + D decode, and N colocated workers for
comparison; with and without speculation when the profile has its costs) the goodput is found by
simulation: the rate is doubled or halved until it brackets the 90%-attainment point, then
bisected. Goodput is a steady-state property, so each rate runs long enough for an overload to
show: arrivals span at least `min_duration_factor` × max(TTFT SLO, unloaded e2e) seconds (at
least `num_requests`, at most `max_requests` requests), and the first `warmup_fraction` of the
requests, which met an empty system, are left out of the attainment. The best shape is the one with the highest goodput per worker (DistServe's measure);
with a target rate, the answer is the smallest shape whose goodput reaches it.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from pdserve.loadgen.costs import CostProfile
from pdserve.loadgen.goodput import DEFAULT_TARGET, Bisection, Goodput, GoodputMethod
from pdserve.loadgen.simulator import Shape, Traffic, simulate
from pdserve.loadgen.stats import SLO, attainment, summarize

MAX_BRACKET_STEPS = 40


@dataclass(frozen=True, slots=True)
class PlanConfig:
    slo: SLO
    max_workers: int = 6
    num_requests: int = 400
    seed: int = 0
    search_steps: int = 6
    speculation: tuple[bool, ...] = (False,)
    include_colocated: bool = True
    target: float = DEFAULT_TARGET
    max_requests: int = 4000
    min_duration_factor: float = 20.0
    warmup_fraction: float = 0.1

    def __post_init__(self) -> None:
        if not self.slo.is_set:
            raise ValueError("planning needs an SLO (--slo-ttft and/or --slo-tpot)")
        if self.max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {self.max_workers}")
        if not 10 <= self.num_requests <= self.max_requests:
            raise ValueError(f"num_requests must be in [10, max_requests={self.max_requests}], got {self.num_requests}")
        if not 0 <= self.warmup_fraction < 0.5:
            raise ValueError(f"warmup_fraction must be in [0, 0.5), got {self.warmup_fraction}")

    def shapes(self) -> list[Shape]:
        out = []
        for spec in self.speculation:
            out += [Shape(p, d, spec) for n in range(2, self.max_workers + 1) for p in range(1, n) for d in [n - p]]
            if self.include_colocated:
                out += [Shape(0, n, spec) for n in range(1, self.max_workers + 1)]
        return out


@dataclass(frozen=True, slots=True)
class Unloaded:
    """Mean latencies of requests that never meet (a tiny rate), and their SLO attainment."""

    ttft_s: float
    tpot_s: float | None
    e2e_s: float
    attainment: float


@dataclass(slots=True)
class PlanRow:
    shape: Shape
    goodput: Goodput
    points: list[tuple[float, float]]  # (rate, attainment) simulated
    unloaded: Unloaded

    @property
    def rate(self) -> float:
        return self.goodput.rate or 0.0

    @property
    def per_worker(self) -> float:
        return self.rate / self.shape.num_workers


class GoodputSearch:
    """Attainment at a rate, simulated once per rate; and the search over rates."""

    def __init__(self, profile: CostProfile, shape: Shape, traffic: Traffic, config: PlanConfig):
        self.profile, self.shape, self.traffic, self.config = profile, shape, traffic, config
        self.cache: dict[float, float] = {}
        self.min_duration_s = 0.0  # set from the unloaded latencies

    def num_requests(self, rate: float) -> int:
        c = self.config
        return int(min(c.max_requests, max(c.num_requests, math.ceil(rate * self.min_duration_s))))

    def attainment(self, rate: float) -> float:
        if rate not in self.cache:
            c = self.config
            inputs = self.traffic.inputs(rate, self.num_requests(rate), c.seed)
            records = simulate(self.profile, self.shape, inputs, c.seed).records
            self.cache[rate] = attainment(records[int(len(records) * c.warmup_fraction):], c.slo)
        return self.cache[rate]

    def unloaded(self) -> tuple[Unloaded, float]:
        """Latencies of requests that never meet (a tiny rate), and a first guess at capacity."""
        c = self.config
        rate = 1e-6
        result = simulate(self.profile, self.shape, self.traffic.inputs(rate, 50, c.seed), c.seed)
        s = summarize(result.records, rate, c.slo)
        unloaded = Unloaded(s.ttft.mean, s.tpot.mean if s.tpot else None, s.e2e.mean, s.slo_attainment)
        return unloaded, self.shape.num_decode / max(s.e2e.mean, 1e-9)

    def run(self) -> PlanRow:
        unloaded, guess = self.unloaded()
        slo_ttft = self.config.slo.ttft_s or 0.0
        self.min_duration_s = self.config.min_duration_factor * max(slo_ttft, unloaded.e2e_s)
        if unloaded.attainment < self.config.target:  # the SLO is out of reach even alone
            return PlanRow(self.shape, Goodput(None, GoodputMethod.BISECTION, None, 0.0), [], unloaded)
        low, high = self._bracket(guess)
        if high is None or low is None:
            g = Goodput(low, GoodputMethod.BISECTION, low, high, self.config.target)
        else:
            search = Bisection(low, high, self.config.search_steps, self.config.target)
            while (rate := search.next_rate()) is not None:
                search.record(rate, self.attainment(rate))
            g = search.result()
        return PlanRow(self.shape, g, sorted(self.cache.items()), unloaded)

    def _bracket(self, rate: float) -> tuple[float | None, float | None]:
        """(passing, failing) rates a factor of 2 apart."""
        passes = self.attainment(rate) >= self.config.target
        for _ in range(MAX_BRACKET_STEPS):
            nxt = rate * 2 if passes else rate / 2
            if (self.attainment(nxt) >= self.config.target) != passes:
                return (rate, nxt) if passes else (nxt, rate)
            rate = nxt
        return (rate, None) if passes else (None, rate)


@dataclass(slots=True)
class Plan:
    profile: CostProfile
    traffic: Traffic
    config: PlanConfig
    rows: list[PlanRow] = field(default_factory=list)
    target_rate: float | None = None

    def best(self, colocated: bool) -> PlanRow | None:
        rows = [r for r in self.rows if r.shape.is_colocated == colocated and r.goodput.rate]
        return max(rows, key=lambda r: r.per_worker, default=None)

    def smallest_meeting(self, rate: float) -> PlanRow | None:
        rows = [r for r in self.rows if r.rate >= rate]
        return min(rows, key=lambda r: (r.shape.num_workers, -r.rate), default=None)

    def answer(self) -> list[str]:
        lines = []
        for colocated, name in ((False, "disaggregated"), (True, "colocated")):
            best = self.best(colocated)
            if best is not None:
                lines.append(f"best {name}: {best.shape.label}, goodput {best.rate:.3g} req/s, "
                             f"{best.per_worker:.3g} req/s per worker")
        d, c = self.best(False), self.best(True)
        if d and c:
            lines.append(f"disaggregated / colocated goodput per worker: {d.per_worker / c.per_worker:.2f}x")
        if self.target_rate is not None:
            row = self.smallest_meeting(self.target_rate)
            lines.append(f"for {self.target_rate:g} req/s: " + (
                f"{row.shape.label} ({row.shape.num_workers} workers, goodput {row.rate:.3g} req/s)" if row else
                f"no shape up to {self.config.max_workers} workers reaches it; add workers"))
        return lines or ["no shape meets the SLOs at any rate"]

    def format_markdown(self) -> str:
        rows = ["| shape | workers | goodput (req/s) | per worker | unloaded TTFT / TPOT (ms) | how found |",
                "|---|---|---|---|---|---|"]
        for r in sorted(self.rows, key=lambda r: -r.per_worker):
            tpot = r.unloaded.tpot_s
            unloaded = f"{r.unloaded.ttft_s * 1e3:.1f} / {'-' if tpot is None else f'{tpot * 1e3:.1f}'}"
            rows.append(f"| {r.shape.label} | {r.shape.num_workers} | {r.rate:.3g} | {r.per_worker:.3g} | "
                        f"{unloaded} | {r.goodput.describe()} |")
        return "\n".join(rows)

    def to_json(self) -> dict:
        t = self.traffic
        return {"profile": {"model": self.profile.model, "hardware": self.profile.hardware},
                "traffic": {"prompt_len": t.prompt_len.spec, "output_len": t.output_len.spec,
                            "arrival": t.arrival.value, "burstiness": t.burstiness},
                "slo": {"ttft_s": self.config.slo.ttft_s, "tpot_s": self.config.slo.tpot_s},
                "target_rate": self.target_rate, "num_requests": self.config.num_requests, "seed": self.config.seed,
                "answer": self.answer(),
                "rows": [{"shape": r.shape.label, "num_prefill": r.shape.num_prefill, "num_decode": r.shape.num_decode,
                          "speculate": r.shape.speculate, "goodput": r.goodput.to_json(),
                          "goodput_per_worker": r.per_worker, "unloaded": asdict(r.unloaded),
                          "points": [[rate, att] for rate, att in r.points]} for r in self.rows]}


def plan(profile: CostProfile, traffic: Traffic, config: PlanConfig, target_rate: float | None = None,
         progress=None) -> Plan:
    if any(config.speculation) and profile.speculation is None:
        raise ValueError("the profile has no speculation costs; plan without speculation")
    if target_rate is not None and (math.isnan(target_rate) or target_rate <= 0):
        raise ValueError(f"target rate must be > 0, got {target_rate}")
    out = Plan(profile, traffic, config, target_rate=target_rate)
    for shape in config.shapes():
        out.rows.append(GoodputSearch(profile, shape, traffic, config).run())
        if progress is not None:
            progress.update(1)
    return out
