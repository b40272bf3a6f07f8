"""`EngineThread`: the one thread that owns an `LLMEngine` inside an asyncio server.

Handlers on the asyncio loop never touch the engine; they `call` a function on the engine
thread and await its result. Between commands the thread runs the owner's `step` while there is
work, so commands wait at most one step, and they run in the order they were issued.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from typing import Callable

log = logging.getLogger("pdserve.engine")


class EngineThread:
    def __init__(self, engine, aio_loop: asyncio.AbstractEventLoop, step: Callable[[], None],
                 has_work: Callable[[], bool], name: str, idle_wait_s: float = 0.05):
        self.engine = engine
        self.aio = aio_loop
        self._step, self._has_work = step, has_work
        self._idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

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

    def post(self, fn: Callable, *args) -> None:
        """From the engine thread: run fn(*args) on the asyncio loop, after everything posted before."""
        self.aio.call_soon_threadsafe(fn, *args)

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._drain(block=not self._has_work())
            if self._has_work():
                self._step()

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
