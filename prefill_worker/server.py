"""The prefill worker's gRPC service. Protobuf stops here: requests become engine values.

`Prefill` queues the prompt, opens a PushKV stream to the decode worker the router reserved,
and returns once the decode side has verified the transfer; either way the request's blocks
are then released. A cancelled Prefill cancels its push and frees at once.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from pdserve.engine.disagg import DTYPE_NAMES, add_prefill, kv_group_layouts, queued_prompt_tokens, release
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.prefill_worker.kv_sender import KVSender
from pdserve.prefill_worker.loop import PrefillLoop
from pdserve.serving.convert import sampling_kwargs
from pdserve.serving.metrics import WorkerMetrics
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve.serving.grpc_server import CHANNEL_OPTIONS, KV_TRANSFER_OPTIONS

log = logging.getLogger("pdserve.prefill")


@dataclass(frozen=True, slots=True)
class PrefillServerConfig:
    kv_transfer_timeout_s: float = 30.0  # the whole PushKV call, prefill included
    max_chunk_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        if self.kv_transfer_timeout_s <= 0:
            raise ValueError(f"PrefillServerConfig.kv_transfer_timeout_s must be > 0, got {self.kv_transfer_timeout_s}")
        if self.max_chunk_bytes < 1024:
            raise ValueError(f"PrefillServerConfig.max_chunk_bytes must be >= 1024, got {self.max_chunk_bytes}")


def work_request(msg: worker_pb2.WorkRequest) -> tuple[str, list[int], SamplingParams]:
    if not msg.req_id:
        raise ValueError("req_id is empty")
    return msg.req_id, list(msg.prompt_token_ids), SamplingParams(**sampling_kwargs(msg.sampling_params))


class PrefillWorkerServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, config: PrefillServerConfig, metrics: WorkerMetrics | None = None):
        self.config = config
        self.metrics = metrics or WorkerMetrics("prefill")
        self.loop: PrefillLoop | None = None
        self.info: worker_pb2.WorkerInfo | None = None
        self._channels: dict[str, worker_pb2_grpc.DecodeWorkerStub] = {}
        self.num_in_flight = 0
        self.kv_transfer_bytes_total = 0
        self.kv_transfer_failures_total = 0

    def ready(self, loop: PrefillLoop, info: worker_pb2.WorkerInfo) -> None:
        self.loop, self.info = loop, info

    def _stub(self, address: str) -> worker_pb2_grpc.DecodeWorkerStub:
        if address not in self._channels:
            channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS + KV_TRANSFER_OPTIONS)
            self._channels[address] = worker_pb2_grpc.DecodeWorkerStub(channel)
        return self._channels[address]

    async def Prefill(self, request, context):
        if self.loop is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        try:
            req_id, ids, params = work_request(request.request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if not request.decode_address or not request.transfer_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "decode_address and transfer_id are required")
        engine = self.loop.engine
        sender = KVSender(asyncio.get_running_loop(), request.transfer_id, len(ids), DTYPE_NAMES[engine.dtype],
                          kv_group_layouts(engine), self.config.max_chunk_bytes)

        added = []  # the sequence, once the engine thread has queued it

        def add(e: LLMEngine) -> None:
            if req_id in self.loop.senders:
                raise ValueError(f"req_id {req_id!r} is already being prefilled")
            added.append(add_prefill(e, req_id, ids, params))
            self.loop.senders[req_id] = sender

        def drop(e: LLMEngine) -> None:  # runs after `add` (commands keep their order), even if cancelled
            if added:
                self.loop.senders.pop(req_id, None)
                release(e, added[0])

        call = None
        self.num_in_flight += 1
        try:
            try:
                await self.loop.call(add)
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            pushed_at = time.perf_counter()
            call = self._stub(request.decode_address).PushKV(sender.messages(),
                                                             timeout=self.config.kv_transfer_timeout_s)
            try:
                ack = await call
            except grpc.aio.AioRpcError as e:
                self.kv_transfer_failures_total += 1
                why = sender.error or e.details()
                log.warning("KV push failed req_id=%s decode=%s code=%s: %s", req_id, request.decode_address,
                            e.code(), why)
                code = grpc.StatusCode.INTERNAL if sender.error else e.code()
                await context.abort(code, f"KV push to {request.decode_address} failed: {why}")
        finally:
            self.num_in_flight -= 1
            if call is not None:
                call.cancel()
            self.loop.call(drop)
        acked_at = time.perf_counter()
        self.kv_transfer_bytes_total += ack.num_bytes
        self.metrics.observe_transfer(acked_at - pushed_at)
        return worker_pb2.PrefillResponse(first_token_id=sender.first_token, num_chunks=ack.num_chunks,
                                          num_bytes=ack.num_bytes,
                                          prefill_seconds=sender.finished_at - sender.created_at,
                                          tail_seconds=acked_at - sender.finished_at)

    async def GetInfo(self, request, context):
        if self.info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        return self.info

    async def GetStats(self, request, context):
        if self.loop is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        return self.stats()

    def stats(self) -> worker_pb2.WorkerStats:
        e = self.loop.engine
        return worker_pb2.WorkerStats(
            num_blocks=e.block_manager.num_blocks, num_free_blocks=e.block_manager.num_free_blocks,
            num_running=len(e.scheduler.running), num_waiting=len(e.scheduler.waiting),
            num_reserved=self.num_in_flight, num_queued_prompt_tokens=queued_prompt_tokens(e),
            kv_transfer_bytes_total=self.kv_transfer_bytes_total,
            kv_transfer_failures_total=self.kv_transfer_failures_total,
            max_num_seqs=e.scheduler.config.max_num_seqs)
