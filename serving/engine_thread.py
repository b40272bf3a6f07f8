"""`EngineLoop`: the one thread that owns a worker's `LLMEngine` inside an asyncio server.

Handlers on the asyncio loop never touch the engine; they `call` a function on the engine
thread and await its result. Between commands the thread steps the engine while it has work,
so a command waits at most one step, and commands run in the order they were issued. Each
step's outputs reach the requests' sinks on the asyncio loop in one hop, after everything
posted before them. A step that raises fails the requests it was running (their sinks get the
exception) instead of killing the worker. Both workers run exactly this loop.

`after_step`, when set, runs on the engine thread after each step, once the step's outputs are
posted: work that belongs to the step but need not delay its tokens (a prefill worker hands
over the step's K/V there).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from typing import Callable

log = logging.getLogger("pdserve.engine")

Sink = Callable[[object], None]  # gets each RequestOutput of its request, or the exception that ends it


class EngineStepFailed(Exception):
    pass


class EngineLoop:
    def __init__(self, engine, aio_loop: asyncio.AbstractEventLoop, name: str, idle_wait_s: float = 0.05):
        self.engine = engine
        self.aio = aio_loop
        self.sinks: dict[str, Sink] = {}  # req_id -> sink; asyncio loop only
        self._idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        # engine thread: after each step, with whether it succeeded (a failed step's requests are failed)
        self.after_step: Callable[[bool], None] | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopped.set()
        self._commands.put(None)
        self._thread.join(timeout=timeout_s)

    def call(self, fn: Callable) -> asyncio.Future:
        """Run fn(engine) on the engine thread; the returned future (awaitable on the asyncio
        loop, or ignorable: the command runs anyway) holds its result or exception."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, fut))
        return asyncio.wrap_future(fut, loop=self.aio)

    def deliver_soon(self, outputs: list) -> None:
        """From the engine thread: hand outputs to their sinks, after everything posted before."""
        self.aio.call_soon_threadsafe(self._deliver, outputs)

    # ---- engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopped.is_set():
            self._drain(block=not self.engine.has_unfinished())
            if self.engine.has_unfinished():
                self._step()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - one bad step must not kill the worker
            log.exception("engine step failed; failing the requests it ran")
            failed = self.engine.abort_unfinished()
            error = EngineStepFailed(f"engine step failed: {e!r}")
            self.aio.call_soon_threadsafe(self._deliver, [(req_id, error) for req_id in failed])
            self._after_step(False)
            return
        if outputs:
            self.deliver_soon(outputs)
        self._after_step(True)

    def _after_step(self, ok: bool) -> None:
        if self.after_step is None:
            return
        try:
            self.after_step(ok)
        except Exception:  # noqa: BLE001 - its requests fail on their own paths; the worker goes on
            log.exception("after-step work failed")

    def _drain(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=self._idle_wait_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fn, fut = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    # ---- asyncio loop --------------------------------------------------------------------
    def _deliver(self, outputs: list) -> None:
        for out in outputs:
            req_id, item = out if isinstance(out, tuple) else (out.req_id, out)
            sink = self.sinks.get(req_id)
            if sink is not None:
                sink(item)
