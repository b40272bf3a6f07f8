"""Prometheus metrics every pdserve process shares: the `/metrics` endpoint, bucket boundaries,
and the workers' metrics, which both pools describe through the same `WorkerStats` message.

Names follow vLLM's (`vllm:` becomes `pdserve:`) so dashboards carry over. Each process keeps
its own `CollectorRegistry` (`new_registry`), never the global one, so tests can build
components twice; every registry carries the process metrics (`process_resident_memory_bytes`,
`process_cpu_seconds_total`, `process_open_fds`, `process_start_time_seconds`, …) and its
threads' CPU seconds by role (`thread_cpu.ThreadCpuCollector`: the engine thread's, the serving
loop's). No series has a `_created` twin: it doubles the series count and no dashboard of ours
reads it.

A worker's gauges and counters mirror state the servicer and engine already keep; they are
read when Prometheus scrapes (`WorkerCollector`), so no hot loop is touched. The scrape runs on
the worker's asyncio loop, like `GetStats`, and reads only sizes and ints that the engine thread
updates atomically under the GIL; counters read in one scrape may straddle an engine step.
"""
from __future__ import annotations

from typing import Callable, Iterable, Protocol

from aiohttp import web
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, ProcessCollector,
                               disable_created_metrics, generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.serving.thread_cpu import ThreadCpuCollector
from pdserve.v1 import worker_pb2

PREFIX = "pdserve:"
# an HTTP connection with no request in progress is closed after this (longer than the 60 s idle
# timeout of common load balancers, which then close first and never reuse a closed connection)
HTTP_IDLE_TIMEOUT_S = 75.0
disable_created_metrics()  # process-wide in prometheus_client: every pdserve process imports this module

# Seconds. LLM latencies span milliseconds (a decode step) to minutes (a long queue).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                         1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Bytes per second of one KV transfer: 1 MB/s (something is wrong) to 100 GB/s (NVLink-class).
BANDWIDTH_BUCKETS = tuple(m * 10.0 ** e for e in range(6, 11) for m in (1, 2.5, 5)) + (1e11,)


def new_registry() -> CollectorRegistry:
    """A process's registry, with the process metrics (memory, CPU seconds, fds, start time) and
    its long-lived threads' CPU seconds."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    registry.register(ThreadCpuCollector())
    return registry


def metrics_handler(registry: CollectorRegistry) -> Callable:
    """An aiohttp handler answering with the registry in Prometheus' text format."""

    async def handle(_request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    return handle


async def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve `GET /metrics` on the running asyncio loop; returns the runner (`await
    runner.cleanup()` stops it) and the bound port (`port` 0 picks a free one)."""
    app = web.Application()
    app.router.add_get("/metrics", metrics_handler(registry))
    return await start_http_app(app, host, port)


async def start_http_app(app: web.Application, host: str, port: int, ssl_context=None, reuse_port: bool = False,
                         keepalive_timeout: float = HTTP_IDLE_TIMEOUT_S, **runner_options) -> tuple[web.AppRunner, int]:
    """Serve an aiohttp app; returns its runner and the port it bound (`port` 0: a free one).
    `reuse_port`: SO_REUSEPORT, the port shared with other processes that set it too.
    `keepalive_timeout`: a connection with no request in progress (new, idle, or stalled in its
    headers) is closed after it (aiohttp's own default is an hour)."""
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=keepalive_timeout, **runner_options)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context, reuse_port=reuse_port or None)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return runner, site._server.sockets[0].getsockname()[1]


class StatsSource(Protocol):
    """A worker servicer: `info` is None while the model loads; `stats()` is what GetStats answers;
    `engine` is its engine once loaded (the collector reads its configuration and counters)."""

    info: worker_pb2.WorkerInfo | None

    def stats(self) -> worker_pb2.WorkerStats: ...

    @property
    def engine(self): ...


class WorkerMetrics:
    """One worker's metrics. Every series carries `model_name` and `worker` ("prefill" or
    "decode"). The servicer observes each completed KV transfer (`observe_transfer`); the rest
    is read from `source` at scrape time (`attach`)."""

    def __init__(self, worker: str, registry: CollectorRegistry | None = None):
        self.worker = worker
        self.registry = registry or new_registry()
        labels = ["model_name", "worker"]
        self._transfer = Histogram(PREFIX + "kv_transfer_seconds",
                                   "Duration of a completed KV transfer (the PushKV stream, which overlaps the "
                                   "prefill compute)", labels, registry=self.registry, buckets=TRANSFER_BUCKETS)
        self._bandwidth = Histogram(PREFIX + "kv_transfer_bandwidth_bytes_per_second",
                                    "Bytes per second of a completed KV transfer: its bytes over its duration",
                                    labels, registry=self.registry, buckets=BANDWIDTH_BUCKETS)
        self.model_name = ""  # set by `attach`, before the worker reports SERVING

    def attach(self, source: StatsSource, model_name: str) -> None:
        """Once the model is loaded: label the series with it and start reading `source`."""
        self.model_name = model_name
        for h in (self._transfer, self._bandwidth):
            h.labels(model_name, self.worker)  # the series exist before the first transfer
        self.registry.register(WorkerCollector(source, self.worker, model_name))

    def observe_transfer(self, seconds: float, num_bytes: int) -> None:
        self._transfer.labels(self.model_name, self.worker).observe(seconds)
        if seconds > 0:
            self._bandwidth.labels(self.model_name, self.worker).observe(num_bytes / seconds)


class WorkerCollector(Collector):
    """`WorkerStats` (and the engine's configuration) as Prometheus families, built afresh at
    each scrape."""

    def __init__(self, source: StatsSource, worker: str, model_name: str):
        self.source, self.labels = source, [model_name, worker]

    def collect(self) -> Iterable[Metric]:
        if self.source.info is None:  # still loading
            return
        st, info = self.source.stats(), self.source.info
        yield self._gauge("kv_cache_usage_perc", "KV cache usage: share of blocks held by requests (0-1)",
                          1.0 - st.num_free_blocks / st.num_blocks if st.num_blocks else 0.0)
        yield self._gauge("num_requests_running", "Requests in the engine's running queue", st.num_running)
        yield self._gauge("num_requests_waiting", "Requests in the engine's waiting queue", st.num_waiting)
        yield self._counter("prefix_cache_queries", "Prefix cache queries, in prompt tokens looked up at admission",
                            st.prefix_cache_queries_total)
        yield self._counter("prefix_cache_hits", "Prefix cache hits, in prompt tokens found cached",
                            st.prefix_cache_hits_total)
        yield self._counter("num_preemptions", "Sequences preempted by the engine (blocks freed, recomputed later)",
                            self.source.engine.scheduler.num_preemptions)
        yield self._counter("kv_transfer_bytes", "KV bytes of completed transfers (sent or received)",
                            st.kv_transfer_bytes_total)
        yield self._counter("kv_transfer_failures", "KV transfers that failed", st.kv_transfer_failures_total)
        yield self._cache_config(info)
        if info.role == "decode":
            yield self._counter("stream_messages", "Token deltas the requests' streams sent, a gRPC message each",
                                st.stream_messages_total)
            yield self._counter("stream_tokens", "Tokens in those deltas", st.stream_tokens_total)
            yield self._counter("stream_merged_outputs", "Outputs queued for a stream (an engine output, or a "
                                "stream_interval group) sent merged into a later delta because it had fallen "
                                "behind its engine (the serving loop busy)",
                                st.stream_merged_outputs_total)
        if info.role == "decode" and info.num_speculative_tokens > 0:
            yield from self._spec(st)

    def _cache_config(self, info: worker_pb2.WorkerInfo) -> GaugeMetricFamily:
        """vLLM's info-style gauge (always 1; the values are its labels), with vLLM's label names:
        `num_gpu_blocks` is the KV pool's size in blocks on whatever device it lives."""
        config = {"block_size": str(info.block_size), "num_gpu_blocks": str(info.num_blocks),
                  "cache_dtype": info.kv_dtype,
                  "enable_prefix_caching": str(bool(self.source.engine.config.enable_prefix_caching))}
        g = GaugeMetricFamily(PREFIX + "cache_config_info", "Information of the engine's KV cache configuration",
                              labels=["model_name", "worker", *config])
        g.add_metric([*self.labels, *config.values()], 1.0)
        return g

    def _spec(self, st: worker_pb2.WorkerStats) -> Iterable[Metric]:
        yield self._counter("spec_decode_num_drafts", "Speculative verification steps", st.spec_num_drafts)
        yield self._counter("spec_decode_num_draft_tokens", "Draft tokens proposed", st.spec_num_draft_tokens)
        yield self._counter("spec_decode_num_accepted_tokens", "Draft tokens accepted", st.spec_num_accepted_tokens)
        per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position in the draft",
                                      labels=["model_name", "worker", "position"])
        for pos, n in enumerate(st.spec_accepted_per_pos):
            per_pos.add_metric([*self.labels, str(pos)], n)
        yield per_pos

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name", "worker"])
        g.add_metric(self.labels, value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name", "worker"])
        c.add_metric(self.labels, value)
        return c
