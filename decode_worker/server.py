"""The decode worker's gRPC service. Protobuf stops here: requests become engine values.

Life cycle of a disaggregated request on this worker (`DecodeState`):

    Decode() ──engine.reserve──► reserved ──Admitted(ticket)──► (router asks a prefill worker)
        ──PushKV header──► receiving ──chunks verified, trailer──► engine.activate ──► running
        ──token deltas on the Decode stream──► finished (blocks freed)
    from any state ──bad chunk, truncation, timeout, Decode cancelled──► failed / cancelled (freed)

With a draft model, the target's K/V come first and a `KVTargetReady` after them: the request
is activated then (running, decoding plainly), the draft's K/V land in its pinned blocks while
it decodes, and at the trailer the draft takes it up. Whatever happens to the stream after
`KVTargetReady` costs the request only its speculation, never the request.

The transfer ticket is issued here at reservation (serving/tickets.py): signed under the
cluster's secret, naming the request, this worker's address and an expiry, distinct from the
request id; only a push presenting it reaches the reservation, and a reservation nobody pushes
to within the KV transfer timeout is freed and counted (`num_reservations_expired`). A failed transfer ends both the push and the Decode stream
with the same status and counts in `kv_transfer_failures_total` (a cancellation does not).

A reservation adopts the prompt's leading blocks that this worker's prefix cache holds, with the
draft's K/V too where there is a draft (`LLMEngine.reserve`: an earlier turn of the conversation,
decoded here, or a system prompt shared with another request): its ticket says how many tokens
they hold, and the push carries the K/V of the tokens after them only, into the blocks taken
fresh. They count as prefix cache hits (`pdserve:prefix_cache_hits`).

When the adopted blocks leave at most `local_prefill_tokens` of the prompt (a conversation's
next turn: the new message, and the answer's last partial block), the tail is prefilled here
instead: `Admitted.prefills_here`, no ticket, and the router asks no prefill worker. The prefill
worker would compute the prompt past what its own cache holds (the conversation's answers at
least, which it never saw) and push the tail's K/V; this engine computes the tail alone (the
tails of a step that also decodes take `local_prefill_chunk_tokens` in all, 32 on a CPU by
default: the requests decoding here then wait a few short steps, not one long one), and the
first token comes from its stream. Such a tail may also adopt blocks without the draft's K/V (an
answer decoded while the gate held plain decoding): the draft catches up over them before its
first proposal, as it does for a colocated request's prompt.

`PrefillAndDecode` is colocated mode: no reservation and no transfer, the engine prefills the
request itself, and the same token stream follows.

The token stream sends a delta per engine output (or per `stream_interval` tokens). When the
serving loop falls behind the engine thread, as it does beside an engine that steps faster than
it writes messages, the outputs waiting for a stream go out as one delta (`merge_backlog`; counted
in `pdserve:stream_merged_outputs`): messages grow instead of queueing (BENCHMARKS.md, Streaming
cost per token, an engine fast beside its loops). A request keeps one waiting output, its newest
(outputs are cumulative), so a call that falls behind holds memory for one output, not for every
step's copy of its tokens so far.

A router may take every request's deltas on one stream of its own instead, a message a step for
all of them (`TokenStream`; `token_streams.py`): then a request's call carries only its admission
and how it ends.

A push's stream into its reservation (header, chunks, `KVTargetReady`, trailer) is
`kv_intake.KVIntake`'s, a mixin of the servicer here.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc

from pdserve.decode_worker import LOCAL_PREFILL_CHUNK_TOKENS, LOCAL_PREFILL_TOKENS
from pdserve.decode_worker.kv_intake import KVIntake
from pdserve.decode_worker.kv_receiver import KVReceiver, PinnedBlocks, TransferProgress
from pdserve.decode_worker.token_streams import OpenStream, TokenStreams, token_delta
from pdserve.engine.disagg import DecodeState, kv_cache_groups, kv_group_layouts
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.serving.auth import ClusterSecurity
from pdserve.serving.convert import STREAM_TOKENS_METADATA, parse_work_request
from pdserve.serving.engine_thread import EngineLoop, EngineStepFailed
from pdserve.serving.grpc_server import KV_TRANSFER_OPTIONS, AioServer
from pdserve.serving.kv_transfer import TransferError, TransferFailure
from pdserve.serving.kv_transfer import dist, shm
from pdserve.serving.kv_transfer.dist import DistGroups
from pdserve.serving.kv_transfer.grpc_transport import STATUS_OF, add_decode_worker_servicer, serve_push_kv
from pdserve.serving.logs import REQUEST_ID_KEY, fields, request_id
from pdserve.serving.tickets import issue
from pdserve.serving.tracing import RequestSpans, extract, metadata_value
from pdserve.serving.worker import WorkerService
from pdserve.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger("pdserve.decode")
WAITING = object()  # in a request's events: its waiting output (`DecodeRequest.waiting`) is taken here


@dataclass(frozen=True, slots=True)
class DecodeServerConfig:
    kv_transfer_timeout_s: float = 30.0  # reservation until the transfer is verified
    stream_timeout_s: float = 120.0  # longest wait for the next token delta
    kv_shm: bool = True  # advertise a shared-memory probe: same-node prefill workers then push K/V through /dev/shm
    kv_dist: bool = True  # take K/V over a torch.distributed group from prefill workers that push so (dist.py)
    # a disaggregated request whose prompt this worker's prefix cache holds all of but at most this
    # many tokens is prefilled here (the tail only), not sent to a prefill worker; 0: never
    local_prefill_tokens: int = LOCAL_PREFILL_TOKENS
    # such tails take at most this many tokens in all of a step that also decodes; None: LOCAL_PREFILL_CHUNK_TOKENS
    # on a CPU, no cap on a GPU (where a short chunk rides a decode step at little cost); 0: no cap
    local_prefill_chunk_tokens: int | None = None
    # a request's stream sends a delta once it holds this many new tokens (its first and its last
    # at once): 1 streams each token as the engine emits it; N writes N times fewer messages on
    # this worker's loop and the router's, which is where a served token's CPU goes past the
    # engine's (BENCHMARKS.md, Streaming cost per token), and the tokens reach clients N at a time
    stream_interval: int = 1
    # a stream that fell behind its engine (outputs of several steps waiting when it wakes) sends
    # what waits as one delta: the newest output holds every token of the others. So when the
    # loops are the bottleneck, as with an engine fast beside them, messages grow instead of
    # queueing, and no token waits for it. False: one message per output, to measure the gain
    merge_backlog: bool = True

    def __post_init__(self) -> None:
        for name in ("kv_transfer_timeout_s", "stream_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"DecodeServerConfig.{name} must be > 0, got {getattr(self, name)}")
        tail = self.local_prefill_tokens
        if not isinstance(tail, int) or isinstance(tail, bool) or tail < 0:
            raise ValueError(f"DecodeServerConfig.local_prefill_tokens must be an integer >= 0, "
                             f"got {self.local_prefill_tokens!r}")
        chunk = self.local_prefill_chunk_tokens
        if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 0):
            raise ValueError(f"DecodeServerConfig.local_prefill_chunk_tokens must be an integer >= 0 or None, "
                             f"got {chunk!r}")
        interval = self.stream_interval
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise ValueError(f"DecodeServerConfig.stream_interval must be an integer >= 1, got {interval!r}")


@dataclass(slots=True, eq=False)
class DecodeRequest:
    req_id: str
    state: DecodeState
    nonce: str = ""  # its transfer ticket's; "" for a colocated request
    seq: Sequence | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # RequestOutput, or the error that ends it
    progress: TransferProgress = field(default_factory=TransferProgress)
    pinned: PinnedBlocks | None = None  # after KVTargetReady: the reservation's blocks, as reserved
    spans: RequestSpans | None = None  # reservation, transfer, decode
    num_tokens: int = 0  # generated and sent
    num_steps: int = 0  # the engine outputs whose tokens were sent (`RequestOutput.num_steps`)
    interval: int = 1  # its stream's `stream_interval`
    num_queued: int | None = None  # tokens handed to its stream so far (None: none yet)
    stream: OpenStream | None = None  # the router's token stream its tokens go on (None: its own call)
    last_sent: float = 0.0  # when its token stream last sent it tokens (monotonic)
    merge: bool = True  # on its own call: a newer output replaces the one waiting (`merge_backlog`)
    waiting: RequestOutput | None = None  # merging: its newest output its call has not taken (WAITING in events)
    num_merged: int = 0  # outputs replaced while waiting since its call last took one

    def deliver(self, item) -> None:
        """The engine loop's sink for this request. An output goes to the stream when it completes
        a group (its first tokens, `interval` more, the last), a failure at once; an output short
        of a group is dropped, as the next one carries its tokens too (`RequestOutput.token_ids`
        is all of them so far). So the stream's coroutine wakes once a group, not once a step.
        Merging, an output its own call has not taken yet is replaced by the newer one (`take`)."""
        if isinstance(item, RequestOutput):
            if not item.finished and self.num_queued is not None and len(item.token_ids) - self.num_queued < self.interval:
                return
            self.num_queued = len(item.token_ids)
            if self.stream is not None:
                self.stream.put(self, item)
                return
            if self.merge:
                if self.waiting is not None:  # its place in events is kept: a failure after it stays after it
                    self.waiting, self.num_merged = item, self.num_merged + 1
                    return
                self.waiting, item = item, WAITING
        elif self.stream is not None:  # a failure: after the tokens before it (`OpenStream.put_failure`)
            self.stream.put_failure(self, item)
            return
        self.events.put_nowait(item)

    def take(self, item):
        """What an item from `events` stands for: the waiting output for WAITING, else itself."""
        if item is WAITING:
            item, self.waiting = self.waiting, None
        return item

    @property
    def kv_blocks(self) -> Sequence | PinnedBlocks:
        """Where the transfer writes: the held sequence, or once it decodes its pinned blocks."""
        return self.pinned or self.seq

    @property
    def is_live(self) -> bool:
        return self.state in (DecodeState.RESERVED, DecodeState.RECEIVING, DecodeState.RUNNING)


class DecodeWorkerServicer(KVIntake, TokenStreams, WorkerService, worker_pb2_grpc.DecodeWorkerServicer):
    role = "decode"

    def __init__(self, config: DecodeServerConfig, metrics=None, security: ClusterSecurity = ClusterSecurity()):
        super().__init__(metrics, security)
        self.config = config
        self.receiver: KVReceiver | None = None
        self.transfers: dict[str, DecodeRequest] = {}  # ticket nonce -> reserved request; asyncio loop only
        self.num_reservations_expired = 0  # reserved, then no verified transfer within the timeout
        # the token streams: deltas sent, their tokens, outputs merged into a later delta (`merge_backlog`)
        self.num_stream_messages = self.num_stream_tokens = self.num_merged_outputs = 0
        self.live: set[DecodeRequest] = set()  # every request with an open stream; asyncio loop only
        self.probe: shm.Probe | None = None  # made once the cache is known to be in host memory
        self.local_chunk: int | None = None  # the local tails' cap a step (`local_prefill_chunk_tokens`), once loaded
        self.token_streams: dict[str, OpenStream] = {}  # the routers' open TokenStreams by id; asyncio loop only

    def add_to(self, server: AioServer) -> None:
        server.add(add_decode_worker_servicer, self, worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"])

    def close(self) -> None:
        if self.probe is not None:
            self.probe.close()

    def server_options(self) -> list[tuple]:
        return KV_TRANSFER_OPTIONS  # it receives the bulk KV pushes

    def attach(self, loop: EngineLoop, model_name: str) -> None:
        super().attach(loop, model_name)
        e = loop.engine
        chunk = self.config.local_prefill_chunk_tokens
        self.local_chunk = (chunk if chunk is not None else LOCAL_PREFILL_CHUNK_TOKENS if e.device.type == "cpu"
                            else None) or None
        groups = list(zip(kv_group_layouts(e), (kv for _, kv in kv_cache_groups(e))))
        dist_groups = DistGroups(self.config.kv_transfer_timeout_s) if self.config.kv_dist and dist.is_available() else None
        self.receiver = KVReceiver(groups, e.kv_dtype, e.config.block_size, e.model_config.vocab_size, dist_groups)
        if self.receiver.dist_backend is not None:
            self.info.kv_dist_backends.append(self.receiver.dist_backend)
        self.info.token_streams = True
        self.info.kv_target_ready = len(groups) > 1  # a draft: decode on the target's K/V, take the draft's after
        if self.config.kv_shm and self.receiver.accepts_shm and shm.is_available():
            shm.clean_stale_segments()
            self.probe = shm.Probe()
            self.info.shm_probe, self.info.shm_probe_nonce = self.probe.name, self.probe.nonce

    @property
    def num_live_requests(self) -> int:
        return len(self.live)

    async def _parse(self, request, context):
        """(req_id, prompt ids, params, the token stream its tokens go on or None)."""
        await self.check_accepting(context)
        try:
            parsed = parse_work_request(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        stream = None
        if request.token_stream:
            stream = self.token_streams.get(request.token_stream)
            if stream is None or stream.closed:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"token stream {request.token_stream!r} is not open on this worker")
        return (*parsed, stream)

    # ---- disaggregated: reserve, then tokens once the K/V arrived ---------------------------
    async def Decode(self, request, context):
        req_id, ids, params, stream = await self._parse(request, context)
        await self._check_new(req_id, context)
        r = DecodeRequest(req_id, DecodeState.RESERVED, spans=self._spans(req_id, context, len(ids)),
                          interval=self.config.stream_interval, stream=stream, merge=self.config.merge_backlog)
        r.seq, here = await self._reserve(r, ids, params, context)
        text = ""
        if here:  # the cache holds all but a short tail, which the engine is prefilling already
            r.state = DecodeState.RUNNING
            r.spans.start("decode")
        else:
            text, ticket = issue(self.ticket_key, req_id, self.advertised_address, self.config.kv_transfer_timeout_s,
                                 r.seq.num_cached_tokens)
            r.nonce = ticket.nonce
            self.transfers[r.nonce] = r
        self.num_requests_total += 1
        try:
            yield worker_pb2.DecodeEvent(admitted=worker_pb2.Admitted(
                ticket=text, num_free_blocks=self.engine.block_manager.num_free_blocks,
                num_cached_tokens=r.seq.num_cached_tokens, prefills_here=here))
            if r.stream is not None:
                await self._until_done(r, context)
                return
            async for event in self._token_stream(r, context):
                yield event
        finally:
            self.transfers.pop(r.nonce, None)
            self._untrack(r)
            self._end(r, TransferError(TransferFailure.ABORTED, "the request was cancelled"))
            self._log_end(r)

    async def _reserve(self, r: DecodeRequest, ids: list[int], params, context) -> tuple[Sequence, bool]:
        """The engine's reservation for r's prompt, and whether the engine prefills its tail here
        (`LLMEngine.reserve`'s local_tail); the call ends INVALID_ARGUMENT or RESOURCE_EXHAUSTED
        when it cannot reserve. r's sink is in place first: a tail prefilled here may stream its
        first token before this coroutine resumes."""
        tail, chunk = self.config.local_prefill_tokens, self.local_chunk

        def reserve(e: LLMEngine) -> tuple[Sequence | None, bool]:
            seq = e.reserve(r.req_id, ids, params, tail, chunk)
            return seq, seq is not None and seq.status is SequenceStatus.RUNNING

        r.spans.start("reservation")
        self._track(r)
        pending = self.loop.call(reserve)
        try:
            seq, here = await asyncio.shield(pending)
        except ValueError as e:
            self._untrack(r)
            r.spans.finish("invalid_argument")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except asyncio.CancelledError:  # the router went away while we reserved: give the blocks back
            self._untrack(r)
            r.spans.finish("cancelled")
            pending.add_done_callback(lambda f: f.exception() is None and f.result()[0] is not None and self.loop.call(
                lambda e: e.abort(r.req_id)))
            raise
        r.spans.end("reservation")
        if seq is None:
            self._untrack(r)
            r.spans.finish("resource_exhausted")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self._no_room(len(ids)))
        return seq, here

    async def _check_new(self, req_id: str, context) -> None:
        """A second call with a live request's id must not touch it: ALREADY_EXISTS."""
        if req_id in self.loop.sinks:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"req_id {req_id!r} is already being served")

    def _no_room(self, num_prompt_tokens: int) -> str:
        e = self.engine
        need = e.block_manager.blocks_for(num_prompt_tokens + 1)
        return (f"decode worker is full: {e.block_manager.num_free_blocks} free KV blocks (request needs {need}), "
                f"{e.scheduler.num_seqs} of {e.scheduler.config.max_num_seqs} sequences")

    # ---- colocated: the engine prefills the request itself -------------------------------
    async def PrefillAndDecode(self, request, context):
        req_id, ids, params, stream = await self._parse(request, context)
        await self._check_new(req_id, context)
        r = DecodeRequest(req_id, DecodeState.RUNNING, spans=self._spans(req_id, context, len(ids)),
                          interval=self.config.stream_interval, stream=stream, merge=self.config.merge_backlog)
        r.spans.start("decode")
        self._track(r)
        try:
            try:
                await self.loop.call(lambda e: e.add_request(req_id, ids, params))
            except ValueError as e:
                r.state = DecodeState.FAILED
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            self.num_requests_total += 1
            yield worker_pb2.DecodeEvent(admitted=worker_pb2.Admitted(
                num_free_blocks=self.engine.block_manager.num_free_blocks))
            if r.stream is not None:
                await self._until_done(r, context)
                return
            async for event in self._token_stream(r, context):
                yield event
        finally:
            self._untrack(r)
            self._end(r, TransferError(TransferFailure.ABORTED, "the request was cancelled"))
            self._log_end(r)

    @staticmethod
    def _spans(req_id: str, context, num_prompt_tokens: int) -> RequestSpans:
        """The request's id for this task's log lines and its spans, from the call's metadata."""
        metadata = context.invocation_metadata()
        request_id.set(metadata_value(metadata, REQUEST_ID_KEY) or req_id)
        return RequestSpans("pdserve.decode", extract(metadata), req_id=req_id, prompt_tokens=num_prompt_tokens)

    @staticmethod
    def _log_end(r: DecodeRequest) -> None:
        status = "ok" if r.state is DecodeState.FINISHED else r.state.value
        r.spans.finish(status, completion_tokens=r.num_tokens)
        log.info("request", extra=fields(state=r.state.value, completion_tokens=r.num_tokens))

    def _track(self, r: DecodeRequest) -> None:
        self.live.add(r)
        self.loop.sinks[r.req_id] = r.deliver
        if r.stream is not None:
            r.stream.bound.add(r)

    def _untrack(self, r: DecodeRequest) -> None:
        self.live.discard(r)
        if r.stream is not None:
            r.stream.bound.discard(r)
        if self.loop.sinks.get(r.req_id) == r.deliver:  # only its own
            del self.loop.sinks[r.req_id]

    # ---- the token stream both modes share -----------------------------------------------
    async def _token_stream(self, r: DecodeRequest, context) -> AsyncIterator[worker_pb2.DecodeEvent]:
        """Token deltas until the request finishes; a failure ends the call with its status. The
        first wait covers the transfer (reserved requests), later ones a group of tokens each
        (`DecodeRequest.deliver`: every token, or `stream_interval` of them; merging, the newest
        of the groups that came while the last delta was written)."""
        timeout = self.config.kv_transfer_timeout_s if r.state is DecodeState.RESERVED else self.config.stream_timeout_s
        while True:
            try:  # a timer, not wait_for's task a delta: 12 against 8 µs a delta (scratch timing, one loop)
                async with asyncio.timeout(timeout):
                    item = r.take(await r.events.get())
            except TimeoutError:
                item = self._timed_out(r, timeout)
            self.num_merged_outputs += r.num_merged
            r.num_merged = 0
            await self._abort_if_failed(r, item, context)
            timeout = self.config.stream_timeout_s
            if item.finished:
                r.state = DecodeState.FINISHED
            delta = token_delta(item, r.num_tokens, r.num_steps)  # the tokens after those sent before
            self.num_stream_messages += 1
            self.num_stream_tokens += len(item.token_ids) - r.num_tokens
            r.num_tokens, r.num_steps = len(item.token_ids), item.num_steps
            yield delta
            if item.finished:
                return

    def _timed_out(self, r: DecodeRequest, timeout: float) -> TransferError:
        """r waited `timeout` for its transfer or its next token: it ends, failed, with this error."""
        transferring = r.state in (DecodeState.RESERVED, DecodeState.RECEIVING)
        what = "verified KV transfer" if transferring else "token"
        self.num_reservations_expired += r.state is DecodeState.RESERVED
        err = TransferError(TransferFailure.TIMEOUT, f"no {what} within {timeout:g} s")
        self._end(r, err)
        return err

    async def _abort_if_failed(self, r: DecodeRequest, item, context) -> None:
        """End r's call with the status of a failure taken from its events (a no-op for anything else)."""
        if isinstance(item, TransferError):
            await context.abort(STATUS_OF[item.failure], str(item))
        if isinstance(item, EngineStepFailed):
            r.state = DecodeState.FAILED
            # on a token stream: how many tokens it carried, which the router reads before failing
            sent = ((STREAM_TOKENS_METADATA, str(r.num_tokens)),) if r.stream is not None else ()
            await context.abort(grpc.StatusCode.INTERNAL, str(item), trailing_metadata=sent)

    def _end(self, r: DecodeRequest, err: TransferError) -> None:
        """End a live request (failed, or cancelled when `err` is ABORTED): its stream gets the
        error and its blocks are freed on the engine thread. Idempotent; a no-op once ended."""
        if not r.is_live:
            return
        was_transferring = r.state in (DecodeState.RESERVED, DecodeState.RECEIVING) and r.nonce
        r.state = DecodeState.CANCELLED if err.failure is TransferFailure.ABORTED else DecodeState.FAILED
        if r.state is DecodeState.FAILED:
            self.kv_transfer_failures_total += bool(was_transferring)
            log.warning("request %s failed: %s", r.req_id, err)
        r.events.put_nowait(err)
        if self.loop.sinks.get(r.req_id) == r.deliver:
            del self.loop.sinks[r.req_id]
        self.loop.call(lambda e: e.abort(r.req_id))

    # ---- the K/V push from a prefill worker (KVEndpoint; its stream: `KVIntake.receive_kv`) --
    async def PushKV(self, request_iterator, context):
        await self.check_ready(context)
        return await serve_push_kv(self, request_iterator, context)

    def extra_stats(self) -> dict:
        stats = dict(num_reservations_expired=self.num_reservations_expired,
                     stream_messages_total=self.num_stream_messages, stream_tokens_total=self.num_stream_tokens,
                     stream_merged_outputs_total=self.num_merged_outputs)
        spec = self.engine.speculator
        if spec is not None:
            st = spec.stats
            stats.update(spec_num_drafts=st.num_drafts, spec_num_draft_tokens=st.num_draft_tokens,
                         spec_num_accepted_tokens=st.num_accepted_tokens, spec_accepted_per_pos=list(st.accepted_per_pos))
        return stats
