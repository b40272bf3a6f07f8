"""The decode worker's gRPC service. Protobuf stops here: requests become engine values.

Life cycle of a disaggregated request on this worker (named as in `engine.disagg`):

    Decode() ──reserve──► reserved ──PushKV: header, chunks, trailer verified──► running
        ──engine steps: token deltas on the Decode stream──► finished (blocks freed)
    reserved / receiving ──bad chunk, truncation, timeout, Decode cancelled──► failed (freed)

A failed transfer ends both the PushKV call and the Decode stream with the same status, and
counts in `kv_transfer_failures_total`. A colocated `Generate` skips reservation and transfer.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from pdserve.decode_worker.kv_receiver import KVReceiver, Transfer, TransferError, TransferFailure, TransferState
from pdserve.decode_worker.loop import DecodeLoop
from pdserve.engine.disagg import KVGroupLayout, activate, release, reserve
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.serving.convert import FINISH_REASONS, sampling_kwargs
from pdserve.serving.metrics import WorkerMetrics
from pdserve.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger("pdserve.decode")

_STATUS = {
    TransferFailure.CORRUPT: grpc.StatusCode.DATA_LOSS,
    TransferFailure.MISMATCH: grpc.StatusCode.FAILED_PRECONDITION,
    TransferFailure.UNKNOWN: grpc.StatusCode.NOT_FOUND,
    TransferFailure.TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    TransferFailure.ABORTED: grpc.StatusCode.ABORTED,
}


@dataclass(frozen=True, slots=True)
class DecodeServerConfig:
    kv_transfer_timeout_s: float = 30.0  # admission until the trailer is verified
    stream_timeout_s: float = 120.0  # longest wait for the next token delta

    def __post_init__(self) -> None:
        for name in ("kv_transfer_timeout_s", "stream_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"DecodeServerConfig.{name} must be > 0, got {getattr(self, name)}")


def work_request(msg: worker_pb2.WorkRequest) -> tuple[str, list[int], SamplingParams]:
    """ValueError (naming the field) on a bad request."""
    if not msg.req_id:
        raise ValueError("req_id is empty")
    return msg.req_id, list(msg.prompt_token_ids), SamplingParams(**sampling_kwargs(msg.sampling_params))


def token_delta(out: RequestOutput) -> worker_pb2.DecodeEvent:
    reason = FINISH_REASONS[out.finish_reason.value] if out.finish_reason else 0
    return worker_pb2.DecodeEvent(tokens=worker_pb2.TokenDelta(token_ids=out.new_token_ids, finish_reason=reason))


class DecodeWorkerServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, config: DecodeServerConfig, metrics: WorkerMetrics | None = None):
        self.config = config
        self.metrics = metrics or WorkerMetrics("decode")
        self.loop: DecodeLoop | None = None  # set by `ready` once the model is loaded
        self.info: worker_pb2.WorkerInfo | None = None
        self.receiver: KVReceiver | None = None
        self.transfers: dict[str, Transfer] = {}
        self.kv_transfer_bytes_total = 0
        self.kv_transfer_failures_total = 0

    def ready(self, loop: DecodeLoop, info: worker_pb2.WorkerInfo, receiver: KVReceiver) -> None:
        self.loop, self.info, self.receiver = loop, info, receiver

    @property
    def engine(self) -> LLMEngine:
        return self.loop.engine

    async def _check_ready(self, context) -> None:
        if self.loop is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")

    async def _parse(self, request, context) -> tuple[str, list[int], SamplingParams]:
        await self._check_ready(context)
        try:
            return work_request(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    # ---- disaggregated: admission, then tokens -------------------------------------------
    async def Decode(self, request, context):
        req_id, ids, params = await self._parse(request, context)
        if req_id in self.transfers:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"req_id {req_id!r} is already reserved")
        pending = self.loop.call(lambda e: reserve(e, req_id, ids, params, len(self.transfers)))
        try:
            seq = await asyncio.shield(pending)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except asyncio.CancelledError:  # the router went away while we reserved: give the blocks back
            pending.add_done_callback(lambda f: f.exception() is None and f.result() and self.loop.call(
                lambda e: release(e, f.result())))
            raise
        if seq is None:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self._no_room(len(ids)))
        t = self.transfers[req_id] = Transfer(req_id, seq)
        events: asyncio.Queue = asyncio.Queue()
        self.loop.sinks[req_id] = events.put_nowait
        finished = False
        try:
            yield worker_pb2.DecodeEvent(admitted=worker_pb2.Admitted(
                transfer_id=req_id, num_free_blocks=self.engine.block_manager.num_free_blocks))
            timeout = self.config.kv_transfer_timeout_s
            while not finished:
                try:
                    item = await asyncio.wait_for(events.get(), timeout)
                except asyncio.TimeoutError:
                    item = TransferError(TransferFailure.TIMEOUT, f"no verified KV transfer within {timeout:g} s")
                    if t.state is TransferState.VERIFIED:
                        item = TransferError(TransferFailure.TIMEOUT, f"no token within {timeout:g} s")
                    self._fail(t, item)
                if isinstance(item, TransferError):
                    await context.abort(_STATUS[item.failure], str(item))
                timeout = self.config.stream_timeout_s
                finished = item.finished
                yield token_delta(item)
        finally:
            self.loop.sinks.pop(req_id, None)
            if not finished:
                self._fail(t, TransferError(TransferFailure.ABORTED, "the request was cancelled"))
            self.transfers.pop(req_id, None)

    def _no_room(self, num_prompt_tokens: int) -> str:
        e = self.engine
        need = e.block_manager.blocks_for(num_prompt_tokens + 1)
        return (f"decode worker is full: {e.block_manager.num_free_blocks} free KV blocks (request needs {need}), "
                f"{len(e.scheduler.running) + len(self.transfers)} of {e.scheduler.config.max_num_seqs} sequences")

    def _fail(self, t: Transfer, err: TransferError) -> None:
        """End a transfer and its request; idempotent. Frees the blocks on the engine thread."""
        if t.state is TransferState.FAILED:
            return
        was_verified = t.state is TransferState.VERIFIED
        t.state, t.error = TransferState.FAILED, err
        if err.failure is not TransferFailure.ABORTED:
            self.kv_transfer_failures_total += not was_verified
            log.warning("request %s failed: %s", t.transfer_id, err)
        sink = self.loop.sinks.get(t.transfer_id)
        if sink is not None:
            sink(err)
        seq, req_id = t.seq, t.transfer_id

        def drop(engine: LLMEngine) -> None:  # either call alone may be a no-op: both are idempotent
            engine.abort(req_id)
            release(engine, seq)

        self.loop.call(drop)

    # ---- KV push from a prefill worker ---------------------------------------------------
    async def PushKV(self, request_iterator, context):
        await self._check_ready(context)
        t = None
        try:
            async for chunk in request_iterator:
                part = chunk.WhichOneof("part")
                if part == "header":
                    t = self._open(chunk.header)
                    opened_at = time.perf_counter()
                elif t is None:
                    raise TransferError(TransferFailure.CORRUPT, f"the stream starts with {part}, not a header")
                elif part == "data":
                    self._check_alive(t)
                    d = chunk.data
                    self.receiver.receive(t, d.seq, d.group, d.layer, d.token_start, d.num_tokens, d.data, d.crc32)
                elif part == "trailer":
                    self._check_alive(t)
                    self.receiver.finish(t, chunk.trailer.num_chunks, chunk.trailer.first_token_id)
                    await self._activate(t, chunk.trailer.first_token_id)
                    self.kv_transfer_bytes_total += t.num_bytes
                    self.metrics.observe_transfer(time.perf_counter() - opened_at)
                    return worker_pb2.PushKVResponse(num_chunks=t.num_chunks, num_bytes=t.num_bytes)
            raise TransferError(TransferFailure.CORRUPT, "transfer truncated: the stream ended without a trailer")
        except TransferError as e:
            if t is not None:
                self._fail(t, e)
            await context.abort(_STATUS[e.failure], str(e))
        except asyncio.CancelledError:
            if t is not None:
                self._fail(t, TransferError(TransferFailure.ABORTED, "the KV push was cancelled by its sender"))
            raise

    def _open(self, header: worker_pb2.KVHeader) -> Transfer:
        t = self.transfers.get(header.transfer_id)
        if t is None:
            raise TransferError(TransferFailure.UNKNOWN, f"no reservation for transfer {header.transfer_id!r}")
        layouts = [KVGroupLayout(g.name, g.num_layers, g.num_kv_heads, g.head_dim) for g in header.groups]
        self.receiver.open(t, header.num_tokens, header.dtype, layouts)
        return t

    @staticmethod
    def _check_alive(t: Transfer) -> None:
        if t.state is TransferState.FAILED:
            raise TransferError(TransferFailure.ABORTED, f"transfer {t.transfer_id} was already ended: {t.error}")

    async def _activate(self, t: Transfer, first_token: int) -> None:
        loop = self.loop

        def run(engine: LLMEngine) -> None:
            if t.state is TransferState.FAILED:  # cancelled while this command waited; _fail frees it
                return
            loop.deliver_soon([activate(engine, t.seq, first_token)])  # before any later step's outputs

        await loop.call(run)

    # ---- colocated -----------------------------------------------------------------------
    async def Generate(self, request, context):
        req_id, ids, params = await self._parse(request, context)
        events: asyncio.Queue = asyncio.Queue()
        self.loop.sinks[req_id] = events.put_nowait
        finished = False
        try:
            try:
                await self.loop.call(lambda e: e.add_request(req_id, ids, params))
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            yield worker_pb2.DecodeEvent(admitted=worker_pb2.Admitted(
                transfer_id="", num_free_blocks=self.engine.block_manager.num_free_blocks))
            while not finished:
                try:
                    out = await asyncio.wait_for(events.get(), self.config.stream_timeout_s)
                except asyncio.TimeoutError:
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                        f"no token within {self.config.stream_timeout_s:g} s")
                finished = out.finished
                yield token_delta(out)
        finally:
            self.loop.sinks.pop(req_id, None)
            if not finished:
                self.loop.call(lambda e: e.abort(req_id))

    # ---- info ----------------------------------------------------------------------------
    async def GetInfo(self, request, context):
        await self._check_ready(context)
        return self.info

    async def GetStats(self, request, context):
        await self._check_ready(context)
        return self.stats()

    def stats(self) -> worker_pb2.WorkerStats:
        e = self.engine
        return worker_pb2.WorkerStats(
            num_blocks=e.block_manager.num_blocks, num_free_blocks=e.block_manager.num_free_blocks,
            num_running=len(e.scheduler.running), num_waiting=len(e.scheduler.waiting),
            num_reserved=len(self.transfers), kv_transfer_bytes_total=self.kv_transfer_bytes_total,
            kv_transfer_failures_total=self.kv_transfer_failures_total,
            max_num_seqs=e.scheduler.config.max_num_seqs, **_spec_stats(e))


def _spec_stats(engine) -> dict:
    if engine.speculator is None:
        return {}
    st = engine.speculator.stats
    return dict(spec_num_drafts=st.num_drafts, spec_num_draft_tokens=st.num_draft_tokens,
                spec_num_accepted_tokens=st.num_accepted_tokens, spec_accepted_per_pos=list(st.accepted_per_pos))
