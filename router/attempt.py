"""One attempt of a request on one worker pair: the calls the router makes to its workers.

    admit: a decode worker's reservation (Decode, or PrefillAndDecode when it prefills the
        request itself), trying the least loaded first and waiting in the admission queue while
        every one is full
    prefill: PrefillStream on the paired prefill worker, which pushes the K/V where the
        reservation's ticket says and sends the first token as soon as it is sampled
    events: the decode stream's token deltas (on the router's token stream to that worker where
        it has one: `token_streams.py`), the prefill worker's first token ahead of them,
        and a failed prefill (until the decode stream streams: then the decode worker has what
        it needs) or the router's own abort as the attempt's failure

Worker failures come out as `RequestFailed` with the worker named; what to do about them
(fail over, or end the request) is `server.Router`'s.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from pdserve.router.admission import AdmissionQueue, QueueFull
from pdserve.router.request import RequestFailed
from pdserve.router.token_streams import StreamedCall, WorkerTokenStream
from pdserve.router.workers import Worker, WorkerPool
from pdserve.v1 import generation_pb2 as gen_pb2
from pdserve.v1 import worker_pb2

log = logging.getLogger("pdserve.router")


@dataclass(slots=True, eq=False)
class Flight:
    """A request in flight: its current worker call, and why the router ended it, if it did."""

    call: object = None
    abort_reason: str | None = None

    def abort(self, reason: str) -> None:
        self.abort_reason = reason
        if self.call is not None:
            self.call.cancel()


class PairCalls:
    """The worker calls of a request's attempts, over the router's pool, admission queue and
    policy (`server.RouterPolicy`: its timeouts)."""

    def __init__(self, pool: WorkerPool, admission: AdmissionQueue, policy):
        self.pool, self.admission, self.policy = pool, admission, policy
        self.token_streams: dict[Worker, WorkerTokenStream] = {}  # decode worker -> this router's stream there

    def close(self) -> None:
        """End the token streams (the router stops)."""
        for stream in self.token_streams.values():
            stream.close()
        self.token_streams.clear()

    async def _token_stream(self, w: Worker) -> WorkerTokenStream | None:
        """This router's open token stream on w, or None where its requests' tokens come on
        their own calls (the policy's `token_streams` off, a worker without them, or one whose
        stream does not open)."""
        if not self.policy.token_streams or w.info is None or not w.info.token_streams:
            return None
        stream = self.token_streams.get(w)
        if stream is None:
            for gone in [v for v in self.token_streams if v.is_removed]:
                self.token_streams.pop(gone).close()
            stream = self.token_streams[w] = WorkerTokenStream(w.stub, self.pool.security.metadata)
        return stream if await stream.open() else None

    async def admit(self, work: worker_pb2.WorkRequest, is_failover: bool, deadline: float, metadata=()):
        """A decode worker's reservation: (call, worker, its `Admitted`, whether the request was
        sent to be prefilled there: colocated, or no prefill worker is healthy; a disaggregated
        reservation may still come back `prefills_here`). Waits in the admission queue
        while every worker is full; when a pool has no usable worker, UNAVAILABLE at once (or,
        during a failover, after `failover_wait_s` for one to come back)."""
        queue_deadline = min(deadline, time.monotonic() + self.policy.queue_timeout_s)
        while True:
            candidates = await self._candidates(is_failover, list(work.prompt_token_ids))
            colocated = not self.pool.is_disaggregated or self.pool.prefill_down()
            for w in candidates:
                w.num_in_flight += 1  # before the answer: a burst spreads over the workers
                try:
                    admitted = await self._reserve(w, work, deadline, metadata, colocated)
                except BaseException:
                    w.num_in_flight -= 1
                    raise
                if admitted is not None:
                    if len(self.admission):
                        self.admission.wake_one()  # there may be room for the next one too
                    return (*admitted, colocated)
                w.num_in_flight -= 1
            remaining = queue_deadline - time.monotonic()
            if remaining <= 0:
                raise RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"no decode worker could admit the request within {self.policy.queue_timeout_s:g} s")
            try:
                await self.admission.wait(remaining)
            except QueueFull as e:
                raise RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, f"router is overloaded: {e}") from None

    async def _candidates(self, wait: bool, prompt_ids: list[int]) -> list[Worker]:
        give_up = time.monotonic() + (self.policy.failover_wait_s if wait else 0)
        while (missing := self.pool.missing()) is not None:
            if time.monotonic() >= give_up:
                # final: a new request gets it at once, a failover after its wait
                raise RequestFailed(grpc.StatusCode.UNAVAILABLE, f"cannot serve: {missing}", is_final=True)
            await asyncio.sleep(0.1)
        return self.pool.decode_candidates(prompt_ids)

    async def _reserve(self, w: Worker, work: worker_pb2.WorkRequest, deadline: float, metadata=(),
                       colocated: bool = False):
        """(call, worker, its `Admitted`), or None when this worker cannot take it. The call is a
        `StreamedCall` where the tokens come on the router's token stream to w."""
        stream = await self._token_stream(w)
        work.token_stream = stream.stream_id if stream is not None else ""
        mailbox = stream.register(work.req_id) if stream is not None else None  # before: tokens may come first
        rpc = w.stub.PrefillAndDecode if colocated else w.stub.Decode
        call = rpc(work, timeout=max(deadline - time.monotonic(), 0.001), metadata=metadata)
        event = None
        try:
            event = await call.read()
        except asyncio.CancelledError:
            call.cancel()
            raise
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                self.pool.mark_unavailable(w)
                return None
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                return None
            raise RequestFailed(e.code(), e.details()) from None
        finally:
            if event is None and stream is not None:
                stream.unregister(work.req_id, mailbox)
        w.stats.num_free_blocks = event.admitted.num_free_blocks
        if stream is not None:
            call = StreamedCall(call, stream, work.req_id, mailbox)
        return call, w, event.admitted

    async def prefill(self, work: worker_pb2.WorkRequest, decode: Worker, ticket: str,
                       deadline: float, metadata=(), first: asyncio.Future | None = None
                       ) -> worker_pb2.PrefillResponse:
        """The prefill worker's account once the decode side has the K/V. `first` gets the first
        token's `FirstToken` as soon as the prefill worker sampled it (None if it never says)."""
        prompt = list(work.prompt_token_ids)
        candidates = self.pool.prefill_candidates(decode, prompt)
        if not candidates:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, f"no healthy prefill worker pairs with {decode.address}")
        w = candidates[0]
        w.num_queued_prompt_tokens += len(prompt)
        w.num_in_flight += 1
        # a decode worker with a draft starts on the target's K/V when it says so (KVTargetReady)
        target_ready = decode.info is not None and decode.info.kv_target_ready
        call = w.stub.PrefillStream(worker_pb2.PrefillRequest(request=work, ticket=ticket, target_ready=target_ready),
                                    timeout=max(deadline - time.monotonic(), 0.001), metadata=metadata)
        resp = None
        try:
            while (event := await call.read()) is not grpc.aio.EOF:
                if event.WhichOneof("event") == "first_token":
                    if first is not None and not first.done():
                        first.set_result(event.first_token)
                elif event.WhichOneof("event") == "done":
                    resp = event.done
            if resp is None:
                raise RequestFailed(grpc.StatusCode.UNAVAILABLE, f"prefill on {w.address} ended without its outcome")
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                self.pool.mark_unavailable(w)
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:  # the pair no longer matches: ask both again
                w.info = decode.info = None
            raise RequestFailed(e.code(), f"prefill on {w.address} failed: {e.details()}") from None
        finally:
            call.cancel()  # a no-op once it ended; stops the prefill when we are cancelled
            if first is not None and not first.done():
                first.set_result(None)
            w.num_queued_prompt_tokens -= len(prompt)
            w.num_in_flight -= 1
        w.prefixes.insert(prompt, w.info.block_size if w.info else 16)
        return resp

    async def events(self, call, decode: Worker, prefill_task: asyncio.Task | None, flight: Flight,
                      first: asyncio.Future | None = None):
        """(token ids, finish reason, log-probs, engine steps) of each delta on the decode stream
        (steps: `TokenDelta.num_steps`, 0 where the worker did not count them); a failed prefill
        ends it with the prefill's failure, and the router's own abort with its reason. With
        `first`, the prefill worker's first token goes out as soon as it comes, and the decode
        stream's copy of it (and of its step) is skipped; a first token that ends the request, with
        how it ends, is the whole answer (the decode stream is left: the caller cancels it). Once
        the decode stream has streamed tokens, the decode worker holds the request's verified K/V,
        and a failing prefill (one killed after handing the target's K/V over, or whose draft's
        pass failed) no longer ends it."""
        failure: list[RequestFailed] = []
        decoding = [False]  # the decode stream has streamed tokens
        if prefill_task is not None:
            prefill_task.add_done_callback(lambda t: _on_prefill_done(t, call, failure, decoding))
        early = None
        try:
            # read(), not `async for`: admission already read() the first event, and grpc.aio
            # forbids mixing the two on one call
            read = asyncio.ensure_future(call.read())
            read.add_done_callback(_retrieve)
            if first is not None:
                await asyncio.wait({read, first}, return_when=asyncio.FIRST_COMPLETED)
                if (last := _final_first_token(first)) is not None:
                    yield last
                    return
                # the prefill worker's token first, even where the decode stream's delta came in the
                # same wake-up (a busy loop): that delta then skips its copy
                if first.done() and first.result() is not None:
                    early = first.result()
                    logprobs = [early.logprobs] if early.HasField("logprobs") else []
                    yield [early.token_id], gen_pb2.FINISH_REASON_UNSPECIFIED, logprobs, 1
            event = await read
            while event is not grpc.aio.EOF:
                if event.WhichOneof("event") == "tokens":
                    decoding[0] = True
                    ids, logprobs = list(event.tokens.token_ids), list(event.tokens.logprobs)
                    steps = event.tokens.num_steps
                    if early is not None and ids:  # the first token, which went out already
                        if ids[0] != early.token_id:
                            raise RequestFailed(grpc.StatusCode.INTERNAL, f"decode worker {decode.address} "
                                                f"began with token {ids[0]}, the prefill worker sampled "
                                                f"{early.token_id}")
                        ids, logprobs, early, steps = ids[1:], logprobs[1:], None, max(steps - 1, 0)
                    if ids or event.tokens.finish_reason:
                        yield ids, event.tokens.finish_reason, logprobs, steps
                event = await call.read()
        except grpc.aio.AioRpcError as e:
            # the prefill worker's first token ended the request, and its abandoned push ended the
            # reservation before that token reached us: the token is still the answer. The two
            # come on separate streams, so the decode side's ABORTED can overtake the token: then
            # the prefill worker's word is waited for (it ends its stream right after), at most
            # FIRST_TOKEN_GRACE_S; without the wait, such a request failed over on every pair
            # whenever the ABORTED came first, and ended UNAVAILABLE.
            if early is None and first is not None:
                if not first.done() and e.code() == grpc.StatusCode.ABORTED:
                    await asyncio.wait({first}, timeout=FIRST_TOKEN_GRACE_S)
                if (last := _final_first_token(first)) is not None:
                    yield last
                    return
            if (not failure and e.code() == grpc.StatusCode.DATA_LOSS and prefill_task is not None
                    and not prefill_task.done()):
                # the decode side saw the transfer end short or corrupt; when the prefill worker
                # gave it up, its own failure says why (a failed hand-over, a failed draft pass)
                await asyncio.wait({prefill_task}, timeout=PREFILL_REASON_GRACE_S)
            if not failure and prefill_task is not None and prefill_task.done():
                _on_prefill_done(prefill_task, call, failure, decoding)
            if failure:
                raise failure[0] from None
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                self.pool.mark_unavailable(decode)
            raise RequestFailed(e.code(), f"decode on {decode.address}: {e.details()}") from None
        except asyncio.CancelledError:
            if failure:  # our own cancel of the decode call, because the prefill failed
                raise failure[0] from None
            if flight.abort_reason is not None:
                raise RequestFailed(grpc.StatusCode.UNAVAILABLE, flight.abort_reason) from None
            raise


FIRST_TOKEN_GRACE_S = 10.0  # for the prefill worker's first token once the decode side says its sender gave up
PREFILL_REASON_GRACE_S = 1.0  # for the prefill worker's own failure once the decode side saw its transfer fail


def _final_first_token(first: asyncio.Future) -> tuple | None:
    """The prefill worker's first token as the request's last delta, when it ends the request
    and says how (an older prefill worker leaves that to the decode worker)."""
    if not first.done() or first.cancelled() or first.exception() is not None or first.result() is None:
        return None
    token = first.result()
    if not token.ends_request or token.finish_reason == gen_pb2.FINISH_REASON_UNSPECIFIED:
        return None
    return [token.token_id], token.finish_reason, [token.logprobs] if token.HasField("logprobs") else [], 1


def _retrieve(future: asyncio.Future) -> None:
    """A read the caller may never await (it went away): its error is not worth a warning."""
    if not future.cancelled():
        future.exception()


def _on_prefill_done(task: asyncio.Task, call, failure: list, decoding: list[bool]) -> None:
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None and decoding[0]:
        log.warning("%s after the decode worker began decoding: the request goes on", exc)
    elif exc is not None:
        failure.append(exc if isinstance(exc, RequestFailed) else RequestFailed(grpc.StatusCode.INTERNAL, repr(exc)))
        call.cancel()
