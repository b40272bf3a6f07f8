"""OpenTelemetry spans of a request's path through every process, and the W3C trace context
(`traceparent`) that ties them together.

A client's `traceparent` (HTTP header or gRPC metadata) parents the router's span; the router
passes its attempt's context to both workers in gRPC metadata, beside the request id
(`serving.logs.REQUEST_ID_KEY`), and each worker parents its spans on that:

    router   pdserve.request ─┬─ admission
                              └─ attempt (one per failover) ──metadata──┐
    prefill  pdserve.prefill ─┬─ queue ─ prefill ─ push        ◄───────┤
    decode   pdserve.decode  ─┬─ reservation ─ transfer ─ decode ◄─────┘

Spans are exported over OTLP/HTTP (protobuf) when a process is given an endpoint
(`--otlp-endpoint`, `PDSERVE_OTLP_ENDPOINT`); without one the API's no-op tracer records
nothing, and the context still travels, so a downstream process that exports parents correctly.
"""
from __future__ import annotations

import time
from typing import Iterable, Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pdserve.serving.logs import REQUEST_ID_KEY, request_id

_propagator = TraceContextTextMapPropagator()
_provider = None


def setup_tracing(service_name: str, endpoint: str) -> None:
    """Export this process's spans to the OTLP/HTTP collector at `endpoint` (its /v1/traces)."""
    global _provider
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    _provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    exporter = OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces", timeout=5)
    _provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=200))
    trace.set_tracer_provider(_provider)


def shutdown_tracing() -> None:
    """Export what is left (at exit; also registered with atexit by the SDK)."""
    if _provider is not None:
        _provider.shutdown()


def tracer() -> trace.Tracer:
    return trace.get_tracer("pdserve")


def extract(carrier: Mapping[str, str] | Iterable[tuple[str, str]] | None) -> otel_context.Context | None:
    """The trace context in HTTP headers or gRPC metadata (None without a valid traceparent)."""
    if carrier is None:
        return None
    if not isinstance(carrier, Mapping):
        carrier = {k.lower(): v for k, v in carrier if isinstance(v, str)}
    ctx = _propagator.extract(carrier)
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def metadata_value(metadata: Iterable[tuple[str, str]] | None, key: str) -> str | None:
    for k, v in metadata or ():
        if k == key and isinstance(v, str):
            return v
    return None


def outgoing_metadata(req_id: str | None = None, span: trace.Span | None = None) -> tuple[tuple[str, str], ...]:
    """gRPC metadata for a call made on a request's behalf: its id and trace context (default:
    the current task's)."""
    carrier: dict[str, str] = {}
    ctx = trace.set_span_in_context(span) if span is not None else otel_context.get_current()
    _propagator.inject(carrier, ctx)
    req_id = req_id or request_id.get()
    return tuple(carrier.items()) + (((REQUEST_ID_KEY, req_id),) if req_id else ())


def wall_ns(perf_s: float) -> int:
    """A `time.perf_counter()` reading as epoch nanoseconds (spans recorded after the fact)."""
    return time.time_ns() - int((time.perf_counter() - perf_s) * 1e9)


class RequestSpans:
    """One process's spans of one request: a root span (parented by the incoming context) and
    named children, started and ended live or added after the fact from timestamps."""

    def __init__(self, name: str, parent: otel_context.Context | None, **attributes):
        self.root = tracer().start_span(name, context=parent, attributes=_attrs(attributes))
        self._ctx = trace.set_span_in_context(self.root)
        self._open: dict[str, trace.Span] = {}

    def start(self, name: str, **attributes) -> trace.Span:
        span = tracer().start_span(name, context=self._ctx, attributes=_attrs(attributes))
        self._open[name] = span
        return span

    def end(self, name: str) -> None:
        span = self._open.pop(name, None)
        if span is not None:
            span.end()

    def add(self, name: str, start_perf: float | None, end_perf: float | None, **attributes) -> None:
        if start_perf is None or end_perf is None:
            return
        span = tracer().start_span(name, context=self._ctx, start_time=wall_ns(start_perf),
                                   attributes=_attrs(attributes))
        span.end(end_time=wall_ns(end_perf))

    def finish(self, status: str = "ok", **attributes) -> None:
        """End every open child, then the root with its status. Idempotent."""
        for name in list(self._open):
            self.end(name)
        if not self.root.is_recording():
            return
        self.root.set_attributes(_attrs({"pdserve.status": status, **attributes}))
        if status != "ok":
            self.root.set_status(trace.Status(trace.StatusCode.ERROR, status))
        self.root.end()


def _attrs(values: dict) -> dict:
    return {k if "." in k else f"pdserve.{k}": v for k, v in values.items() if v is not None}
