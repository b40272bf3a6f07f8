"""Logs and traces of one request across three real processes (prefill P, decode D, router R,
started here with `--otlp-endpoint`, `--log-level info` and `--log-format json`): a tiny
OTLP/HTTP collector on loopback receives every process's spans, which must share the client's
trace id and parent as the request flowed (client → router request → attempt → prefill and
decode spans); every process's JSON log lines name the request's id."""
from __future__ import annotations

import asyncio
import http.client
import json
import secrets
import threading
import time

import pytest
from aiohttp import web

from procs import Cluster, wait_ready


class Collector:
    """OTLP/HTTP (protobuf) trace receiver on 127.0.0.1, in a thread of its own."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        self._started.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/v1/traces", self._receive)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self._started.set()
        self._loop.run_forever()

    async def _receive(self, request: web.Request) -> web.Response:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                             ExportTraceServiceResponse)

        msg = ExportTraceServiceRequest.FromString(await request.read())
        for rs in msg.resource_spans:
            service = {a.key: a.value.string_value for a in rs.resource.attributes}.get("service.name")
            for ss in rs.scope_spans:
                with self._lock:
                    self.spans += [{"service": service, "name": s.name, "trace_id": s.trace_id.hex(),
                                    "span_id": s.span_id.hex(), "parent": s.parent_span_id.hex(),
                                    "start": s.start_time_unix_nano, "end": s.end_time_unix_nano} for s in ss.spans]
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    def of_trace(self, trace_id: str) -> list[dict]:
        with self._lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)


@pytest.fixture(scope="module")
def traced(serving_model, tmp_path_factory):
    collector = Collector()
    c = Cluster(serving_model, tmp_path_factory.mktemp("traced"))
    common = ["--otlp-endpoint", f"http://127.0.0.1:{collector.port}", "--log-level", "info", "--log-format", "json"]
    worker = ["--num-threads", "1", "--num-kv-blocks", "64", "--no-warmup", *common]
    try:
        wait_ready(c.start("P", "prefill-worker", *worker), c.start("D", "decode-worker", *worker))
        wait_ready(c.start_router("R", "--prefill", c.address("P"), "--decode", c.address("D"), "--http-port", "0",
                                  *common))
        yield c, collector
    finally:
        c.stop()
        collector.stop()


def test_one_request_is_one_trace_across_three_processes(traced):
    cluster, collector = traced
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    conn = http.client.HTTPConnection(cluster.procs["R"].addresses["http"], timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "def f(x):", "max_tokens": 6,
                                                             "ignore_eos": True}),
                 headers={"traceparent": f"00-{trace_id}-{client_span}-01", "Content-Type": "application/json"})
    resp = conn.getresponse()
    body = json.loads(resp.read())
    conn.close()
    assert resp.status == 200, body
    req_id = body["id"].removeprefix("cmpl-")

    want = {("pdserve-router", n) for n in ("pdserve.request", "admission", "attempt")}
    want |= {("pdserve-prefill-worker", n) for n in ("pdserve.prefill", "queue", "prefill", "push")}
    want |= {("pdserve-decode-worker", n) for n in ("pdserve.decode", "reservation", "transfer", "decode")}
    deadline = time.monotonic() + 30
    while not want <= {(s["service"], s["name"]) for s in collector.of_trace(trace_id)}:
        assert time.monotonic() < deadline, f"spans so far: {collector.of_trace(trace_id)}"
        time.sleep(0.2)
    spans = {(s["service"], s["name"]): s for s in collector.of_trace(trace_id)}
    root = spans["pdserve-router", "pdserve.request"]
    attempt = spans["pdserve-router", "attempt"]
    assert root["parent"] == client_span  # the client's traceparent is honoured
    assert spans["pdserve-router", "admission"]["parent"] == attempt["parent"] == root["span_id"]
    for worker, children in [("pdserve-prefill-worker", ("queue", "prefill", "push")),
                             ("pdserve-decode-worker", ("reservation", "transfer", "decode"))]:
        top = spans[worker, f"pdserve.{worker.split('-')[1]}"]
        assert top["parent"] == attempt["span_id"]  # parented by the router's attempt, over gRPC metadata
        assert all(spans[worker, c]["parent"] == top["span_id"] for c in children)
        assert all(spans[worker, c]["start"] <= spans[worker, c]["end"] for c in children)

    # every process logged the request under its id, one JSON object per line
    for name in ("R", "P", "D"):
        lines = [json.loads(line) for line in cluster.procs[name].log.read_text().splitlines() if line.startswith("{")]
        mine = [r for r in lines if r.get("req_id") == req_id]
        assert mine, f"{name} logged nothing for {req_id}"
    request_line = [r for r in json.loads("[" + ",".join(
        ln for ln in cluster.procs["R"].log.read_text().splitlines() if ln.startswith("{")) + "]")
        if r.get("msg") == "request" and r.get("req_id") == req_id]
    assert request_line and request_line[0]["status"] == "ok" and request_line[0]["completion_tokens"] == 6
    assert {"prompt_tokens", "ttft_s", "e2e_s", "failovers"} <= set(request_line[0])


def test_a_grpc_clients_traceparent_is_honoured(traced):
    from pdserve.client import Client

    cluster, collector = traced
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    with Client(cluster.address("R"), timeout=60, metadata={"traceparent": f"00-{trace_id}-{client_span}-01"}) as c:
        assert len(c.complete("import os", max_tokens=3, ignore_eos=True).token_ids) == 3
    deadline = time.monotonic() + 30
    # every process's spans, the router's root among them (it ends, and is exported, last)
    while len({s["service"] for s in collector.of_trace(trace_id)}) < 3 or \
            not any(s["name"] == "pdserve.request" for s in collector.of_trace(trace_id)):
        assert time.monotonic() < deadline, f"spans so far: {collector.of_trace(trace_id)}"
        time.sleep(0.2)
    (root,) = [s for s in collector.of_trace(trace_id) if s["name"] == "pdserve.request"]
    assert root["parent"] == client_span and root["service"] == "pdserve-router"
