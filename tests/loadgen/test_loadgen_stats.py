"""Latency arithmetic, attainment and goodput against values worked out by hand."""
from __future__ import annotations

import math

import pytest

from pdserve.loadgen.goodput import Bisection, GoodputMethod, bisect, from_sweep
from pdserve.loadgen.records import RequestRecord
from pdserve.loadgen.stats import SLO, LatencySummary, attainment, percentile, summarize


def record(index, sent, deltas, status="OK", prompt=10):
    """deltas: [(time, num_tokens)] in seconds from the start of the run."""
    rec = RequestRecord(index, scheduled_s=sent, max_tokens=sum(n for _, n in deltas) or 1,
                        num_prompt_tokens=prompt, sent_s=sent, status=status)
    for t, n in deltas:
        rec.add_delta(t, n)
    rec.end_s = deltas[-1][0] if deltas else sent + 0.5
    return rec


def test_percentiles_interpolate_between_closest_ranks():
    xs = [4.0, 1.0, 3.0, 2.0]  # sorted: 1 2 3 4; position (n-1)q/100
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(xs, 90) == pytest.approx(3.7)
    assert percentile(xs, 99) == pytest.approx(3.97)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    s = LatencySummary.of(list(map(float, range(1, 101))))
    assert (s.mean, s.p50, s.p90, s.p99, s.max, s.count) == (50.5, 50.5, pytest.approx(90.1), pytest.approx(99.01),
                                                             100.0, 100)
    with pytest.raises(ValueError):
        percentile([], 50)


def test_one_request_ttft_tpot_itl_e2e():
    # sent at 1.0; deltas at 1.2 (1 token), 1.5 (3 tokens), 1.6 (1 token): 5 tokens
    rec = record(0, 1.0, [(1.2, 1), (1.5, 3), (1.6, 1)])
    assert rec.ttft_s == pytest.approx(0.2)
    assert rec.e2e_s == pytest.approx(0.6)
    assert rec.tpot_s == pytest.approx(0.4 / 4)
    assert rec.itls_s() == pytest.approx([0.1, 0.1, 0.1, 0.1])  # 0.3 s over 3 tokens, then 0.1 s
    one = record(1, 0.0, [(0.3, 1)])
    assert one.tpot_s is None and one.itls_s() == [] and one.e2e_s == pytest.approx(0.3)


def test_a_delta_without_tokens_does_not_count():
    rec = record(0, 0.0, [(0.1, 2), (0.2, 0), (0.4, 1)])
    assert rec.delta_tokens == [2, 1] and rec.e2e_s == pytest.approx(0.4)


def test_attainment_counts_failures_as_misses():
    recs = [record(0, 0.0, [(0.1, 1), (0.5, 4)]),  # ttft .1, tpot .1
            record(1, 0.0, [(0.3, 1), (0.4, 1)]),  # ttft .3: misses ttft .2
            record(2, 0.0, [(0.1, 1), (1.1, 2)]),  # tpot .5: misses tpot .2
            record(3, 0.0, [(0.1, 1)]),  # one token: no TPOT asked
            record(4, 0.0, [], status="RESOURCE_EXHAUSTED")]
    assert attainment(recs, SLO(ttft_s=0.2, tpot_s=0.2)) == pytest.approx(2 / 5)
    assert attainment(recs, SLO(ttft_s=0.2)) == pytest.approx(3 / 5)
    assert attainment(recs, SLO(tpot_s=0.2)) == pytest.approx(3 / 5)
    assert attainment(recs, SLO()) is None
    with pytest.raises(ValueError, match="ttft_s"):
        SLO(ttft_s=-1)


def test_summary_throughput_and_failures():
    recs = [record(0, 0.0, [(0.5, 1), (1.0, 3)], prompt=6), record(1, 1.0, [(1.5, 2), (2.0, 2)], prompt=4),
            record(2, 1.5, [], status="UNAVAILABLE")]
    s = summarize(recs, rate=2.0, slo=SLO(ttft_s=1.0))
    assert (s.num_requests, s.num_ok, s.failures) == (3, 2, {"UNAVAILABLE": 1})
    assert s.duration_s == pytest.approx(2.0)  # t = 0 to the last end (the failure ended at 2.0)
    assert s.request_throughput == pytest.approx(1.0)
    assert s.output_token_throughput == pytest.approx(8 / 2.0)
    assert s.total_token_throughput == pytest.approx((8 + 10) / 2.0)
    assert s.ttft.mean == pytest.approx(0.5) and s.e2e.mean == pytest.approx(1.0)
    assert s.tpot.p50 == pytest.approx((0.5 / 3 + 0.5 / 3) / 2)
    assert s.slo_attainment == pytest.approx(2 / 3)
    assert s.from_json(s.to_json()) == s


def test_goodput_from_a_sweep_best_swept_and_interpolated():
    swept, interp = from_sweep([(4.0, 0.80), (1.0, 1.0), (2.0, 0.95), (8.0, 0.99)])
    assert (swept.rate, swept.method, swept.failing_rate) == (2.0, GoodputMethod.SWEPT, 4.0)
    # the line from (2, 0.95) to (4, 0.80) crosses 0.9 at 2 + 0.05/0.15 * 2
    assert interp.rate == pytest.approx(2 + 2 / 3) and interp.method is GoodputMethod.INTERPOLATED
    everything, _ = from_sweep([(1.0, 1.0), (2.0, 0.9)])
    assert everything.rate == 2.0 and everything.is_lower_bound
    nothing, _ = from_sweep([(1.0, 0.5), (2.0, 0.95)])
    assert nothing.rate is None and nothing.failing_rate == 1.0 and "below 1" in nothing.describe()
    assert nothing.num_passing_above == 1 and "not monotone" in nothing.describe()
    wobbly, _ = from_sweep([(1.0, 1.0), (2.0, 0.8), (3.0, 0.5), (4.0, 0.95)])
    assert (wobbly.rate, wobbly.failing_rate, wobbly.num_passing_above) == (1.0, 2.0, 1)


def test_goodput_by_bisection():
    def step(rate):  # attainment falls below 90% past 5.3 req/s
        return 1.0 if rate <= 5.3 else 0.4

    g, points = bisect(step, 1.0, 16.0, steps=4)
    # geometric midpoints: 1 ok, 16 fail, 4 ok, 8 fail, √32 ≈ 5.66 fail, √(4·√32) ≈ 4.76 ok
    expected = [1.0, 16.0, 4.0, 8.0, math.sqrt(32), math.sqrt(4 * math.sqrt(32))]
    assert [r for r, _ in points] == pytest.approx(expected)
    assert (g.rate, g.failing_rate, g.method) == (pytest.approx(expected[5]), pytest.approx(expected[4]),
                                                   GoodputMethod.BISECTION)
    assert g.passing_rate == g.rate
    assert bisect(step, 8.0, 17.0, 4)[0].rate is None
    assert bisect(step, 1.0, 5.0, 4)[0].is_lower_bound
    with pytest.raises(ValueError, match="low < high"):
        Bisection(3.0, 2.0, 1)
    assert not math.isnan(g.rate)
