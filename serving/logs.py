"""Logs of every pdserve process: one line per record on stderr, `text` (key=value) or `json`
(one object per line), quiet by default (warning); per-request lines are at info.

Records carry the id of the request being served when there is one: `request_context(req_id)`
sets it for the current task (asyncio tasks inherit it), and every record logged inside has
`req_id`. The router sends it to the workers in gRPC metadata (`REQUEST_ID_KEY`), the prefill
worker passes it on to the decode worker with the K/V, and each worker's handler sets it from
its call's metadata, so one grep finds a request in every process's log.

Structured fields: `log.info("request done", extra=fields(prompt_tokens=12, ...))` renders as
`msg=request done prompt_tokens=12` in text and as keys of the object in JSON.

Progress while a process starts (loading weights, allocating the KV cache, warming up) goes
through `progress(...)`, shown whatever the level, in the same format.
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import sys
import time
from dataclasses import dataclass

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
REQUEST_ID_KEY = "x-request-id"  # gRPC metadata (lower case, as gRPC requires)

request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("pdserve_request_id", default=None)
_progress_log = logging.getLogger("pdserve.progress")
_started = time.time()  # progress lines count seconds from here (the process start, near enough)


@dataclass(frozen=True, slots=True)
class Telemetry:
    """How a process logs and traces: what each composition root passes on to its children."""

    log_level: str = "warning"
    log_format: str = "text"
    otlp_endpoint: str | None = None  # OTLP/HTTP collector, e.g. http://127.0.0.1:4318; None: no spans

    def __post_init__(self) -> None:
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}")
        if self.otlp_endpoint is not None and not self.otlp_endpoint.startswith(("http://", "https://")):
            raise ValueError(f"otlp_endpoint must be an http:// or https:// URL, got {self.otlp_endpoint!r}")

    def setup(self, service_name: str) -> None:
        """Configure this process's logging (and span export, when an endpoint is set)."""
        setup_logging(self.log_level, self.log_format)
        if self.otlp_endpoint:
            from pdserve.serving.tracing import setup_tracing

            setup_tracing(service_name, self.otlp_endpoint)


def fields(**values) -> dict:
    """`extra=` for a structured record."""
    return {"fields": values}


@contextlib.contextmanager
def request_context(req_id: str | None):
    token = request_id.set(req_id)
    try:
        yield
    finally:
        request_id.reset(token)


def progress(message: str) -> None:
    """A start-up step, shown at any log level."""
    _progress_log.info(message)


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "req_id"):
            record.req_id = request_id.get()
        return True


class _ClientGoneFilter(logging.Filter):
    """grpc.aio logs an ERROR with a traceback ("ExecuteBatchError raised in core by servicer
    method") when a handler writes a response to a call whose client has already gone, cancelled
    or past its deadline, between the handler's last await and the write. Nothing failed here:
    the call is over, and the handler is cancelled as for any client that leaves. The record
    becomes one debug line, without the traceback. Seen once in ~1000 fuzzed requests (the fuzz
    test's check that no process logs a traceback)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[0] if record.exc_info else None
        if exc is None or exc.__name__ != "ExecuteBatchError":
            return True
        record.msg, record.args = f"{record.getMessage()}: the client had gone before the write", ()
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        record.exc_info = record.exc_text = None
        return logging.getLogger().isEnabledFor(logging.DEBUG)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        if record.name == _progress_log.name:
            return f"[{record.created - _started:5.1f}s] {record.getMessage()}"
        parts = [f"ts={self.formatTime(record)}", f"level={record.levelname}", f"logger={record.name}"]
        if record.req_id:
            parts.append(f"req_id={record.req_id}")
        parts.append(f"msg={record.getMessage()}")
        parts += [f"{k}={_text(v)}" for k, v in getattr(record, "fields", {}).items()]
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        obj = {"ts": round(record.created, 6), "level": record.levelname.lower(), "logger": record.name,
               "msg": record.getMessage()}
        if record.name == _progress_log.name:
            obj["progress"] = True
        if record.req_id:
            obj["req_id"] = record.req_id
        obj.update(getattr(record, "fields", {}))
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return json.dumps(obj, default=str)


def setup_logging(level: str = "warning", fmt: str = "text") -> None:
    """One stderr handler in `fmt` on the root logger (replacing the one an earlier call added)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(_RequestIdFilter())
    handler.is_pdserve = True
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "is_pdserve", False):
            root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))
    _progress_log.setLevel(logging.INFO)  # start-up progress is shown at any level
    grpc_core = logging.getLogger("grpc._cython.cygrpc")
    if not any(isinstance(f, _ClientGoneFilter) for f in grpc_core.filters):
        grpc_core.addFilter(_ClientGoneFilter())
    logging.captureWarnings(True)


def _text(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    text = str(value)
    return json.dumps(text) if (" " in text or not text) else text
