"""`ThreadCpuCollector`: CPU seconds of a process's long-lived threads, by role, for `/metrics`.

`process_cpu_seconds_total` says how busy a process is, not which of its threads is busy, and a
worker is two single-threaded loops in one process: the engine thread (`EngineLoop`, which steps
the model) and the asyncio loop that serves gRPC (every token a request streams is one message
written there; the router relays each on its own loop). Either can be the one that caps the
process while the other waits, and the fix differs. So every registry carries

    pdserve:thread_cpu_seconds_total{thread="engine" | "server" | "grpc_poller"}

with `rate()` over it the share of a core each takes (1.0: that thread is saturated):

- engine: the threads named "<role>-engine" (`EngineLoop`);
- server: the thread that runs the asyncio loop answering the scrape (`/metrics` is served on
  the process's own loop: the workers' gRPC loop, the router's loop);
- grpc_poller: grpc.aio's completion-queue poller thread.

Only threads that live as long as the process are counted, so the counters never fall; threads
that come and go (executors) and threads Python does not know (grpc's core threads) are in
`process_cpu_seconds_total` only. Each figure is the thread's own CPU clock
(`pthread_getcpuclockid`), read at scrape time.
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Iterable

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

NAME = "pdserve:thread_cpu_seconds_total"


def role_of(thread: threading.Thread) -> str | None:
    """The role a long-lived thread is counted under (`server` is found otherwise), or None."""
    if thread.name.endswith("-engine"):
        return "engine"
    if "_poll_wrapper" in thread.name:  # grpc.aio's poller: "Thread-N (_poll_wrapper)"
        return "grpc_poller"
    return None


def thread_cpu_seconds(thread: threading.Thread) -> float | None:
    """The thread's CPU seconds so far, or None once it has ended (or where the clock is not
    available: not Linux)."""
    if thread.ident is None or not thread.is_alive():
        return None
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (AttributeError, OSError):  # no such clock on this platform, or the thread just ended
        return None


class ThreadCpuCollector(Collector):
    def __init__(self) -> None:
        self._server: threading.Thread | None = None  # the loop thread seen answering a scrape

    def collect(self) -> Iterable[Metric]:
        current = threading.current_thread()
        if self._server is None and _runs_a_loop():
            self._server = current
        seconds: dict[str, float] = {}
        for thread in threading.enumerate():
            role = "server" if thread is self._server else role_of(thread)
            if role is not None and (s := thread_cpu_seconds(thread)) is not None:
                seconds[role] = seconds.get(role, 0.0) + s
        family = CounterMetricFamily(NAME.removesuffix("_total"),
                                     "CPU seconds of the process's long-lived threads: engine (the model's steps), "
                                     "server (the asyncio loop serving gRPC and HTTP), grpc_poller", labels=["thread"])
        for role in sorted(seconds):
            family.add_metric([role], seconds[role])
        yield family


def _runs_a_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
