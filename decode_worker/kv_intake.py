"""The decode worker's side of a KV push (`KVEndpoint.receive_kv`): a push's stream into its
reservation. The header is checked against the ticket and the reservation (a header that does
not fit ends the reservation at once), each chunk is verified into the reservation's blocks, and
the request is activated at `KVTargetReady` (with a draft: it decodes on the target's K/V while
the draft's land) or at the trailer. A mixin of `server.DecodeWorkerServicer`, which holds the
reservations (`transfers`), the receiver, the engine loop and the counters; the life cycle is in
its module's docstring.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, AsyncIterator

from pdserve.decode_worker.kv_receiver import PinnedBlocks
from pdserve.engine.disagg import DecodeState
from pdserve.engine.llm_engine import LLMEngine
from pdserve.serving.kv_transfer import (KVAck, KVData, KVHeader, KVMessage, KVTargetReady, KVTrailer, TransferError,
                                         TransferFailure)
from pdserve.serving.tickets import TicketError, verify

if TYPE_CHECKING:
    from pdserve.decode_worker.server import DecodeRequest

log = logging.getLogger("pdserve.decode")


class KVIntake:
    """`receive_kv` and its steps, on the servicer's state: `transfers` (ticket nonce -> the
    reserved `DecodeRequest`), `receiver`, `loop`, `ticket_key`, `advertised_address`, `metrics`,
    the transfer counters, and `_end` (which ends a request and frees its blocks)."""

    async def receive_kv(self, messages: AsyncIterator[KVMessage]) -> KVAck:
        """A push's stream into its reservation. After a `KVTargetReady` the request decodes, and
        what is left (the draft's K/V) can cost it nothing: whatever becomes of the rest, the
        push is acknowledged, and a draft's K/V that did not arrive whole only cost that request
        its speculation (`_draft_kv_lost`). A request that ends meanwhile does not stop the
        stream: the rest still lands in its pinned blocks, so the sender's stream ends as sent
        (over a torch.distributed group, stopping early would leave its sends unmatched)."""
        r, opened_at = None, time.perf_counter()
        try:
            async for msg in messages:
                if isinstance(msg, KVHeader):
                    r = self._open(msg)
                    if msg.dist is not None:
                        await self.receiver.join_dist(r.progress, msg)
                elif r is None:
                    raise TransferError(TransferFailure.CORRUPT, f"the stream starts with {type(msg).__name__}, "
                                        "not a header")
                elif not r.is_live and not r.progress.target_ready:  # (after it, the blocks are pinned)
                    raise TransferError(TransferFailure.ABORTED, f"request {r.req_id} already ended ({r.state.value})")
                elif isinstance(msg, KVData) and r.progress.dist is not None:
                    buf, num_bytes = await self.receiver.fetch_dist(r.progress, msg)
                    if not r.is_live and not r.progress.target_ready:  # ended while the bytes came: its
                        # blocks may be another's now
                        raise TransferError(TransferFailure.ABORTED, f"request {r.req_id} already ended "
                                            f"({r.state.value})")
                    self.receiver.place_dist(r.progress, r.kv_blocks, msg, buf, num_bytes)
                elif isinstance(msg, KVData):
                    self.receiver.receive(r.progress, r.kv_blocks, msg)
                elif isinstance(msg, KVTargetReady):
                    self.receiver.target_ready(r.progress, msg)
                    r.pinned = PinnedBlocks(list(r.seq.block_table))  # held still: no step has touched it
                    r.spans.end("transfer")
                    r.spans.start("decode")
                    self._activate(r, msg.first_token_id, msg.first_token_logprobs, r.pinned.block_table)
                elif isinstance(msg, KVTrailer) and msg.abandoned:
                    raise TransferError(TransferFailure.ABORTED, "the sender abandoned the transfer (its request "
                                        "ended)")
                elif isinstance(msg, KVTrailer):
                    self.receiver.finish(r.progress, msg)
                    if r.progress.target_ready:  # the draft's K/V are in
                        self.loop.call(lambda e: e.draft_kv_landed(r.req_id, ok=True))
                    else:
                        r.spans.end("transfer")
                        r.spans.start("decode")
                        self._activate(r, msg.first_token_id, msg.first_token_logprobs)
                    self.kv_transfer_bytes_total += r.progress.num_bytes
                    self.metrics.observe_transfer(time.perf_counter() - opened_at, r.progress.num_bytes)
                    return KVAck(r.progress.num_chunks, r.progress.num_bytes)
            raise TransferError(TransferFailure.CORRUPT, "transfer truncated: the stream ended without a trailer")
        except TransferError as e:
            if r is not None:
                self.receiver.drop_dist(r.progress)
                if r.progress.target_ready:
                    return self._draft_kv_lost(r, e)
                self._end(r, e)
            raise
        except asyncio.CancelledError:
            if r is not None:
                self.receiver.drop_dist(r.progress)
                if r.progress.target_ready:
                    self._draft_kv_lost(r, TransferError(TransferFailure.ABORTED, "the KV push was cancelled"))
                else:
                    self._end(r, TransferError(TransferFailure.ABORTED, "the KV push was cancelled by its sender"))
            raise

    def _draft_kv_lost(self, r: DecodeRequest, e: TransferError) -> KVAck:
        """After `KVTargetReady` the transfer ended short of the draft's K/V: the request, which
        decodes already, goes on without speculation; the push is acknowledged for what came (a
        request that ended meanwhile is not counted a failure)."""
        self.loop.call(lambda eng: eng.draft_kv_landed(r.req_id, ok=False))
        if r.is_live and e.failure is not TransferFailure.ABORTED:
            self.kv_transfer_failures_total += 1
            log.warning("request %s decodes without speculation: its draft's K/V did not arrive: %s", r.req_id, e)
        return KVAck(r.progress.num_chunks, r.progress.num_bytes)

    def _open(self, header: KVHeader) -> DecodeRequest:
        try:
            ticket = verify(self.ticket_key, header.ticket)
        except TicketError as e:
            raise TransferError(TransferFailure.FORBIDDEN, f"transfer ticket refused: {e}") from None
        r = self.transfers.get(ticket.nonce)
        if r is None or r.req_id != ticket.req_id or ticket.address != self.advertised_address:
            raise TransferError(TransferFailure.UNKNOWN, "no live reservation here for that ticket")
        if r.state is not DecodeState.RESERVED:
            raise TransferError(TransferFailure.CORRUPT, f"transfer for {r.req_id} already {r.state.value}")
        try:
            self.receiver.open(r.progress, r.seq, header)
        except TransferError as e:  # a header that does not fit the reservation ends it now, not at its timeout
            self._end(r, e)
            raise
        r.state = DecodeState.RECEIVING
        r.spans.start("transfer")
        return r

    def _activate(self, r: DecodeRequest, first_token: int, logprobs, draft_pending: list[int] | None = None) -> None:
        """Queue the verified request's activation on the engine thread. The ack does not wait for
        it (about 0.5 ms of a push on 2 cores): the engine runs commands in order, so anything
        queued later (an abort) finds the request active. An activation that fails ends it.
        draft_pending: the request's blocks, into which the draft's K/V are still coming."""
        loop = self.loop
        logprobs = list(logprobs) if logprobs else None

        def run(engine: LLMEngine) -> None:
            if r.state is DecodeState.RUNNING:  # not ended while this command waited (`_end` frees it then)
                # before any later step's outputs
                loop.deliver_soon([engine.activate(r.req_id, first_token, logprobs, draft_pending)])

        def check(done: asyncio.Future) -> None:
            if not done.cancelled() and done.exception() is not None:
                self._end(r, TransferError(TransferFailure.MISMATCH, f"activating {r.req_id} failed: "
                                                                      f"{done.exception()!r}"))

        r.state = DecodeState.RUNNING
        loop.call(run).add_done_callback(check)
