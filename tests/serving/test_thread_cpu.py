"""`ThreadCpuCollector`: each long-lived thread's own CPU clock under its role, the serving loop
found as the thread that answers the scrape; a thread that waits gains (almost) nothing."""
from __future__ import annotations

import asyncio
import threading
import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.serving.thread_cpu import ThreadCpuCollector, role_of


def _sample(registry: CollectorRegistry) -> dict[str, float]:
    text = generate_latest(registry).decode()
    return {s.labels["thread"]: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == "pdserve:thread_cpu_seconds_total"}


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_the_engine_thread_is_counted_by_its_own_clock_and_the_scraping_loop_as_server():
    registry = CollectorRegistry()
    registry.register(ThreadCpuCollector())
    go, done = threading.Event(), threading.Event()

    def engine():
        go.wait(30)
        _spin(0.3)
        done.wait(30)  # alive, idle, while the second scrape runs

    t = threading.Thread(target=engine, name="decode-engine", daemon=True)
    t.start()
    try:
        async def scrapes():
            first = _sample(registry)
            go.set()
            while t.is_alive() and _sample(registry).get("engine", 0.0) - first["engine"] < 0.29:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)  # the loop's thread waits: its clock barely moves
            return first, _sample(registry)

        first, second = asyncio.run(scrapes())
    finally:
        done.set()
        t.join(10)
    assert set(first) >= {"engine", "server"} and set(second) >= {"engine", "server"}
    assert second["engine"] - first["engine"] >= 0.29
    assert second["server"] >= first["server"] and second["server"] - first["server"] < 0.2
    # ended threads are not counted: the series would fall
    assert "engine" not in _sample(registry)


def test_a_scrape_off_any_loop_names_no_server_and_roles_come_from_names():
    registry = CollectorRegistry()
    registry.register(ThreadCpuCollector())
    assert "server" not in _sample(registry)
    assert role_of(threading.Thread(name="prefill-engine")) == "engine"
    assert role_of(threading.Thread(name="Thread-3 (_poll_wrapper)")) == "grpc_poller"
    assert role_of(threading.Thread(name="worker-1")) is None
