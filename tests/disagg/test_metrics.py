"""Prometheus /metrics of the router and both workers, scraped around known traffic through R."""
from __future__ import annotations

from urllib.request import urlopen

import grpc
import pytest

from pdserve.v1 import generation_pb2 as gen
from procs import generate_all

NUM_TOKENS = 6
PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 40)), [3] * 17]
EMPTY = frozenset()


def _delta(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, frozenset(labels.items()))
    assert key in after, f"{name}{labels} missing; have {sorted(k[0] for k in after)}"
    return after[key] - before.get(key, 0.0)


@pytest.fixture(scope="module")
def traffic(cluster):
    """Scrapes of R, P and D before and after three greedy requests and one bad one through R."""
    cluster.wait_all_free(("P", "D"))
    names = ("R", "P", "D")
    before = {n: cluster.metrics(n) for n in names}
    requests = [gen.GenerateRequest(token_ids=gen.TokenIds(ids=ids), sampling_params=gen.SamplingParams(
        temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)) for ids in PROMPTS]
    responses = generate_all(cluster, "R", requests)
    with pytest.raises(grpc.RpcError) as err:
        list(cluster.generation("R").Generate(gen.GenerateRequest(prompt=""), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    cluster.wait_all_free(("P", "D"))
    return before, {n: cluster.metrics(n) for n in names}, responses


def test_router_counts_requests_and_tokens(traffic):
    before, after, responses = traffic
    d = lambda name, **labels: _delta(before["R"], after["R"], "pdserve:" + name, **labels)  # noqa: E731
    n = len(PROMPTS)
    assert all(sum(len(m.token_ids) for m in msgs) == NUM_TOKENS for msgs in responses)
    assert d("requests_total", status="ok") == n
    assert d("requests_total", status="invalid_argument") == 1
    assert d("prompt_tokens_total") == sum(map(len, PROMPTS))
    assert d("generation_tokens_total") == n * NUM_TOKENS
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "time_per_output_token_seconds"):
        assert d(hist + "_count") == n, hist
        assert d(hist + "_bucket", le="+Inf") == n, hist
    # one observation per token after each request's first delta
    assert d("inter_token_latency_seconds_count") == sum(NUM_TOKENS - len(msgs[0].token_ids) for msgs in responses)
    assert 0 < d("time_to_first_token_seconds_sum") <= d("e2e_request_latency_seconds_sum")


def test_workers_count_transfers_and_end_idle(traffic):
    before, after, _ = traffic
    sent = _delta(before["P"], after["P"], "pdserve:kv_transfer_bytes_total")
    received = _delta(before["D"], after["D"], "pdserve:kv_transfer_bytes_total")
    assert sent > 0 and sent == received
    for w in ("P", "D"):
        assert _delta(before[w], after[w], "pdserve:kv_transfer_seconds_count") == len(PROMPTS), w
        assert _delta(before[w], after[w], "pdserve:kv_transfer_failures_total") == 0, w
        for gauge in ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting"):
            assert after[w][("pdserve:" + gauge, EMPTY)] == 0, (w, gauge)


def test_spec_decode_counters_are_consistent(traffic, cluster):
    before, after, _ = traffic
    d = after["D"]
    assert _delta(before["D"], d, "pdserve:spec_decode_num_drafts_total") > 0
    accepted = d[("pdserve:spec_decode_num_accepted_tokens_total", EMPTY)]
    assert 0 < accepted <= d[("pdserve:spec_decode_num_draft_tokens_total", EMPTY)]
    per_pos = [d[("pdserve:spec_decode_num_accepted_tokens_per_pos_total", frozenset({("position", str(i))}))]
               for i in range(3)]
    assert per_pos == sorted(per_pos, reverse=True) and sum(per_pos) == accepted
    # P drafts nothing, and the colocated D2 does not speculate: no spec series there
    for w in ("P", "D2"):
        assert not any(name.startswith("pdserve:spec_decode") for name, _ in cluster.metrics(w)), w


def test_router_http_app_serves_metrics_too(traffic, cluster):
    with urlopen(f"http://{cluster.http_address}/metrics", timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    assert 'pdserve:requests_total{model_name="' in text and 'status="ok"' in text
