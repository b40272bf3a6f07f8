"""`ServingActor`: what a worker's and a router's Ray actor share. The process serves on an
asyncio loop in a thread of its own (Ray's calls arrive on other threads), and registers with
the controller as a `Member` once it listens; `ready` waits for that, `stop` drains, and a
restart (Ray's, after the process died) that cannot serve exits after a pause, so that Ray
tries again. A subclass says what it serves (`_serve`) and calls `_registered` once it listens.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import warnings
from dataclasses import dataclass

import ray

from pdserve.serving.logs import Telemetry

log = logging.getLogger("pdserve.cluster")


class StartFailed(RuntimeError):
    """A worker or router did not come to serve; the message names it and says why."""


@dataclass(frozen=True, slots=True)
class Member:
    """A serving worker or router, as it registers."""

    worker_id: str  # "prefill-0", "decode-3", "router-1": the pool and a number never reused
    role: str  # prefill, decode or router
    address: str  # gRPC
    metrics_address: str
    node_id: str
    pid: int
    is_restart: bool  # Ray restarted this process after it died


class ServingActor:
    def __init__(self, member_id: str, role: str, telemetry: Telemetry, controller):
        telemetry.setup(f"pdserve-{role}")
        self.member_id, self.role, self.controller = member_id, role, controller
        self.member: Member | None = None
        self.error: str | None = None
        self._ready = threading.Event()
        self._done = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        ctx = ray.get_runtime_context()
        self._node_id = ctx.get_node_id()
        with warnings.catch_warnings():  # Ray warns about its own use of a deprecated call here
            warnings.simplefilter("ignore")
            self._is_restart = bool(ctx.was_current_actor_reconstructed)
        threading.Thread(target=self._run, name=f"pdserve-{member_id}", daemon=True).start()

    # ---- called through Ray --------------------------------------------------------------
    def ready(self, timeout_s: float) -> Member:
        """The registration, once it serves; StartFailed if it failed to start."""
        if not self._ready.wait(timeout_s):
            raise StartFailed(f"{self._what} not serving after {timeout_s:g} s")
        if self.error is not None:
            raise StartFailed(f"{self._what} failed to start: {self.error}")
        return self.member

    def stop(self, timeout_s: float) -> None:
        """Drain (new requests refused, live ones get the drain timeout) and stop serving."""
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._done.wait(timeout_s)

    def pid(self) -> int:
        return os.getpid()

    # ---- its own thread ------------------------------------------------------------------
    @property
    def _what(self) -> str:
        return f"{'' if self.role == 'router' else 'worker '}{self.member_id}"

    async def _serve(self, stopping: asyncio.Event) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._stop = asyncio.Event()
            self._loop.run_until_complete(self._serve(self._stop))
        except Exception as e:  # noqa: BLE001 - reported through `ready`
            if isinstance(e, (ValueError, OSError)):  # what it was given is wrong, or a port: its message says what
                log.error("%s cannot start: %s", self._what, e)
                self.error = str(e)
            else:
                log.exception("%s failed", self._what)
                self.error = repr(e)
            self._ready.set()
            if self._is_restart:  # a restart that cannot serve: let Ray try again, not too fast
                time.sleep(5)
                os._exit(1)
        finally:
            self._done.set()

    def _registered(self, address: str, metrics_address: str) -> None:
        """It serves at these addresses: tell the controller, and `ready`."""
        self.member = Member(self.member_id, self.role, address, metrics_address, self._node_id, os.getpid(),
                             self._is_restart)
        self.controller.register.remote(self.member)
        self._ready.set()
