"""Goodput: the highest request rate at which at least 90% of requests meet every SLO
(DistServe's definition), from a sweep of rates or by bisection.

From a sweep: the *best swept rate* is the highest rate that passes with every lower swept rate
passing too (attainment can wobble from noise; a pass above a failure is not trusted), and the
*interpolated* goodput puts the 90% crossing on the straight line between that rate and the
next swept one. By bisection over [low, high]: measure both ends, then halve the bracket
`steps` times at its geometric midpoint √(lo·hi), so each step narrows the bracket by the same
ratio wherever the goodput lies (a range of 1–40 req/s halved arithmetically spends its first
steps at 20, 10 and 5 req/s, and a system whose goodput is 2 req/s learns only that it is
between 1 and 5); the goodput is the highest rate measured to pass, and the bracket says how
close the failing rate above it is.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Callable

DEFAULT_TARGET = 0.9


class GoodputMethod(Enum):
    SWEPT = "best swept rate"
    INTERPOLATED = "interpolated between swept rates"
    BISECTION = "bisection"


@dataclass(frozen=True, slots=True)
class Goodput:
    rate: float | None  # None: even the lowest rate tried failed
    method: GoodputMethod
    passing_rate: float | None  # the highest rate measured to pass
    failing_rate: float | None  # the lowest rate measured to fail above it; None: all passed
    target: float = DEFAULT_TARGET
    num_passing_above: int = 0  # swept rates above the failing one that passed anyway (noise?)

    @property
    def is_lower_bound(self) -> bool:
        """Every rate tried passed: the true goodput is at least `rate`."""
        return self.failing_rate is None and self.rate is not None

    def describe(self) -> str:
        share = f"{self.target:.0%} SLO attainment"
        noisy = (f"; {self.num_passing_above} higher swept rate(s) passed anyway: attainment is not monotone "
                 f"here (noise? more requests or --warmup)") if self.num_passing_above else ""
        if self.rate is None and not self.failing_rate:
            return f"no goodput: fewer than {self.target:.0%} of requests meet the SLOs even without load"
        if self.rate is None:
            return f"goodput below {self.failing_rate:g} req/s (the lowest rate tried missed {share}){noisy}"
        bound = " (a lower bound: every rate tried met it)" if self.is_lower_bound else ""
        bracket = f", failing at {self.failing_rate:g} req/s" if self.failing_rate is not None else ""
        return f"goodput {self.rate:.3g} req/s by {self.method.value}{bracket}{bound}{noisy}"

    def to_json(self) -> dict:
        return {"rate": self.rate, "method": self.method.value, "passing_rate": self.passing_rate,
                "failing_rate": self.failing_rate, "target": self.target, "is_lower_bound": self.is_lower_bound,
                "num_passing_above": self.num_passing_above,
                "description": self.describe()}


def _check_points(points: list[tuple[float, float]], target: float) -> list[tuple[float, float]]:
    if not points:
        raise ValueError("goodput needs at least one (rate, attainment) point")
    if not 0 < target <= 1:
        raise ValueError(f"target attainment must be in (0, 1], got {target}")
    return sorted(points)


def from_sweep(points: list[tuple[float, float]], target: float = DEFAULT_TARGET) -> tuple[Goodput, Goodput]:
    """(best swept rate, interpolated) from (rate, attainment) points."""
    pts = _check_points(points, target)
    best = None
    for i, (rate, att) in enumerate(pts):
        if att < target:
            break
        best = i
    above = sum(a >= target for _, a in pts[(best if best is not None else -1) + 2:])
    if best is None:
        swept = Goodput(None, GoodputMethod.SWEPT, None, pts[0][0], target, above)
        return swept, Goodput(None, GoodputMethod.INTERPOLATED, None, pts[0][0], target, above)
    rate, att = pts[best]
    failing = pts[best + 1] if best + 1 < len(pts) else None
    swept = Goodput(rate, GoodputMethod.SWEPT, rate, failing and failing[0], target, above)
    if failing is None:
        return swept, Goodput(rate, GoodputMethod.INTERPOLATED, rate, None, target)
    (r1, a1), (r2, a2) = (rate, att), failing
    crossing = r1 + (a1 - target) / (a1 - a2) * (r2 - r1)
    return swept, Goodput(crossing, GoodputMethod.INTERPOLATED, r1, r2, target, above)


class Bisection:
    """Goodput by bisection over [low, high], one measurement at a time, for callers that
    measure synchronously (the simulator) or asynchronously (a live system):

        search = Bisection(1, 16, steps=4)
        while (rate := search.next_rate()) is not None:
            search.record(rate, attainment at rate)
        search.result()
    """

    def __init__(self, low: float, high: float, steps: int, target: float = DEFAULT_TARGET):
        if not 0 < low < high:
            raise ValueError(f"bisection needs 0 < low < high, got low={low}, high={high}")
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        _check_points([(low, 1.0)], target)
        self.low, self.high, self.steps, self.target = low, high, steps, target
        self.points: list[tuple[float, float]] = []
        self._lo = self._hi = None  # highest passing, lowest failing
        self._is_done = False

    def next_rate(self) -> float | None:
        if self._is_done:
            return None
        if not self.points:
            return self.low
        if len(self.points) == 1:
            return self.high
        return math.sqrt(self._lo * self._hi)

    def record(self, rate: float, attainment: float) -> None:
        self.points.append((rate, attainment))
        passed = attainment >= self.target
        if len(self.points) == 1:
            self._lo, self._hi, self._is_done = (rate, None, False) if passed else (None, rate, True)
        elif len(self.points) == 2:
            self._lo, self._hi, self._is_done = (rate, None, True) if passed else (self._lo, rate, self.steps == 0)
        else:
            self._lo, self._hi = (rate, self._hi) if passed else (self._lo, rate)
            self._is_done = len(self.points) - 2 >= self.steps

    def result(self) -> Goodput:
        return Goodput(self._lo, GoodputMethod.BISECTION, self._lo, self._hi, self.target)


def bisect(attainment_at: Callable[[float], float], low: float, high: float, steps: int,
           target: float = DEFAULT_TARGET) -> tuple[Goodput, list[tuple[float, float]]]:
    """Goodput by bisection, and every (rate, attainment) measured on the way."""
    search = Bisection(low, high, steps, target)
    while (rate := search.next_rate()) is not None:
        search.record(rate, attainment_at(rate))
    return search.result(), search.points
