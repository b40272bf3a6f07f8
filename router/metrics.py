"""The router's Prometheus metrics: the latencies a client sees, measured where they are true.

One `RequestTrace` follows a request from arrival (before validation) to its end; `Router`
feeds it as the request is admitted and as each token delta leaves for the client:

    arrival ──queue_time──► admitted ──► first delta out (TTFT) ──ITL per token──► last delta (e2e)

Every series carries `model_name`. Requests that end without finishing count in
`requests_total` under their status (a gRPC code in lower case) and observe no e2e latency.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram

from pdserve.router.request import RequestState
from pdserve.serving.metrics import PREFIX, REQUEST_LATENCY_BUCKETS, TOKEN_LATENCY_BUCKETS, TTFT_BUCKETS


@dataclass(slots=True)
class RequestTrace:
    """One request's progress at the router: its life-cycle state and its timestamps."""

    arrival_s: float  # time.monotonic()
    state: RequestState = RequestState.RECEIVED
    num_tokens: int = 0  # sent to the client
    first_token_s: float | None = None
    last_token_s: float | None = None
    is_ended: bool = False


class RouterMetrics:
    def __init__(self, model_name: str = "", registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r, labels = self.registry, ["model_name"]

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, registry=r, buckets=buckets).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Arrival to the first token leaving for the client",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between token deltas, per token",
                             TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Per request: (e2e - TTFT) / (tokens - 1)",
                              TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the last token of a finished request",
                             REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to admission by a decode worker",
                                    REQUEST_LATENCY_BUCKETS)
        self._requests = Counter(PREFIX + "requests", "Requests by how they ended", ["model_name", "status"],
                                 registry=r)
        self._model_name = model_name
        self._requests.labels(model_name, "ok")  # the series exists from the start
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of admitted requests", labels,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens sent to clients", labels,
                                         registry=r).labels(model_name)
        self.failovers = Counter(PREFIX + "request_failovers", "Times a request was re-admitted on other workers "
                                 "after a worker failed mid-request", labels, registry=r).labels(model_name)

    @staticmethod
    def arrived() -> RequestTrace:
        return RequestTrace(time.monotonic())

    def admitted(self, trace: RequestTrace, num_prompt_tokens: int) -> None:
        self.queue_time.observe(time.monotonic() - trace.arrival_s)
        self.prompt_tokens.inc(num_prompt_tokens)

    def failed_over(self) -> None:
        self.failovers.inc()

    def delta_out(self, trace: RequestTrace, num_tokens: int) -> None:
        """A delta of `num_tokens` tokens is leaving for the client."""
        if num_tokens == 0:
            return
        now = time.monotonic()
        if trace.last_token_s is None:
            trace.first_token_s = now
            self.ttft.observe(now - trace.arrival_s)
        else:
            per_token = (now - trace.last_token_s) / num_tokens
            for _ in range(num_tokens):  # a speculative step delivers several tokens at once
                self.itl.observe(per_token)
        trace.last_token_s = now
        trace.num_tokens += num_tokens
        self.generation_tokens.inc(num_tokens)

    def ended(self, trace: RequestTrace, status: str) -> None:
        """A request `Router.generate` took ended ("ok": it finished); only the first call counts."""
        if trace.is_ended:
            return
        trace.is_ended = True
        self.count(status)
        if status != "ok" or trace.last_token_s is None:
            return
        self.e2e.observe(trace.last_token_s - trace.arrival_s)
        if trace.num_tokens > 1:
            self.tpot.observe((trace.last_token_s - trace.first_token_s) / (trace.num_tokens - 1))

    def count(self, status: str) -> None:
        """A request ended with `status` (also for those rejected before admission)."""
        self._requests.labels(self._model_name, status).inc()
