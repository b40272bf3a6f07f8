"""`DecodeLoop`: the decode worker's engine thread, stepping the engine and fanning each step's
outputs out to per-request sinks on the asyncio loop, in one hop per step."""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

from pdserve.serving.engine_thread import EngineThread
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput

log = logging.getLogger("pdserve.decode")

Sink = Callable[[object], None]  # a RequestOutput, or an exception that ends the request; asyncio loop only


class DecodeLoop:
    def __init__(self, engine: LLMEngine, aio_loop: asyncio.AbstractEventLoop):
        self.engine = engine
        self.sinks: dict[str, Sink] = {}  # touched on the asyncio loop only
        self.thread = EngineThread(engine, aio_loop, self._step, engine.has_unfinished, "decode-loop")
        self.call = self.thread.call

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.thread.stop()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:  # one bad step must not kill the worker: its requests end with ABORT
            log.exception("engine step failed; aborting every request")
            outputs = self._abort_all()
        if outputs:
            self.deliver_soon(outputs)

    def _abort_all(self) -> list[RequestOutput]:
        sched = self.engine.scheduler
        ids = [s.req_id for s in (*sched.running, *sched.waiting)]
        return [out for rid in ids if (out := self.engine.abort(rid)) is not None]

    def deliver_soon(self, outputs: list[RequestOutput]) -> None:
        """From the engine thread: hand outputs to their sinks, after everything delivered before."""
        self.thread.post(self._deliver, outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            sink = self.sinks.get(out.req_id)
            if sink is not None:
                sink(out)
