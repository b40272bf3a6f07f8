"""Open-loop arrival processes: when each request is sent, whatever the server is doing.

Gaps between arrivals are independent draws: exponential for Poisson, gamma with shape k (the
burstiness) for gamma, both scaled so the mean gap is 1 / rate. The gamma gaps' squared
coefficient of variation is 1 / k: k = 1 is Poisson again, k < 1 burstier, k > 1 smoother.
The first request goes at t = 0. A seed fixes the whole sequence; Poisson draws at two rates
from one seed give the same times scaled by the ratio of the rates.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from enum import Enum


class ArrivalKind(Enum):
    POISSON = "poisson"
    GAMMA = "gamma"


@dataclass(frozen=True, slots=True)
class ArrivalProcess:
    rate: float  # requests per second; math.inf sends every request at t = 0
    kind: ArrivalKind = ArrivalKind.POISSON
    burstiness: float = 1.0  # gamma shape k (Poisson: must stay 1)

    def __post_init__(self) -> None:
        if not isinstance(self.rate, (int, float)) or math.isnan(self.rate) or self.rate <= 0:
            raise ValueError(f"rate must be > 0 requests/s (or inf), got {self.rate!r}")
        if not isinstance(self.kind, ArrivalKind):
            raise ValueError(f"kind must be an ArrivalKind, got {self.kind!r}")
        if not self.burstiness > 0 or math.isinf(self.burstiness):
            raise ValueError(f"burstiness must be a finite number > 0, got {self.burstiness!r}")
        if self.kind is ArrivalKind.POISSON and self.burstiness != 1.0:
            raise ValueError("burstiness applies to gamma arrivals; Poisson is burstiness 1")

    def gap(self, rng: random.Random) -> float:
        """One inter-arrival time in seconds."""
        if math.isinf(self.rate):
            return 0.0
        if self.kind is ArrivalKind.POISSON:
            return rng.expovariate(self.rate)
        return rng.gammavariate(self.burstiness, 1.0 / (self.burstiness * self.rate))

    def times(self, num_requests: int | None, seed: int, duration_s: float | None = None) -> list[float]:
        """Arrival times in seconds from the start: `num_requests` of them, or those before
        `duration_s`, whichever ends first (at least one of the two must be given)."""
        if num_requests is None and duration_s is None:
            raise ValueError("give num_requests or duration_s (or both)")
        if num_requests is not None and num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {num_requests!r}")
        if duration_s is not None and not duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {duration_s!r}")
        if num_requests is None and math.isinf(self.rate):
            raise ValueError("an infinite rate needs num_requests")
        rng = random.Random(seed)
        out, t = [], 0.0
        while num_requests is None or len(out) < num_requests:
            if duration_s is not None and t >= duration_s:
                break
            out.append(t)
            t += self.gap(rng)
        return out
