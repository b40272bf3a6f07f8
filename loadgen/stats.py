"""Summaries of a run: latency percentiles, throughput, failures, SLO attainment.

Percentiles interpolate linearly between the two nearest ranks (numpy's default, and what
vLLM's benchmark reports). SLO attainment is the share of *all* requests sent that met every
given objective: a failed request met none. TPOT is not asked of one-token requests.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field

from pdserve.loadgen.records import RequestRecord


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) of `values`, linear between closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True, slots=True)
class LatencySummary:
    """Seconds."""

    mean: float
    p50: float
    p90: float
    p99: float
    max: float
    count: int

    @classmethod
    def of(cls, values: list[float]) -> "LatencySummary | None":
        if not values:
            return None
        return cls(sum(values) / len(values), percentile(values, 50), percentile(values, 90),
                   percentile(values, 99), max(values), len(values))


@dataclass(frozen=True, slots=True)
class SLO:
    """Service-level objectives in seconds; None: not asked."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"SLO {name} must be > 0 seconds, got {value!r}")

    @property
    def is_set(self) -> bool:
        return self.ttft_s is not None or self.tpot_s is not None

    def is_met(self, rec: RequestRecord) -> bool:
        if not rec.is_ok:
            return False
        if self.ttft_s is not None and rec.ttft_s > self.ttft_s:
            return False
        tpot = rec.tpot_s
        return self.tpot_s is None or tpot is None or tpot <= self.tpot_s


def attainment(records: list[RequestRecord], slo: SLO) -> float | None:
    if not slo.is_set or not records:
        return None
    return sum(slo.is_met(r) for r in records) / len(records)


@dataclass(slots=True)
class RunSummary:
    rate: float  # offered requests per second
    num_requests: int
    num_ok: int
    failures: dict[str, int]  # status code name -> count
    duration_s: float  # first scheduled arrival (t = 0) to the last stream's end
    request_throughput: float  # finished requests per second
    output_token_throughput: float
    total_token_throughput: float  # prompt + output tokens of finished requests per second
    ttft: LatencySummary | None
    tpot: LatencySummary | None
    itl: LatencySummary | None
    e2e: LatencySummary | None
    slo_attainment: float | None
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        out = asdict(self)
        out["rate"] = "inf" if math.isinf(self.rate) else self.rate
        return out

    @classmethod
    def from_json(cls, obj: dict) -> "RunSummary":
        lat = {k: None if obj[k] is None else LatencySummary(**obj[k]) for k in ("ttft", "tpot", "itl", "e2e")}
        rest = {k: v for k, v in obj.items() if k not in lat}
        rest["rate"] = math.inf if rest["rate"] == "inf" else rest["rate"]
        return cls(**rest, **lat)


def summarize(records: list[RequestRecord], rate: float, slo: SLO) -> RunSummary:
    ok = [r for r in records if r.is_ok]
    ends = [r.end_s for r in records if r.end_s is not None]
    duration = max(ends) if ends else 0.0
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    out_tokens = sum(r.num_output_tokens for r in ok)
    prompt_tokens = sum(r.num_prompt_tokens or 0 for r in ok)
    failures = Counter(r.status if r.status != "OK" else "NO_TOKENS" for r in records if not r.is_ok)
    return RunSummary(
        rate=rate, num_requests=len(records), num_ok=len(ok), failures=dict(sorted(failures.items())),
        duration_s=duration, request_throughput=per_s(len(ok)), output_token_throughput=per_s(out_tokens),
        total_token_throughput=per_s(out_tokens + prompt_tokens),
        ttft=LatencySummary.of([r.ttft_s for r in ok]),
        tpot=LatencySummary.of([t for r in ok if (t := r.tpot_s) is not None]),
        itl=LatencySummary.of([x for r in ok for x in r.itls_s()]),
        e2e=LatencySummary.of([r.e2e_s for r in ok]),
        slo_attainment=attainment(records, slo))
