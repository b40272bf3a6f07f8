"""The router's Prometheus metrics: the latencies a client sees, measured where they are true.

One `RequestTrace` follows a request from arrival (before validation) to its end; `Router`
feeds it as the request is admitted and as each token delta leaves for the client:

    arrival ──queue──► admitted ──prefill──► first token out (TTFT) ──decode──► last token out (e2e)

The names borrowed from vLLM mean what they mean there: `time_per_output_token_seconds` is
per token (vLLM's older name for the inter-token latency: the same observations), while
`request_time_per_output_token_seconds` is per finished request, (last − first token) /
(tokens − 1). `request_queue_time_seconds` + `request_prefill_time_seconds` is the TTFT.

TTFT by stage (`time_to_first_token_stage_seconds{stage}`), whose four observations for a
request add up to its TTFT exactly:

    queue     arrival → the decode worker that delivered the first token reserved its blocks
    prefill   the prefill worker's own account: the request received → its first token sampled
              (prefilled by the decode worker: colocated, no prefill worker healthy, or all but a
              short tail of the prompt cached there: reserved → the decode stream's first token
              reached the router, and the transfer stage is 0)
    transfer  the rest until the decode stream's first token reached the router: the KV
              transfer not hidden behind the prefill compute, activation, the network hops
    delivery  that token reached the router → its delta left for the client (detokenizing)

A disaggregated request's stages are known once both its first token and its prefill worker's
answer are in, in either order. Every series carries `model_name`. Requests that end without
finishing count in `requests_total` under their status (a gRPC code in lower case) and
observe no e2e latency; every labelled counter starts at 0 for each label value it can take.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.router.request import RequestState
from pdserve.serving.convert import FINISH_REASONS
from pdserve.serving.metrics import (PREFIX, REQUEST_LATENCY_BUCKETS, TOKEN_LATENCY_BUCKETS, TTFT_BUCKETS,
                                     new_registry)

# how a request ended: "ok" (finished), a gRPC code in lower case, or "error" (unexpected)
STATUSES = ("ok", *(c.name.lower() for c in grpc.StatusCode if c is not grpc.StatusCode.OK), "error")
TTFT_STAGES = ("queue", "prefill", "transfer", "delivery")
TOKEN_COUNT_BUCKETS = tuple(m * 10 ** e for e in range(7) for m in (1, 2, 5))  # 1 … 5,000,000 tokens


@dataclass(frozen=True, slots=True)
class SLO:
    """What a request must meet to count toward goodput: TTFT and mean time per output token."""

    ttft_s: float = 1.0
    tpot_s: float = 0.1

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SLO.{name} must be > 0, got {getattr(self, name)}")


@dataclass(slots=True)
class RequestTrace:
    """One request's progress at the router: its life-cycle state and its timestamps
    (time.monotonic())."""

    arrival_s: float
    state: RequestState = RequestState.RECEIVED
    num_prompt_tokens: int = 0
    num_tokens: int = 0  # sent to the client
    first_admitted_s: float | None = None  # the first reservation
    attempt: int = 0  # the attempt now running (failovers start new ones)
    admitted_s: float | None = None  # this attempt's reservation
    first_received_s: float | None = None  # the decode stream's first token reached the router
    first_token_s: float | None = None  # ... and its delta left for the client
    last_token_s: float | None = None
    prefill_s: float | None = None  # the prefill worker's own account, for this attempt
    prefilled_on_decode: bool = False  # this attempt's decode worker prefills the request itself
    is_staged: bool = False  # TTFT stages observed
    is_ended: bool = False

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """(last − first token) / (tokens − 1); None with fewer than two tokens."""
        if self.num_tokens < 2:
            return None
        return (self.last_token_s - self.first_token_s) / (self.num_tokens - 1)


class RouterMetrics:
    def __init__(self, model_name: str = "", registry: CollectorRegistry | None = None, slo: SLO = SLO()):
        self.registry = registry or new_registry()
        self.slo = slo
        self._model_name = model_name
        r, histogram = self.registry, self._histogram
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to the first token leaving for the client",
                              TTFT_BUCKETS)
        self._stages = Histogram(PREFIX + "time_to_first_token_stage_seconds",
                                 "TTFT by stage (queue, prefill, transfer, delivery); a request's stages add up "
                                 "to its TTFT", ["model_name", "stage"], registry=r, buckets=TTFT_BUCKETS)
        for stage in TTFT_STAGES:
            self._stages.labels(model_name, stage)
        self.itl = histogram("inter_token_latency_seconds", "Time between token deltas, per token",
                             TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Time per output token, per token (vLLM's older "
                              "name for the inter-token latency: the same observations)", TOKEN_LATENCY_BUCKETS)
        self.request_tpot = histogram("request_time_per_output_token_seconds", "Per finished request: (last - "
                                      "first token) / (tokens - 1)", TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the last token of a finished request",
                             REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to admission by a decode worker",
                                    REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "Per finished request: admission to its "
                                      "first token leaving for the client", REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "Per finished request: first to last token",
                                     REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds", "Per finished request: admission to "
                                        "its last token", REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens of a finished request",
                                               TOKEN_COUNT_BUCKETS)
        self.request_generation_tokens = histogram("request_generation_tokens", "Tokens generated for a finished "
                                                   "request", TOKEN_COUNT_BUCKETS)
        self._counters()

    def _histogram(self, name: str, doc: str, buckets) -> Histogram:
        return Histogram(PREFIX + name, doc, ["model_name"], registry=self.registry,
                         buckets=buckets).labels(self._model_name)

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(PREFIX + name, doc, ["model_name"], registry=self.registry).labels(self._model_name)

    def _counters(self) -> None:
        """The counters (and the SLOs' gauges); every labelled one starts at 0 for each value."""
        r, model_name, counter, slo = self.registry, self._model_name, self._counter, self.slo
        self._requests = Counter(PREFIX + "requests", "Requests by how they ended", ["model_name", "status"],
                                 registry=r)
        self._success = Counter(PREFIX + "request_success", "Finished requests by finish reason",
                                ["model_name", "finished_reason"], registry=r)
        for status in STATUSES:  # every series exists from the start: error panels show 0, not "no data"
            self._requests.labels(model_name, status)
        for reason in FINISH_REASONS:
            self._success.labels(model_name, reason)
        self.slo_met = counter("request_slo_met", "Finished requests that met both SLOs (TTFT and time per "
                               "output token): goodput is its rate")
        self.ttft_slo_met = counter("request_ttft_slo_met", "Finished requests whose TTFT met the TTFT SLO")
        for name, value, what in (("slo_ttft_seconds", slo.ttft_s, "TTFT"),
                                  ("slo_tpot_seconds", slo.tpot_s, "time per output token")):
            Gauge(PREFIX + name, f"The {what} SLO this router counts requests against", ["model_name"],
                  registry=r).labels(model_name).set(value)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests")
        self.generation_tokens = counter("generation_tokens", "Tokens sent to clients")
        self.failovers = counter("request_failovers", "Times a request was re-admitted on other workers after a "
                                 "worker failed mid-request")
        self.prefill_fallbacks = counter("request_prefill_fallbacks", "Requests a decode worker prefilled itself "
                                         "because no prefill worker was healthy")
        self.local_prefills = counter("request_local_prefills", "Disaggregated requests a decode worker prefilled "
                                      "itself because its prefix cache held all but a short tail of the prompt")

    @staticmethod
    def arrived() -> RequestTrace:
        return RequestTrace(time.monotonic())

    def admitted(self, trace: RequestTrace, attempt: int, num_prompt_tokens: int, on_decode: bool = False) -> None:
        """A decode worker reserved the request's blocks (`attempt` 0, or a failover's); on_decode:
        it prefills the request itself, and no prefill worker will answer."""
        now = time.monotonic()
        trace.attempt, trace.admitted_s, trace.prefill_s, trace.prefilled_on_decode = attempt, now, None, on_decode
        if trace.first_admitted_s is None:
            trace.first_admitted_s = now
            trace.num_prompt_tokens = num_prompt_tokens
            self.queue_time.observe(now - trace.arrival_s)
            self.prompt_tokens.inc(num_prompt_tokens)

    def prefilled(self, trace: RequestTrace, attempt: int, prefill_s: float) -> None:
        """The prefill worker of `attempt` answered: `prefill_s` from its request to its first token."""
        if attempt == trace.attempt:
            trace.prefill_s = prefill_s
            self._observe_stages(trace)

    def failed_over(self) -> None:
        self.failovers.inc()

    def received(self, trace: RequestTrace, num_tokens: int) -> None:
        """A token delta of `num_tokens` tokens came in from the decode worker."""
        if num_tokens and trace.first_received_s is None:
            trace.first_received_s = time.monotonic()

    def delta_out(self, trace: RequestTrace, num_tokens: int) -> None:
        """A delta of `num_tokens` tokens is leaving for the client."""
        if num_tokens == 0:
            return
        now = time.monotonic()
        if trace.last_token_s is None:
            trace.first_token_s = now
            self.ttft.observe(now - trace.arrival_s)
            self._observe_stages(trace)
        else:
            per_token = (now - trace.last_token_s) / num_tokens
            for _ in range(num_tokens):  # a speculative step delivers several tokens at once
                self.itl.observe(per_token)
                self.tpot.observe(per_token)
        trace.last_token_s = now
        trace.num_tokens += num_tokens
        self.generation_tokens.inc(num_tokens)

    def _observe_stages(self, trace: RequestTrace) -> None:
        """Once the first token is out (and, prefilled by a prefill worker, that one answered)."""
        if trace.is_staged or trace.first_token_s is None or trace.admitted_s is None:
            return
        received = trace.first_received_s if trace.first_received_s is not None else trace.first_token_s
        admitted_to_received = received - trace.admitted_s
        if not trace.prefilled_on_decode:
            if trace.prefill_s is None:
                return
            prefill = min(max(trace.prefill_s, 0.0), admitted_to_received)
        else:
            prefill = admitted_to_received
        trace.is_staged = True
        stages = {"queue": trace.admitted_s - trace.arrival_s, "prefill": prefill,
                  "transfer": admitted_to_received - prefill, "delivery": trace.first_token_s - received}
        for stage, seconds in stages.items():
            self._stages.labels(self._model_name, stage).observe(seconds)

    def ended(self, trace: RequestTrace, status: str, finished_reason: str | None = None) -> None:
        """A request `Router.generate` took ended ("ok": it finished, for `finished_reason`); only
        the first call counts."""
        if trace.is_ended:
            return
        trace.is_ended = True
        self.count(status)
        if status != "ok" or trace.last_token_s is None:
            return
        self._success.labels(self._model_name, finished_reason or "stop").inc()
        self.e2e.observe(trace.last_token_s - trace.arrival_s)
        self.prefill_time.observe(trace.first_token_s - trace.first_admitted_s)
        self.decode_time.observe(trace.last_token_s - trace.first_token_s)
        self.inference_time.observe(trace.last_token_s - trace.first_admitted_s)
        self.request_prompt_tokens.observe(trace.num_prompt_tokens)
        self.request_generation_tokens.observe(trace.num_tokens)
        tpot = trace.tpot_s
        if tpot is not None:
            self.request_tpot.observe(tpot)
        if trace.ttft_s <= self.slo.ttft_s:
            self.ttft_slo_met.inc()
            if tpot is None or tpot <= self.slo.tpot_s:
                self.slo_met.inc()

    def count(self, status: str) -> None:
        """A request ended with `status` (also for those rejected before admission)."""
        self._requests.labels(self._model_name, status).inc()

    def watch(self, router) -> None:
        """Read `router`'s own state at each scrape (`RouterCollector`)."""
        self.registry.register(RouterCollector(router, self._model_name))


class RouterCollector(Collector):
    """The router's queues and its view of the pools, read when Prometheus scrapes. Names of
    their own: vLLM's `num_requests_running`/`_waiting` are the engines' (the workers export
    them), and summing the router's count with theirs would count a request twice."""

    def __init__(self, router, model_name: str):
        self.router, self.model_name = router, model_name

    def collect(self) -> Iterable[Metric]:
        router, pool = self.router, self.router.pool
        yield self._gauge("router_num_requests_in_flight", "Requests the router has taken and not ended",
                          len(router.flights))
        yield self._gauge("router_num_requests_queued", "Requests waiting for a decode worker with room",
                          len(router.admission))
        yield self._gauge("router_ready", "1 while the router can serve (gRPC health SERVING, /ready 200)",
                          float(not router.is_draining and pool.missing() is None))
        healthy = GaugeMetricFamily(PREFIX + "router_healthy_workers", "Healthy workers per pool the router "
                                    "needs (prefill only when disaggregated)", labels=["model_name", "role"])
        for role in ("prefill", "decode") if pool.is_disaggregated else ("decode",):
            healthy.add_metric([self.model_name, role],
                               sum(1 for w in pool.of_role(role) if w.healthy and w.info is not None))
        yield healthy

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
        g.add_metric([self.model_name], value)
        return g
