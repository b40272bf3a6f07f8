"""`PrefillLoop`: the prefill worker's engine thread.

Life cycle of a request here (the queues of `engine.disagg`):

    add ──► waiting ──► prefilling (chunked, under the step's token budget; each layer's K/V
        handed to the request's KVSender as the layer finishes) ──► first token sampled,
        trailer sent ──► detached (blocks kept) ──PushKV acknowledged or failed──► released

The target's K/V stream layer by layer from inside the forward pass; other KV groups (a draft
model's) are sent after the step, for the same token ranges.
"""
from __future__ import annotations

import asyncio
import logging

from pdserve.engine.disagg import PrefillChunk, kv_cache_groups, prefill_step, read_kv
from pdserve.serving.engine_thread import EngineThread
from pdserve.engine.llm_engine import LLMEngine
from pdserve.prefill_worker.kv_sender import KVSender

log = logging.getLogger("pdserve.prefill")


class PrefillLoop:
    def __init__(self, engine: LLMEngine, aio_loop: asyncio.AbstractEventLoop):
        self.engine = engine
        self.senders: dict[str, KVSender] = {}  # engine thread only
        self.thread = EngineThread(engine, aio_loop, self._step, engine.scheduler.has_unfinished, "prefill-loop")
        self.call = self.thread.call

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.thread.stop()

    def _step(self) -> None:
        groups = kv_cache_groups(self.engine)
        try:
            out = prefill_step(self.engine, lambda layer, chunks: self._send_layer(0, groups[0][1], layer, chunks))
            for g, (_, cache) in enumerate(groups[1:], start=1):
                for layer in range(len(cache)):
                    self._send_layer(g, cache, layer, out.chunks)
        except Exception as e:  # one bad step must not kill the worker: its requests fail
            log.exception("prefill step failed; failing every queued request")
            self._fail_all(f"prefill step failed: {e!r}")
            return
        for done in out.done:
            sender = self.senders.pop(done.seq.req_id, None)
            if sender is not None:
                sender.finish(done.first_token)

    def _send_layer(self, group: int, cache, layer: int, chunks: list[PrefillChunk]) -> None:
        for c in chunks:
            sender = self.senders.get(c.seq.req_id)
            if sender is not None:
                sender.send(group, layer, c.token_start, read_kv(cache, layer, c.slots))

    def _fail_all(self, reason: str) -> None:
        sched = self.engine.scheduler
        for seq in (*sched.running, *sched.waiting):
            sched.finish(seq)
            sender = self.senders.pop(seq.req_id, None)
            if sender is not None:
                sender.fail(reason)
