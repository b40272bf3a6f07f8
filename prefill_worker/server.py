"""The prefill worker's gRPC service. Protobuf stops here: requests become engine values.

A prefill (`Prefill`; `PrefillStream` is the same call answering the first token as soon as it
is sampled) checks the transfer ticket (a decode worker's signed reservation for this request:
the K/V go to the address it names, nowhere else), queues the prompt (queued), the engine
prefills it in chunks while its K/V stream to that decode worker (prefilling: from a GPU's cache
layer by layer as each layer lands; from a host cache, shared memory or not, step by step as
each step ends), samples the first token and sends the trailer (sending), and the call returns
once the decode side has verified the transfer (done). Whatever happens (done, failed,
cancelled), the request's blocks are then released. The states are `PrefillState`, derived from
the request's progress. On `PrefillStream`, a first token that ends the request (a stop token,
max_tokens 1) says how, and its push is abandoned (unless it already ended; one stalled in
transit is cut after ABANDON_WAIT_S): the router has all it needs, and the decode worker's
reservation ends with the abandoned push or the router's cancelled Decode call.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable

import grpc

from pdserve.engine import kv_copy
from pdserve.engine.disagg import DTYPE_NAMES, PrefillState, kv_cache_groups, kv_group_layouts, raw_layer, read_kv
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sequence import FinishReason
from pdserve.prefill_worker.kv_sender import KVSender
from pdserve.serving.auth import ClusterSecurity
from pdserve.serving.convert import FINISH_REASONS, logprobs_message, parse_work_request
from pdserve.serving.engine_thread import EngineLoop
from pdserve.serving.grpc_server import AioServer
from pdserve.serving.kv_transfer import KVAck, KVHeader, KVTransport, TransferError, TransferFailure
from pdserve.serving.kv_transfer import dist, shm
from pdserve.serving.kv_transfer.dist import DistTransport
from pdserve.serving.kv_transfer.grpc_transport import STATUS_OF, GrpcTransport
from pdserve.serving.kv_transfer.shm_transport import ShmTransport
from pdserve.serving.logs import REQUEST_ID_KEY, fields, request_id
from pdserve.serving.tickets import Ticket, TicketError, verify
from pdserve.serving.tracing import RequestSpans, extract, metadata_value
from pdserve.serving.worker import WorkerService
from pdserve.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger("pdserve.prefill")
ABANDON_WAIT_S = 1.0  # a request that went away: how long its push may take to say so before it is cut
FIRST_TOKEN_WAIT_S = 0.005  # one core: how long a step's K/V hand-over waits for its first tokens to go out


@dataclass(frozen=True, slots=True)
class PrefillServerConfig:
    kv_transfer_timeout_s: float = 30.0  # the whole push, prefill included
    max_chunk_bytes: int = 4 << 20  # per data chunk over gRPC: fewer, larger messages move bytes faster
    kv_shm: bool = True  # KV cache in shared memory; same-node decode workers copy from it (shm.py)
    # K/V bytes over a torch.distributed group to decode workers that take its backend (NCCL between
    # CUDA caches, gloo between host caches; dist.py); over gRPC to the others. Takes the place of kv_shm.
    kv_dist: bool = False

    def __post_init__(self) -> None:
        if self.kv_transfer_timeout_s <= 0:
            raise ValueError(f"PrefillServerConfig.kv_transfer_timeout_s must be > 0, got {self.kv_transfer_timeout_s}")
        if self.max_chunk_bytes < 1024:
            raise ValueError(f"PrefillServerConfig.max_chunk_bytes must be >= 1024, got {self.max_chunk_bytes}")


@dataclass(slots=True)
class PrefillRequest:
    req_id: str
    sender: KVSender
    first: asyncio.Future  # (first token, its logprobs or None) once sampled
    ended: PrefillState | None = None  # DONE, FAILED or CANCELLED once it is over
    # PrefillStream: whether a first token ends the request, and how (then its push is abandoned)
    finish_reason_of: Callable[[int], FinishReason | None] | None = None
    finish_reason: FinishReason | None = None  # the first token's, when it ends the request

    @property
    def state(self) -> PrefillState:
        if self.ended is not None:
            return self.ended
        if self.sender.first_token is not None:
            return PrefillState.SENDING
        return PrefillState.PREFILLING if self.sender.first_layer_at is not None else PrefillState.QUEUED


async def _cut(push: asyncio.Future):
    """An abandoned push's end (its result, or what it raised): it ends once the decode side reads
    the abandonment; one stalled in transit cannot, and is cancelled after ABANDON_WAIT_S rather
    than holding the request's blocks until its transfer timeout."""
    await asyncio.wait({push}, timeout=ABANDON_WAIT_S)
    push.cancel()  # a no-op once the decode side took the abandonment
    (ended,) = await asyncio.gather(push, return_exceptions=True)
    return ended


class PrefillWorkerServicer(WorkerService, worker_pb2_grpc.PrefillWorkerServicer):
    role = "prefill"

    def __init__(self, config: PrefillServerConfig, transport: KVTransport | None = None, metrics=None,
                 security: ClusterSecurity = ClusterSecurity()):
        super().__init__(metrics, security)
        self.config = config
        self.arena: shm.KVArena | None = None  # our KV cache, when it lives in shared memory
        if transport is None and config.kv_dist and dist.is_available():
            transport = DistTransport(GrpcTransport(security), lambda group: self._groups[group], self._host)
        if transport is None and config.kv_shm and shm.is_available():
            shm.clean_stale_segments()
            self.arena = self.kv_allocator = shm.KVArena()
            transport = ShmTransport(self.arena, GrpcTransport(security), self._raw_layer)
        self.transport = transport or GrpcTransport(security)
        self._reads_slots = getattr(self.transport, "takes_slots", False)  # it reads our cache itself (DistTransport)
        self.requests: dict[str, PrefillRequest] = {}  # asyncio loop only
        self._senders: dict[str, KVSender] = {}  # engine thread only
        self._groups = []
        self._raw_views: dict[tuple[int, int], tuple] = {}  # (group, layer) -> `raw_layer`'s views
        self._step_chunks = None  # engine thread: the running step's prefill chunks (kv hook)
        self._step_layers: list[tuple[int, int]] = []  # engine thread: its (group, layer)s noted for `_after_step`
        # set by `attach`, once the cache exists: whether the K/V go only after each step (our
        # cache is in host memory, or the transport reads the slots itself: see `_on_layer`),
        # whether they stay in shared memory, and whether this worker runs on one core
        self._after_the_step = self._in_shm = self._one_core = False

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()

    def _raw_layer(self, group: int, layer: int):
        """Raw views of one layer of our host cache, made once (the hand-over asks every step)."""
        if (group, layer) not in self._raw_views:
            self._raw_views[group, layer] = raw_layer(self._groups[group], layer)
        return self._raw_views[group, layer]

    def _host(self) -> str:
        """Where decode workers reach this worker: the host of its advertised address."""
        host = self.advertised_address.rsplit(":", 1)[0].strip("[]")
        return host if host not in ("", "0.0.0.0", "::") else "127.0.0.1"

    def extra_stats(self) -> dict:
        return dict(kv_transfer_shm_total=getattr(self.transport, "num_shm_pushes", 0),
                    kv_transfer_dist_total=getattr(self.transport, "num_dist_pushes", 0))

    def add_to(self, server: AioServer) -> None:
        server.add(worker_pb2_grpc.add_PrefillWorkerServicer_to_server, self,
                   worker_pb2.DESCRIPTOR.services_by_name["PrefillWorker"])

    def attach(self, loop: EngineLoop, model_name: str) -> None:
        super().attach(loop, model_name)
        self._groups = [cache for _, cache in kv_cache_groups(loop.engine)]
        kv_copy.prepare(self._groups[0][0][0].device)
        self._after_the_step = self._groups[0][0][0].device.type == "cpu" or self._reads_slots
        self._in_shm = self.arena is not None and bool(self.arena.segments)
        self._one_core = hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) == 1
        loop.engine.kv_hook = self._on_layer
        loop.engine.kv_hook_streams = not self._after_the_step
        loop.engine.defer_draft_handoff = True  # `_after_step` runs it
        loop.after_step = self._after_step

    def _on_layer(self, group: int, layer: int, chunks) -> None:
        """The engine's KV hook (engine thread): this layer's K/V of each chunk are in the cache.
        From a GPU's cache they are copied out now, inside the forward pass, and stream layer by
        layer, the wire overlapping the prefill's kernels. From our host cache they go after the
        step: the engine runs the pass whole and then calls this for each layer
        (`kv_hook_streams` off), which notes it, and `_after_step` hands the step's layers over
        once its first tokens are on their way: in shared memory only their slots, described and
        checksummed (the decode side copies them at memory speed), else their bytes, checksummed
        and copied once into the gRPC messages. On a CPU the wire's work would take the cores the
        pass runs on, so streaming overlaps nothing: with the demo target, one pinned core a
        worker and 256-768-token prompts, the whole pass cut the disaggregated TTFT from 1.33x
        the colocated one to 1.03-1.05x over gRPC (and from 1.18x to 1.04x through shared memory),
        at the cost of the transfer no longer hidden before the second token (BENCHMARKS.md, TTFT
        at low load). A transport that reads the slots itself (`DistTransport`, `takes_slots`)
        gets them after the step too, and reads them where they lie (a GPU's cache: no copy to
        the host)."""
        self._step_chunks = chunks
        if self._after_the_step:
            self._step_layers.append((group, layer))
            for c in chunks:
                if (sender := self._senders.get(c.seq.req_id)) is not None:
                    sender.began(self.engine.forward_started_at)
            return
        for c in chunks:
            if c.num_tokens and (sender := self._senders.get(c.seq.req_id)) is not None:
                sender.send(group, layer, c.token_start, read_kv(self._groups[group], layer, c.slots))

    def _after_step(self, ok: bool) -> None:
        """Engine thread, after a step's outputs are posted: the noted layers' slots go to their
        senders, and a prompt the step completed has its last K/V handed over. With a draft, its
        pass over the step's prompt tokens runs here, once their first tokens are on their way
        (`LLMEngine.defer_draft_handoff`), and the target's layers go first, so the decode side
        copies them while it runs; a decode worker that takes it (`KVSender.targets_first`) is
        told they are complete (`KVTargetReady`) and starts decoding before the draft's arrive.
        Before the sampling, that pass made a speculating pair's disaggregated TTFT 1.15x the
        colocated one's at the median (BENCHMARKS.md, TTFT at low load). After a failed step
        nothing is sent (its requests were failed); a draft pass that fails fails the pushes of
        the step's prompts (a decode worker already decoding one goes on without its draft)."""
        chunks, runs = self._step_chunks, {}
        if ok and chunks:
            if self._one_core and self._step_layers:
                self._let_first_tokens_out(chunks)
            if not self.engine.draft_handoff_pending:
                self._send_noted(chunks, runs, last=True)
            else:
                self._send_noted(chunks, runs, last=False)
                try:
                    self.engine.hand_over_draft()  # its layers to `_on_layer` too
                except Exception as e:  # noqa: BLE001 - these prompts' pushes fail, not the worker
                    log.exception("the draft's pass over the step's prompts failed")
                    for c in chunks:
                        self._fail_push(c, f"the draft's pass failed: {e!r}")
                else:
                    self._send_noted(self._step_chunks, runs, last=True)
        self._step_chunks, self._step_layers = None, []

    def _send_noted(self, chunks, runs: dict, last: bool) -> None:
        """The layers noted since the last call, for each chunk; with `last`, a chunk that
        completes its prompt ends it, else what is noted goes to the loop now. `runs`: each
        chunk's slot runs, by request, made once a step."""
        layers, self._step_layers = self._step_layers, []
        for c in chunks:
            sender = self._senders.get(c.seq.req_id)
            if sender is None:
                continue
            try:
                sent = layers if c.num_tokens else ()  # none: the decode side holds every token of the chunk
                if sent and c.seq.req_id not in runs:
                    runs[c.seq.req_id] = shm.slot_runs(c.slots.numpy())
                slot_runs = runs.get(c.seq.req_id)
                for group, layer in sent:
                    if self._reads_slots:  # the transport reads the slots itself (`DistTransport`)
                        k = self._groups[group][layer][0]
                        sender.send_refs(group, layer, c.token_start, slot_runs, 2 * k[0, 0].nbytes)
                    elif self._in_shm:  # they stay in shared memory
                        sender.send_slots(group, layer, c.token_start, slot_runs, *self._raw_layer(group, layer))
                    else:  # copied once, out of our host cache into the chunks' gRPC messages
                        sender.send_rows(group, layer, c.token_start, slot_runs, *self._raw_layer(group, layer))
                if c.completes_prompt and last:
                    sender.end_of_prompt()
                elif c.completes_prompt:  # the target's K/V of the whole prompt: the decode worker may start
                    sender.target_done()
                elif not last:
                    sender.flush()
            except Exception as e:  # noqa: BLE001 - this request's push fails, not the step's others
                log.exception("KV hand-over failed req_id=%s", c.seq.req_id)
                self._fail_push(c, f"KV hand-over failed: {e!r}")

    def _fail_push(self, chunk, reason: str) -> None:
        """Engine thread: end the push of this chunk's request with `reason` (on the loop)."""
        if (sender := self._senders.get(chunk.seq.req_id)) is not None:
            self.loop.aio.call_soon_threadsafe(sender.fail, reason)

    def _let_first_tokens_out(self, chunks) -> None:
        """Engine thread, on a worker with one core: wait (FIRST_TOKEN_WAIT_S at most) until the
        loop has sent the first tokens this step sampled, before checksumming and copying the
        step's K/V. On one core the two would share it, and the first token, the one a user
        waits for, would go out at half speed."""
        deadline = time.perf_counter() + FIRST_TOKEN_WAIT_S
        for c in chunks:
            sender = self._senders.get(c.seq.req_id)
            if sender is not None and c.completes_prompt:
                sender.first_sent.wait(max(0.0, deadline - time.perf_counter()))

    @property
    def num_live_requests(self) -> int:
        return len(self.requests)

    async def Prefill(self, request, context):
        done = None
        async for event in self._prefill(request, context, stream_first_token=False):
            done = event.done
        return done

    async def PrefillStream(self, request, context):
        async for event in self._prefill(request, context, stream_first_token=True):
            yield event

    async def _prefill(self, request, context, stream_first_token: bool):
        """PrefillEvents: the first token as soon as the engine samples it (when asked), then,
        once the decode side has verified the K/V, the PrefillResponse."""
        await self.check_accepting(context)
        try:
            req_id, ids, params = parse_work_request(request.request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        ticket = await self._check_ticket(request.ticket, req_id, context)
        engine = self.engine
        header = KVHeader(request.ticket, len(ids), DTYPE_NAMES[engine.kv_dtype], tuple(kv_group_layouts(engine)),
                          num_cached_tokens=ticket.cached_tokens)
        if req_id in self.requests:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"req_id {req_id!r} is already being prefilled")
        loop = asyncio.get_running_loop()
        sender = KVSender(loop, header, self.config.max_chunk_bytes, targets_first=request.target_ready)
        r = PrefillRequest(req_id, sender, loop.create_future(),
                           finish_reason_of=(lambda tok: engine.finish_reason_of(params, tok, 1, len(ids) + 1))
                           if stream_first_token else None)
        metadata = context.invocation_metadata()
        request_id.set(metadata_value(metadata, REQUEST_ID_KEY) or req_id)  # this task's log lines, the KV push
        spans = RequestSpans("pdserve.prefill", extract(metadata), req_id=req_id, prompt_tokens=len(ids))
        self.requests[req_id] = r
        self.loop.sinks[req_id] = lambda item: self._on_output(r, item)
        push = None
        try:
            try:
                await self.loop.call(lambda e: self._add(e, r, ids, params, ticket.cached_tokens))
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            self.num_requests_total += 1
            push = asyncio.ensure_future(self._push(r, ticket.address))
            ack = None
            if stream_first_token:
                await asyncio.wait({push, r.first}, return_when=asyncio.FIRST_COMPLETED)
                if r.first.done() and not push.done():
                    tok, logprobs = r.first.result()
                    reason = r.finish_reason
                    yield worker_pb2.PrefillEvent(first_token=worker_pb2.FirstToken(
                        token_id=tok, logprobs=logprobs_message(logprobs) if logprobs else None,
                        ends_request=reason is not None,
                        finish_reason=FINISH_REASONS[reason.value] if reason is not None else 0))
                    r.sender.first_sent.set()
                    if reason is not None:  # the push was abandoned when the token came (`_on_output`)
                        pushed = await _cut(push)
                        r.ended, ack = PrefillState.DONE, pushed if isinstance(pushed, KVAck) else KVAck(0, 0)
            if ack is None:
                ack = await push
        except TransferError as e:
            await context.abort(STATUS_OF[e.failure], str(e))
        finally:
            r.sender.first_sent.set()  # whatever happened, nothing more to wait for
            if push is not None and not push.done():  # the caller went away: give the push up
                r.sender.abandon()
                await _cut(push)
            elif push is not None and not push.cancelled():
                # done, and maybe failed, after the caller went away between the first token and
                # the push's end: its error is read here, or asyncio logs it as never retrieved
                push.exception()
            self._end(r)
            self._finish_spans(r, spans)
        s = r.sender
        yield worker_pb2.PrefillEvent(done=worker_pb2.PrefillResponse(
            first_token_id=s.first_token, num_chunks=ack.num_chunks, num_bytes=ack.num_bytes,
            prefill_seconds=s.finished_at - s.created_at, tail_seconds=time.perf_counter() - s.finished_at))

    async def _check_ticket(self, text: str, req_id: str, context) -> Ticket:
        """The K/V go only where a decode worker reserved blocks for this very request."""
        try:
            ticket = verify(self.ticket_key, text)
        except TicketError as e:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"transfer ticket refused: {e}")
        if ticket.req_id != req_id:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "transfer ticket refused: it was issued for "
                                "another request")
        return ticket

    @staticmethod
    def _finish_spans(r: PrefillRequest, spans: RequestSpans) -> None:
        """queue (until the first layer's K/V), prefill (until the first token), push (the first
        K/V sent until the decode side verified them: it overlaps the prefill by design)."""
        s, now = r.sender, time.perf_counter()
        spans.add("queue", s.created_at, s.first_layer_at or now)
        spans.add("prefill", s.first_layer_at, s.finished_at)
        spans.add("push", s.first_layer_at, now, num_bytes=s.num_bytes, num_chunks=s.num_chunks)
        status = r.state.value if r.ended is not PrefillState.DONE else "ok"
        spans.finish(status)
        log.info("request", extra=fields(state=r.state.value, prompt_seconds=(
            round(s.finished_at - s.created_at, 6) if s.finished_at else None)))

    def _add(self, engine: LLMEngine, r: PrefillRequest, ids: list[int], params, send_from: int) -> None:
        """Engine thread: queue the prompt, whose K/V go from token send_from on (ValueError on a
        bad request)."""
        engine.add_prefill(r.req_id, ids, params, send_from)
        self._senders[r.req_id] = r.sender

    def _on_output(self, r: PrefillRequest, item) -> None:
        if isinstance(item, Exception):
            r.sender.fail(str(item))
        elif item.new_token_ids:
            tok, logprobs = item.new_token_ids[0], item.logprobs[0] if item.logprobs else None
            if r.finish_reason_of is not None and (reason := r.finish_reason_of(tok)) is not None:
                # the request is over with this token: its K/V have no use (abandoned before the
                # token goes out, so no push fails for a reservation the router is about to cancel)
                r.finish_reason = reason
                r.sender.abandon()
            if not r.first.done():  # first, so the token's event is written before the last K/V
                r.first.set_result((tok, logprobs))
            if r.finish_reason_of is None:  # `Prefill`: the token goes out with the push's end
                r.sender.first_sent.set()
            r.sender.finish(tok, logprobs)

    async def _push(self, r: PrefillRequest, address: str):
        started = time.perf_counter()
        try:
            ack = await self.transport.push(address, r.sender.messages(), self.config.kv_transfer_timeout_s)
        except TransferError as e:
            if r.sender.abandoned:  # we gave it up: what the decode side says of it now is moot
                r.ended = PrefillState.CANCELLED
                raise
            r.ended = PrefillState.FAILED
            self.kv_transfer_failures_total += e.failure is not TransferFailure.ABORTED
            if r.sender.error:  # our own engine failed it: say so, not what the decode side saw
                e = TransferError(TransferFailure.ABORTED, f"prefill failed: {r.sender.error}")
            log.warning("KV push failed req_id=%s decode=%s: %s", r.req_id, address, e)
            raise e from None
        except asyncio.CancelledError:
            r.ended = PrefillState.CANCELLED
            raise
        r.ended = PrefillState.DONE
        self.kv_transfer_bytes_total += ack.num_bytes
        self.metrics.observe_transfer(time.perf_counter() - started, ack.num_bytes)
        return ack

    def _end(self, r: PrefillRequest) -> None:
        """Done, failed or cancelled: forget it here and free its blocks on the engine thread."""
        self.requests.pop(r.req_id, None)
        self.loop.sinks.pop(r.req_id, None)

        def release(engine: LLMEngine) -> None:  # after `_add` (commands keep their order)
            self._senders.pop(r.req_id, None)
            engine.release(r.req_id)

        self.loop.call(release)
