"""Arrival processes: seeded determinism, and the statistics each promises (Poisson: mean gap
1/λ, variance 1/λ², counts with variance = mean; gamma: squared coefficient of variation 1/k),
checked on many draws with generous bounds."""
from __future__ import annotations

import math
import statistics

import pytest

from pdserve.loadgen.arrivals import ArrivalKind, ArrivalProcess

N = 40_000


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def test_a_seed_fixes_the_times_and_rates_scale_them():
    p = ArrivalProcess(4.0)
    assert p.times(100, seed=7) == p.times(100, seed=7)
    assert p.times(100, seed=7) != p.times(100, seed=8)
    slow, fast = ArrivalProcess(2.0).times(50, seed=3), ArrivalProcess(8.0).times(50, seed=3)
    assert slow[0] == fast[0] == 0.0
    assert all(s == pytest.approx(4 * f) for s, f in zip(slow, fast))
    g = ArrivalProcess(3.0, ArrivalKind.GAMMA, 0.5)
    assert g.times(100, seed=1) == g.times(100, seed=1)


def test_poisson_gaps_have_mean_one_over_rate_and_variance_its_square():
    rate = 5.0
    xs = gaps(ArrivalProcess(rate).times(N, seed=11))
    assert statistics.fmean(xs) == pytest.approx(1 / rate, rel=0.03)
    assert statistics.pvariance(xs) == pytest.approx(1 / rate**2, rel=0.06)


def test_poisson_counts_per_window_have_variance_equal_to_mean():
    rate, window = 10.0, 1.0
    times = ArrivalProcess(rate).times(N, seed=12)
    counts = [0] * int(times[-1] / window)
    for t in times:
        if int(t / window) < len(counts):
            counts[int(t / window)] += 1
    assert statistics.fmean(counts) == pytest.approx(rate * window, rel=0.03)
    assert statistics.pvariance(counts) / statistics.fmean(counts) == pytest.approx(1.0, abs=0.12)


@pytest.mark.parametrize("shape", [0.25, 1.0, 4.0])
def test_gamma_burstiness_sets_the_gaps_coefficient_of_variation(shape):
    rate = 2.0
    xs = gaps(ArrivalProcess(rate, ArrivalKind.GAMMA, shape).times(N, seed=13))
    mean = statistics.fmean(xs)
    assert mean == pytest.approx(1 / rate, rel=0.04)
    assert statistics.pvariance(xs) / mean**2 == pytest.approx(1 / shape, rel=0.12)


def test_duration_and_count_limits():
    p = ArrivalProcess(20.0)
    by_duration = p.times(None, seed=1, duration_s=5.0)
    assert by_duration[-1] < 5.0 and 50 < len(by_duration) < 200
    assert len(p.times(10, seed=1, duration_s=1000.0)) == 10
    assert p.times(5, seed=1, duration_s=1000.0) == by_duration[:5]
    assert ArrivalProcess(math.inf).times(4, seed=0) == [0.0] * 4


@pytest.mark.parametrize("kwargs, match", [
    (dict(rate=-1.0), "rate"), (dict(rate=0.0), "rate"), (dict(rate=float("nan")), "rate"),
    (dict(rate=1.0, kind=ArrivalKind.GAMMA, burstiness=0.0), "burstiness"),
    (dict(rate=1.0, burstiness=2.0), "burstiness"),
])
def test_bad_processes_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ArrivalProcess(**kwargs)


def test_a_run_needs_a_count_or_a_duration():
    with pytest.raises(ValueError, match="num_requests or duration_s"):
        ArrivalProcess(1.0).times(None, seed=0)
    with pytest.raises(ValueError, match="infinite rate"):
        ArrivalProcess(math.inf).times(None, seed=0, duration_s=1.0)
