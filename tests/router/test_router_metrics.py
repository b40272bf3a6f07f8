"""`RouterMetrics` on hand-made request traces: which requests meet the SLOs, and how a TTFT is
split into stages (the times are set by hand, so the expected values are exact)."""
from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from pdserve.router.metrics import SLO, RequestTrace, RouterMetrics


def _value(metrics: RouterMetrics, name: str, **labels) -> float:
    value = metrics.registry.get_sample_value(name, {"model_name": "m", **labels})
    assert value is not None, (name, labels)
    return value


def _finished(metrics: RouterMetrics, ttft: float, token_times: list[float], prefill_s: float | None = 0.2,
              on_decode: bool = False):
    """A disaggregated request that arrived at 0, was reserved at 0.1, reached the router at
    ttft - 0.01 and sent one-token deltas at `ttft` + each of `token_times`; on_decode: its
    decode worker prefilled it (no prefill worker's account comes)."""
    trace = RequestTrace(arrival_s=0.0, num_prompt_tokens=7, first_admitted_s=0.1, admitted_s=0.1,
                         first_received_s=ttft - 0.01, prefill_s=prefill_s, prefilled_on_decode=on_decode)
    trace.first_token_s = trace.last_token_s = ttft
    trace.num_tokens = 1 + len(token_times)
    if token_times:
        trace.last_token_s = ttft + token_times[-1]
    metrics._observe_stages(trace)
    metrics.ended(trace, "ok", "length")
    return trace


def test_requests_meeting_both_slos_count_toward_goodput():
    m = RouterMetrics("m", slo=SLO(ttft_s=0.5, tpot_s=0.05))
    _finished(m, 0.4, [0.04, 0.08])  # tpot 0.04: meets both
    _finished(m, 0.6, [0.04, 0.08])  # misses the TTFT SLO
    _finished(m, 0.4, [0.1, 0.2])  # tpot 0.1: misses the TPOT SLO
    _finished(m, 0.5, [])  # one token: no TPOT to miss; TTFT exactly at the SLO meets it
    assert _value(m, "pdserve:request_slo_met_total") == 2
    assert _value(m, "pdserve:request_ttft_slo_met_total") == 3
    assert _value(m, "pdserve:request_success_total", finished_reason="length") == 4
    assert _value(m, "pdserve:request_time_per_output_token_seconds_count") == 3
    assert _value(m, "pdserve:slo_ttft_seconds") == 0.5 and _value(m, "pdserve:slo_tpot_seconds") == 0.05


def test_a_failed_request_counts_by_status_and_toward_nothing_else():
    m = RouterMetrics("m")
    trace = RequestTrace(arrival_s=0.0)
    m.ended(trace, "unavailable")
    m.ended(trace, "cancelled")  # only the first end counts
    assert _value(m, "pdserve:requests_total", status="unavailable") == 1
    assert _value(m, "pdserve:requests_total", status="cancelled") == 0
    assert _value(m, "pdserve:request_slo_met_total") == 0
    assert _value(m, "pdserve:e2e_request_latency_seconds_count") == 0


def test_ttft_stages_split_the_ttft_at_the_prefill_workers_account():
    m = RouterMetrics("m")
    _finished(m, 0.5, [0.1], prefill_s=0.25)
    got = {s: _value(m, "pdserve:time_to_first_token_stage_seconds_sum", stage=s)
           for s in ("queue", "prefill", "transfer", "delivery")}
    assert got == pytest.approx({"queue": 0.1, "prefill": 0.25, "transfer": 0.49 - 0.1 - 0.25, "delivery": 0.01})
    assert sum(got.values()) == pytest.approx(0.5)


def test_a_prefill_account_longer_than_the_wait_is_clamped_so_stages_still_add_up():
    m = RouterMetrics("m")
    _finished(m, 0.3, [], prefill_s=5.0)  # another clock's figure, longer than reserved -> first token
    got = {s: _value(m, "pdserve:time_to_first_token_stage_seconds_sum", stage=s)
           for s in ("queue", "prefill", "transfer", "delivery")}
    assert got["transfer"] == 0 and sum(got.values()) == pytest.approx(0.3)


def test_stages_wait_for_the_prefill_workers_answer():
    m = RouterMetrics("m")
    trace = _finished(m, 0.5, [], prefill_s=None)
    assert _value(m, "pdserve:time_to_first_token_stage_seconds_count", stage="queue") == 0
    m.prefilled(trace, attempt=1, prefill_s=0.2)  # a failed attempt's answer is not this one's
    assert _value(m, "pdserve:time_to_first_token_stage_seconds_count", stage="queue") == 0
    m.prefilled(trace, attempt=0, prefill_s=0.2)
    m.prefilled(trace, attempt=0, prefill_s=0.2)  # observed once
    assert _value(m, "pdserve:time_to_first_token_stage_seconds_count", stage="prefill") == 1


def test_no_created_series_and_process_metrics_present():
    text = generate_latest(RouterMetrics("m").registry).decode()
    assert "_created" not in text and "process_resident_memory_bytes" in text


def test_a_request_its_decode_worker_prefilled_is_staged_without_a_prefill_workers_answer():
    """Colocated, a prefill fallback, or a short uncached tail prefilled where the rest is cached:
    reserved -> first token at the router is all prefill, nothing transfer."""
    m = RouterMetrics("m")
    _finished(m, 0.5, [], prefill_s=None, on_decode=True)
    got = {s: _value(m, "pdserve:time_to_first_token_stage_seconds_sum", stage=s)
           for s in ("queue", "prefill", "transfer", "delivery")}
    assert got == pytest.approx({"queue": 0.1, "prefill": 0.49 - 0.1, "transfer": 0.0, "delivery": 0.01})
