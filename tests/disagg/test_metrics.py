"""Prometheus /metrics of the router and both workers, scraped around known traffic through R."""
from __future__ import annotations

from urllib.error import HTTPError
from urllib.request import urlopen

import grpc
import pytest

from pdserve.v1 import generation_pb2 as gen
from procs import NUM_KV_BLOCKS, generate_all

NUM_TOKENS = 48  # long enough that D speculates: it decodes plainly until a draft's K/V land (KVTargetReady)
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
                 "request_time_per_output_token_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds", "request_prompt_tokens",
                 "request_generation_tokens"):
        assert d(hist + "_count") == n, hist
        assert d(hist + "_bucket", le="+Inf") == n, hist
    # one observation per token after each request's first delta; vLLM's older name has the same ones
    num_later_tokens = sum(NUM_TOKENS - len(msgs[0].token_ids) for msgs in responses)
    assert d("inter_token_latency_seconds_count") == d("time_per_output_token_seconds_count") == num_later_tokens
    assert d("inter_token_latency_seconds_sum") == pytest.approx(d("time_per_output_token_seconds_sum"))
    assert 0 < d("time_to_first_token_seconds_sum") <= d("e2e_request_latency_seconds_sum")
    # queue + prefill is the TTFT, prefill + decode the inference time
    assert d("request_queue_time_seconds_sum") + d("request_prefill_time_seconds_sum") == \
        pytest.approx(d("time_to_first_token_seconds_sum"))
    assert d("request_prefill_time_seconds_sum") + d("request_decode_time_seconds_sum") == \
        pytest.approx(d("request_inference_time_seconds_sum"))
    assert d("request_prompt_tokens_sum") == sum(map(len, PROMPTS))
    assert d("request_generation_tokens_sum") == n * NUM_TOKENS
    # ignore_eos and max_tokens: every one finished for its length
    assert d("request_success_total", finished_reason="length") == n
    assert d("request_success_total", finished_reason="stop") == d("request_success_total", finished_reason="abort") == 0


def test_labelled_counters_start_at_zero_for_every_value(cluster):
    """Error panels show 0, not "no data": every status and finish reason exists before it happens
    (R2 is never sent a request that fails for being unavailable or that aborts)."""
    m = cluster.metrics("R2")
    for status in ("ok", "unavailable", "resource_exhausted", "deadline_exceeded", "internal", "error"):
        assert ("pdserve:requests_total", frozenset({("status", status)})) in m, status
    for reason in ("stop", "length", "abort"):
        assert ("pdserve:request_success_total", frozenset({("finished_reason", reason)})) in m, reason
    assert m[("pdserve:request_success_total", frozenset({("finished_reason", "abort")}))] == 0


def test_every_process_has_process_metrics_and_no_created_series(cluster):
    for name in ("R", "P", "D"):
        m = cluster.metrics(name)
        assert m[("process_resident_memory_bytes", EMPTY)] > 0 and m[("process_open_fds", EMPTY)] > 0, name
        assert m[("process_start_time_seconds", EMPTY)] > 0 and ("process_cpu_seconds_total", EMPTY) in m, name
        assert not [s for s, _ in m if s.endswith("_created")], name


def test_router_exports_its_queues_and_its_view_of_the_pools(traffic, cluster):
    for name, roles in (("R", {"prefill", "decode"}), ("R2", {"decode"})):
        m = cluster.metrics(name)
        healthy = {dict(labels)["role"]: v for (s, labels), v in m.items() if s == "pdserve:router_healthy_workers"}
        assert healthy == {role: 1 for role in roles}, (name, healthy)
        assert m[("pdserve:router_ready", EMPTY)] == 1
    after = traffic[1]["R"]
    assert after[("pdserve:router_num_requests_in_flight", EMPTY)] == 0
    assert after[("pdserve:router_num_requests_queued", EMPTY)] == 0
    assert after[("pdserve:slo_ttft_seconds", EMPTY)] == 1.0 and after[("pdserve:slo_tpot_seconds", EMPTY)] == 0.1


def test_workers_count_transfers_and_end_idle(traffic):
    before, after, _ = traffic
    sent = _delta(before["P"], after["P"], "pdserve:kv_transfer_bytes_total")
    received = _delta(before["D"], after["D"], "pdserve:kv_transfer_bytes_total")
    assert sent > 0 and sent == received
    for w in ("P", "D"):
        assert _delta(before[w], after[w], "pdserve:kv_transfer_seconds_count") == len(PROMPTS), w
        assert _delta(before[w], after[w], "pdserve:kv_transfer_bandwidth_bytes_per_second_count") == len(PROMPTS), w
        assert _delta(before[w], after[w], "pdserve:kv_transfer_bandwidth_bytes_per_second_sum") > 0, w
        assert _delta(before[w], after[w], "pdserve:num_preemptions_total") == 0, w
        info = [dict(labels) for (s, labels), v in after[w].items() if s == "pdserve:cache_config_info" and v == 1]
        assert info == [{"block_size": "16", "num_gpu_blocks": str(NUM_KV_BLOCKS), "cache_dtype": "float32",
                         "enable_prefix_caching": "True"}], (w, info)
        assert _delta(before[w], after[w], "pdserve:kv_transfer_failures_total") == 0, w
        for gauge in ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting"):
            assert after[w][("pdserve:" + gauge, EMPTY)] == 0, (w, gauge)


def test_prefill_worker_counts_prefix_cache_queries_and_hits_in_tokens(traffic):
    before, after, _ = traffic
    queries = _delta(before["P"], after["P"], "pdserve:prefix_cache_queries_total")
    hits = _delta(before["P"], after["P"], "pdserve:prefix_cache_hits_total")
    assert queries == sum(map(len, PROMPTS)) and 0 <= hits <= queries


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


def test_decode_worker_counts_its_streams_messages_tokens_and_merges(traffic, cluster):
    before, after, responses = traffic
    d = lambda name: _delta(before["D"], after["D"], "pdserve:" + name)  # noqa: E731
    # D streams every token the client got (the router strips the prefill worker's first token
    # from D's first delta, having sent it already), in at most one message per token
    assert d("stream_tokens_total") == len(PROMPTS) * NUM_TOKENS
    assert len(PROMPTS) <= d("stream_messages_total") <= d("stream_tokens_total")
    assert d("stream_merged_outputs_total") >= 0
    assert not any(name.startswith("pdserve:stream_") for name, _ in cluster.metrics("P"))  # decode workers only


def test_router_http_app_serves_metrics_too(traffic, cluster):
    with urlopen(f"http://{cluster.http_address}/metrics", timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    assert 'pdserve:requests_total{model_name="' in text and 'status="ok"' in text
    # HTTP service discovery is `pdserve serve`'s (tests/cluster); a standalone router has no list
    with pytest.raises(HTTPError) as err:
        urlopen(f"http://{cluster.http_address}/prometheus/targets", timeout=10)
    assert err.value.code == 404


def _stages(m: dict) -> dict[str, tuple[float, float]]:
    """{stage: (sum, count)} of the TTFT-by-stage histogram, and "ttft" of the TTFT's own."""
    out = {dict(labels)["stage"]: (v, m[("pdserve:time_to_first_token_stage_seconds_count", labels)])
           for (s, labels), v in m.items() if s == "pdserve:time_to_first_token_stage_seconds_sum"}
    out["ttft"] = (m[("pdserve:time_to_first_token_seconds_sum", EMPTY)],
                   m[("pdserve:time_to_first_token_seconds_count", EMPTY)])
    return out


@pytest.mark.parametrize("router", ["R", "R2"])
def test_ttft_stages_add_up_to_each_requests_ttft(cluster, router):
    """One request at a time: its four stage observations sum to its TTFT observation. A
    disaggregated request's stages wait for the prefill worker's answer, which may come after
    the client has its last token, hence the polling."""
    import time

    for i, prompt in enumerate(PROMPTS):
        before = _stages(cluster.metrics(router))
        request = gen.GenerateRequest(token_ids=gen.TokenIds(ids=prompt), sampling_params=gen.SamplingParams(
            temperature=0, max_tokens=3 + i, ignore_eos=True))
        assert list(cluster.generation(router).Generate(request, timeout=60))
        deadline = time.monotonic() + 20
        while (after := _stages(cluster.metrics(router)))["queue"][1] == before["queue"][1]:
            assert time.monotonic() < deadline, "no TTFT stages observed"
            time.sleep(0.05)
        d = {k: (after[k][0] - before[k][0], after[k][1] - before[k][1]) for k in after}
        assert {k: n for k, (_, n) in d.items()} == {"queue": 1, "prefill": 1, "transfer": 1, "delivery": 1,
                                                     "ttft": 1}, d
        assert sum(d[s][0] for s in ("queue", "prefill", "transfer", "delivery")) == pytest.approx(d["ttft"][0],
                                                                                               abs=1e-9), d
        assert all(seconds >= 0 for seconds, _ in d.values()) and d["prefill"][0] > 0, d
        if router == "R2":  # colocated: the decode worker prefills, nothing is transferred
            assert d["transfer"][0] == 0


def _exported_names(cluster, name: str) -> set[str]:
    """Metric names as documented: counters with `_total`, histograms without their suffixes."""
    from prometheus_client.parser import text_string_to_metric_families

    with urlopen(f"http://{cluster.procs[name].addresses['metrics']}/metrics", timeout=10) as resp:
        families = text_string_to_metric_families(resp.read().decode())
        return {f.name + ("_total" if f.type == "counter" else "") for f in families}


def test_the_readme_metric_table_is_exactly_what_is_exported(traffic, cluster):
    from deploy_files import documented_metrics

    exported = set().union(*(_exported_names(cluster, n) for n in ("R", "P", "D")))
    assert exported == documented_metrics(), (sorted(exported - documented_metrics()),
                                              sorted(documented_metrics() - exported))


def test_each_process_counts_its_threads_cpu_by_role(traffic):
    """The workers' engine threads stepped the traffic and their serving loops streamed it; the
    router relayed it on its loop. Every process reads its threads' clocks at each scrape."""
    before, after, _ = traffic
    for name, roles in (("P", ("engine", "server")), ("D", ("engine", "server")), ("R", ("server",))):
        for role in roles:
            assert _delta(before[name], after[name], "pdserve:thread_cpu_seconds_total", thread=role) > 0, (name, role)
        threads = sum(v for (s, labels), v in after[name].items() if s == "pdserve:thread_cpu_seconds_total")
        assert threads <= after[name][("process_cpu_seconds_total", EMPTY)] + 0.05, name
    assert ("pdserve:thread_cpu_seconds_total", frozenset({("thread", "engine")})) not in after["R"]
