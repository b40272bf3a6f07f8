"""The public `pdserve.v1.Generation` service and the request life cycle behind it (the states
of `router.request.RequestState`). Protobuf of the public API stops here.

    received: validated, tokenized (INVALID_ARGUMENT otherwise; UNAVAILABLE at once, naming the
        pool, when a pool has no usable worker)
    ──► admitted: Decode() on the least loaded decode worker reserves its blocks, or on one
        nearly as loaded whose prefix cache probably holds the prompt's start (a conversation's
        earlier turn, served there: `WorkerPool.decode_candidates`)
        (RESOURCE_EXHAUSTED: the next worker; none has room: the bounded admission queue)
    ──► prefilling: Prefill() on a paired prefill worker — the one with the least queued work
        beyond the prefix it probably has cached — with the transfer ticket the reservation
        answered; it pushes the K/V where the ticket says (unless the reservation answered
        `prefills_here`: the decode worker held all but a short tail of the prompt, and
        prefills that itself)
    ──► streaming: token deltas from the decode stream become text deltas (`ClientStream`)
    ──► finished: the last delta carries finish reason and usage

Failover: when a worker fails mid-request (unreachable, a failed transfer, a failed step), the
request is re-admitted with its prompt plus the tokens already sent, `max_tokens` reduced by as
many, on other workers, and the same client stream continues; sampling is keyed by (seed,
position), so the continuation is the one the failed worker would have produced. At most
`max_failovers` times; then UNAVAILABLE says what failed. However a request ends, both worker
calls are cancelled, which frees its blocks on both workers.

The worker calls of one attempt (admission, prefill, the decode stream) are `attempt.PairCalls`'s.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass

import grpc

from pdserve.engine.tokenizer import Tokenizer
from pdserve.router.admission import AdmissionQueue
from pdserve.router.api_keys import ApiKeys
from pdserve.router.attempt import Flight, PairCalls
from pdserve.router.metrics import RequestTrace, RouterMetrics
from pdserve.router.request import RequestFailed, RequestState, RouterRequest
from pdserve.router.stream import ClientStream
from pdserve.router.validate import Validator
from pdserve.router import wire
from pdserve.router.workers import WorkerPool
from pdserve.serving.convert import FINISH_REASON_NAMES, work_request_message
from pdserve.serving.logs import fields
from pdserve.serving.tracing import RequestSpans, extract, outgoing_metadata
from pdserve.v1 import generation_pb2 as gen_pb2
from pdserve.v1 import generation_pb2_grpc, worker_pb2

log = logging.getLogger("pdserve.router")

# Failures of a worker, after which another pair may well succeed. INVALID_ARGUMENT,
# RESOURCE_EXHAUSTED (the queue handles it) and the request's own deadline are final.
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.DATA_LOSS,
             grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED,
             grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DEADLINE_EXCEEDED}


@dataclass(frozen=True, slots=True)
class RouterPolicy:
    rpc_timeout_s: float = 300.0  # a whole request, failovers included
    queue_timeout_s: float = 30.0  # waiting for a decode worker with room
    max_failovers: int = 3
    failover_wait_s: float = 30.0  # for a usable worker to (re)appear during a failover
    # take each decode worker's tokens for all of this router's requests on one stream, a message a
    # step (router/token_streams.py), where the worker has it; False: each request's on its own call
    token_streams: bool = True

    def __post_init__(self) -> None:
        for name in ("rpc_timeout_s", "queue_timeout_s", "failover_wait_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"RouterPolicy.{name} must be > 0, got {getattr(self, name)}")
        if self.max_failovers < 0:
            raise ValueError(f"RouterPolicy.max_failovers must be >= 0, got {self.max_failovers}")


class Router:
    """Runs requests to completion as async iterators of `GenerateResponse`; no gRPC server
    types here, so the HTTP front end shares it."""

    def __init__(self, pool: WorkerPool, validator: Validator, tokenizer: Tokenizer | None,
                 admission: AdmissionQueue, policy: RouterPolicy = RouterPolicy(),
                 metrics: RouterMetrics | None = None, api_keys: ApiKeys | None = None):
        self.pool = pool
        self.validator = validator
        self.api_keys = api_keys or ApiKeys()
        # tokenizing runs off the event loop, a few prompts at a time: one client's huge prompts
        # then delay other prompts' tokenizing, not every stream and health check
        self._tokenizing = asyncio.Semaphore(2)
        self.tokenizer = tokenizer
        self.admission = admission
        self.policy = policy
        self.calls = PairCalls(pool, admission, policy)  # one attempt's worker calls
        self.metrics = metrics or RouterMetrics()
        self.flights: set[Flight] = set()
        self.is_draining = False
        self.prometheus_targets = None  # `pdserve serve`: () -> its processes' scrape targets (HTTP SD)
        self.metrics.watch(self)

    def check_accepting(self) -> None:
        if self.is_draining:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, "the router is shutting down")

    async def parse(self, msg) -> RouterRequest:
        """Validate and tokenize off the event loop (ValueError / RequestFailed as the validator)."""
        async with self._tokenizing:
            return await asyncio.to_thread(self.validator.parse, msg)

    async def drain(self, timeout_s: float) -> None:
        """Shutting down: refuse new requests, give those in flight `timeout_s` to finish, then
        end them with UNAVAILABLE saying why."""
        self.is_draining = True
        deadline = time.monotonic() + timeout_s
        while self.flights and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for flight in list(self.flights):
            flight.abort(f"the router is shutting down: the request did not finish within the {timeout_s:g} s drain")
        while self.flights and time.monotonic() < deadline + 5:
            await asyncio.sleep(0.05)

    async def generate(self, req: RouterRequest, trace: RequestTrace | None = None, parent=None):
        """`trace`: from `metrics.arrived()` when the request arrived (default: now); `parent`:
        the client's trace context (`serving.tracing.extract`), if it sent one."""
        trace = trace or self.metrics.arrived()
        stream = ClientStream(req, self.tokenizer)
        deadline = time.monotonic() + self.policy.rpc_timeout_s
        failures: list[RequestFailed] = []
        flight = Flight()
        self.flights.add(flight)
        spans = RequestSpans("pdserve.request", parent, req_id=req.req_id, client_request_id=req.client_request_id,
                             prompt_tokens=len(req.prompt_token_ids))
        status = "cancelled"
        try:
            while True:
                try:
                    async for resp in self._attempt(req, stream, trace, len(failures), deadline, flight, spans):
                        trace.state = RequestState.FINISHED if stream.finished else RequestState.STREAMING
                        self.metrics.delta_out(trace, len(resp.token_ids))
                        if stream.finished:  # as the last delta leaves, not when the client reads on
                            self.metrics.ended(trace, "ok", FINISH_REASON_NAMES.get(resp.finish_reason))
                            status = "ok"
                        yield resp
                    return
                except RequestFailed as e:
                    if flight.abort_reason is not None:
                        raise
                    self._check_retry(req, e, failures, deadline)
                    failures.append(e)
                    trace.state = RequestState.RE_ADMITTED
                    self.metrics.failed_over()
                    log.warning("failing over after %d tokens (attempt %d): %s: %s", len(stream.sent_ids),
                                len(failures), e.code.name, e, extra={"req_id": req.req_id})
        except RequestFailed as e:
            trace.state = RequestState.FAILED
            status = e.code.name.lower()
            self.metrics.ended(trace, status)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            trace.state = RequestState.CANCELLED
            raise
        except Exception:
            trace.state = RequestState.FAILED
            status = "error"
            self.metrics.ended(trace, "error")
            raise
        finally:
            self.flights.discard(flight)
            spans.finish(status, completion_tokens=len(stream.sent_ids), failovers=len(failures))
            log_request(req, trace, status, len(stream.sent_ids), len(failures))
            if trace.state is not RequestState.FINISHED:
                self.metrics.ended(trace, "cancelled")  # a no-op when it ended above

    def _check_retry(self, req: RouterRequest, e: RequestFailed, failures: list[RequestFailed], deadline: float):
        """Raise the error the client gets when this failure is final."""
        if e.code not in RETRYABLE or e.is_final:
            raise e
        if time.monotonic() >= deadline:
            raise RequestFailed(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"the request took over {self.policy.rpc_timeout_s:g} s; last failure: {e}")
        if len(failures) >= self.policy.max_failovers:
            if not failures:  # failover is off: the worker's own verdict
                raise e
            what = "; ".join(f"{f.code.name}: {f}" for f in [*failures, e])
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE,
                                f"request failed on {len(failures) + 1} worker pairs: {what}")

    # ---- one attempt: admission, prefill, the decode stream ------------------------------
    async def _attempt(self, req: RouterRequest, stream: ClientStream, trace: RequestTrace, attempt: int,
                       deadline: float, flight: Flight, spans: RequestSpans):
        work = self._work(req, stream, attempt)
        # the cluster's credentials, and the request's id and trace context, on every worker call
        metadata = (*self.pool.security.metadata,
                    *outgoing_metadata(work.req_id, spans.start("attempt", attempt=attempt)))
        spans.start("admission")
        try:
            call, decode, admitted, colocated = await self.calls.admit(work, attempt > 0, deadline, metadata)
        except BaseException:
            spans.end("attempt")
            raise
        finally:
            spans.end("admission")
        flight.call = call
        prefill_task = None
        try:
            if attempt == 0:
                trace.state = RequestState.ADMITTED
            self.metrics.admitted(trace, attempt, len(req.prompt_token_ids), colocated or admitted.prefills_here)
            first = None
            if colocated:
                if self.pool.is_disaggregated:
                    self.metrics.prefill_fallbacks.inc()
                    log.warning("no healthy prefill worker: %s prefills the request itself", decode.address,
                                extra={"req_id": req.req_id})
            elif admitted.prefills_here:  # it holds all but a short tail of the prompt
                self.metrics.local_prefills.inc()
            else:
                first = asyncio.get_running_loop().create_future()
                prefill_task = asyncio.create_task(self.calls.prefill(work, decode, admitted.ticket, deadline,
                                                                      metadata, first))
                prefill_task.add_done_callback(lambda task: self._prefilled(task, trace, attempt))
                trace.state = RequestState.PREFILLING
            async for ids, reason, logprobs, steps in self.calls.events(call, decode, prefill_task, flight, first):
                self.metrics.received(trace, len(ids))
                yield stream.delta(ids, reason, logprobs, steps)
                if stream.finished:  # the decode worker's cache now holds the prompt and the answer
                    decode.prefixes.insert(req.prompt_token_ids + stream.sent_ids, decode.info.block_size
                                           if decode.info else 16)
                    return
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, f"decode worker {decode.address} ended the stream "
                                "without finishing the request")
        finally:
            spans.end("attempt")
            call.cancel()
            # a finished request's prefill is only waiting for the decode side's acknowledgement,
            # which has been sent: let it complete, so the prefill worker counts a good transfer
            if prefill_task is not None and not prefill_task.done() and not stream.finished:
                prefill_task.cancel()
            decode.num_in_flight -= 1
            self.admission.wake_one()

    def _prefilled(self, task: asyncio.Task, trace: RequestTrace, attempt: int) -> None:
        """The prefill worker answered: its account of the prefill completes the TTFT stages."""
        if not task.cancelled() and task.exception() is None:
            self.metrics.prefilled(trace, attempt, task.result().prefill_seconds)

    @staticmethod
    def _work(req: RouterRequest, stream: ClientStream, attempt: int) -> worker_pb2.WorkRequest:
        """The request for the workers: after a failover, the prompt plus what was already sent."""
        if attempt == 0:
            return work_request_message(req.req_id, req.prompt_token_ids, req.params)
        params = dataclasses.replace(req.params, max_tokens=req.params.max_tokens - len(stream.sent_ids),
                                     num_output_tokens_in_prompt=len(stream.sent_ids))
        return work_request_message(f"{req.req_id}.{attempt}", req.prompt_token_ids + stream.sent_ids, params)


def log_request(req: RouterRequest, trace: RequestTrace, status: str, completion_tokens: int, failovers: int) -> None:
    """The one info line of a request, however it ended."""
    if not log.isEnabledFor(logging.INFO):
        return
    now = time.monotonic()
    ttft = None if trace.first_token_s is None else round(trace.first_token_s - trace.arrival_s, 6)
    log.info("request", extra={"req_id": req.req_id, **fields(
        client_request_id=req.client_request_id, status=status, prompt_tokens=len(req.prompt_token_ids),
        completion_tokens=completion_tokens, ttft_s=ttft, e2e_s=round(now - trace.arrival_s, 6),
        failovers=failovers)})


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """`pdserve.v1.Generation`. Registered with `handler()`, so it reads the request's bytes
    itself: a malformed request is INVALID_ARGUMENT naming what is wrong (and counted)."""

    def __init__(self, router: Router):
        self.router = router

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler("pdserve.v1.Generation", {"Generate": grpc.unary_stream_rpc_method_handler(
            self.Generate, request_deserializer=None, response_serializer=gen_pb2.GenerateResponse.SerializeToString)})

    async def Generate(self, request, context):
        router = self.router
        trace = router.metrics.arrived()
        parent = extract(context.invocation_metadata())  # the client's trace context, if any
        try:
            if isinstance(request, bytes):
                request = wire.parse(gen_pb2.GenerateRequest, request)
        except wire.BadRequest as e:
            router.metrics.count("invalid_argument")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            router.check_accepting()
            key = router.api_keys.identify(dict(context.invocation_metadata() or ()).get("authorization"))
        except RequestFailed as e:
            router.metrics.count(e.code.name.lower())
            await context.abort(e.code, str(e))
        try:
            with router.api_keys.lease(key):
                try:
                    req = await router.parse(request)
                except ValueError as e:
                    router.metrics.count("invalid_argument")
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
                async for resp in router.generate(req, trace, parent):
                    yield resp
        except RequestFailed as e:
            if trace.state is RequestState.RECEIVED:  # refused before it began: count it here
                router.metrics.count(e.code.name.lower())
            await context.abort(e.code, str(e))
