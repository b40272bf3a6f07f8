"""The public `pdserve.v1.Generation` service and the request life cycle behind it (the states
of `router.request.RequestState`). Protobuf of the public API stops here.

    received: validated, tokenized (INVALID_ARGUMENT otherwise)
    ──► admitted: Decode() on decode workers, most free blocks first, reserves its blocks
        (RESOURCE_EXHAUSTED: next worker; none: wait in the bounded admission queue)
    ──► prefilling: Prefill() on a paired prefill worker (fewest queued prompt tokens), naming the
        decode worker's address and the transfer id its reservation answered; it pushes the K/V
    ──► streaming: token deltas from the decode stream, incremental detokenization, stop strings,
        text deltas to the client ──► finished: the last delta carries finish reason and usage

Colocated (no prefill workers): admission is a PrefillAndDecode() on a decode worker. However
the request ends — finished, failed, cancelled by the client — both worker calls are cancelled,
which frees its blocks on both workers.
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.tokenizer import Tokenizer
from pdserve.router.admission import AdmissionQueue, QueueFull
from pdserve.router.metrics import RequestTrace, RouterMetrics
from pdserve.router.request import RequestState, RouterRequest
from pdserve.router.validate import Validator
from pdserve.router.workers import Worker, WorkerPool
from pdserve.serving.convert import work_request_message
from pdserve.v1 import generation_pb2 as gen_pb2
from pdserve.v1 import generation_pb2_grpc, worker_pb2

log = logging.getLogger("pdserve.router")


class RequestFailed(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class Router:
    """Runs requests to completion as async iterators of `GenerateResponse`; no gRPC server
    types here, so the HTTP front end shares it."""

    def __init__(self, pool: WorkerPool, validator: Validator, tokenizer: Tokenizer | None,
                 admission: AdmissionQueue, rpc_timeout_s: float, queue_timeout_s: float,
                 metrics: RouterMetrics | None = None):
        self.pool = pool
        self.validator = validator
        self.tokenizer = tokenizer
        self.admission = admission
        self.rpc_timeout_s = rpc_timeout_s
        self.queue_timeout_s = queue_timeout_s
        self.metrics = metrics or RouterMetrics()

    async def generate(self, req: RouterRequest, trace: RequestTrace | None = None):
        """`trace`: from `metrics.arrived()` when the request arrived (default: now)."""
        trace = trace or self.metrics.arrived()
        work = work_request_message(req.req_id, req.prompt_token_ids, req.params)
        call = prefill_task = None
        try:
            call, decode, transfer_id = await self._admit(work)
            trace.state = RequestState.ADMITTED
            self.metrics.admitted(trace, len(req.prompt_token_ids))
            if not self.pool.is_colocated:
                prefill_task = asyncio.create_task(self._prefill(work, decode, transfer_id))
                trace.state = RequestState.PREFILLING
            async for resp in self._stream(req, call, prefill_task):
                trace.state = RequestState.FINISHED if resp.finish_reason else RequestState.STREAMING
                self.metrics.delta_out(trace, len(resp.token_ids))
                if resp.finish_reason:
                    self.metrics.ended(trace, "ok")  # as the last delta leaves, not when the client reads on
                yield resp
        except RequestFailed as e:
            trace.state = RequestState.FAILED
            self.metrics.ended(trace, e.code.name.lower())
            raise
        except (asyncio.CancelledError, GeneratorExit):
            trace.state = RequestState.CANCELLED
            raise
        except Exception:
            trace.state = RequestState.FAILED
            self.metrics.ended(trace, "error")
            raise
        finally:
            if call is not None:
                call.cancel()
                if prefill_task is not None and not prefill_task.done():
                    prefill_task.cancel()
                self.admission.wake_one()
            if trace.state is not RequestState.FINISHED:
                self.metrics.ended(trace, "cancelled")  # a no-op when it ended above

    async def _admit(self, work: worker_pb2.WorkRequest):
        deadline = time.monotonic() + self.queue_timeout_s
        while True:
            for w in self.pool.decode_candidates():
                call = (w.stub.PrefillAndDecode if self.pool.is_colocated else w.stub.Decode)(
                    work, timeout=self.rpc_timeout_s)
                try:
                    event = await call.read()
                except grpc.aio.AioRpcError as e:
                    if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        continue
                    if e.code() == grpc.StatusCode.UNAVAILABLE:
                        w.healthy = False
                        continue
                    raise RequestFailed(e.code(), e.details()) from None
                w.stats.num_free_blocks = event.admitted.num_free_blocks
                if len(self.admission):
                    self.admission.wake_one()  # there may be room for the next one too
                return call, w, event.admitted.transfer_id
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"no decode worker could admit the request within {self.queue_timeout_s:g} s")
            try:
                await self.admission.wait(remaining)
            except QueueFull as e:
                raise RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, f"router is overloaded: {e}") from None

    async def _prefill(self, work: worker_pb2.WorkRequest, decode: Worker,
                       transfer_id: str) -> worker_pb2.PrefillResponse:
        candidates = self.pool.prefill_candidates(decode)
        if not candidates:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, f"no healthy prefill worker pairs with {decode.address}")
        w = candidates[0]
        n = len(work.prompt_token_ids)
        w.num_queued_prompt_tokens += n
        try:
            return await w.stub.Prefill(worker_pb2.PrefillRequest(
                request=work, decode_address=decode.address, transfer_id=transfer_id), timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                w.healthy = False
            raise RequestFailed(e.code(), f"prefill on {w.address} failed: {e.details()}") from None
        finally:
            w.num_queued_prompt_tokens -= n

    async def _stream(self, req: RouterRequest, call, prefill_task: asyncio.Task | None):
        detok = None
        if self.tokenizer is not None:
            decode = lambda ids: self.tokenizer.decode(ids, req.params.skip_special_tokens)  # noqa: E731
            detok = IncrementalDetokenizer(decode, req.prompt_token_ids, req.params.stop)
        failure: list[RequestFailed] = []
        if prefill_task is not None:
            prefill_task.add_done_callback(lambda t: _on_prefill_done(t, call, failure))
        num_tokens = 0
        try:
            # read(), not `async for`: admission already read() the first event, and grpc.aio
            # forbids mixing the two on one call
            while (event := await call.read()) is not grpc.aio.EOF:
                if event.WhichOneof("event") != "tokens":
                    continue
                ids, reason = list(event.tokens.token_ids), event.tokens.finish_reason
                if detok is not None:
                    for i, tok in enumerate(ids):
                        detok.add(tok)
                        if detok.stopped:
                            ids, reason = ids[:i + 1], gen_pb2.STOP
                            break
                num_tokens += len(ids)
                finished = reason != gen_pb2.FINISH_REASON_UNSPECIFIED
                text = detok.take_delta(final=finished) if detok else ""
                resp = gen_pb2.GenerateResponse(request_id=req.client_request_id, token_ids=ids, text=text)
                if finished:
                    resp.finish_reason = reason
                    resp.usage.prompt_tokens = len(req.prompt_token_ids)
                    resp.usage.completion_tokens = num_tokens
                    yield resp
                    return
                yield resp
        except grpc.aio.AioRpcError as e:
            raise (failure[0] if failure else RequestFailed(e.code(), e.details())) from None
        except asyncio.CancelledError:
            if failure:  # our own cancel of the decode call, because the prefill failed
                raise failure[0] from None
            raise
        raise RequestFailed(grpc.StatusCode.UNAVAILABLE, "the decode worker ended the stream without finishing")


def _on_prefill_done(task: asyncio.Task, call, failure: list) -> None:
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        failure.append(exc if isinstance(exc, RequestFailed) else RequestFailed(grpc.StatusCode.INTERNAL, repr(exc)))
        call.cancel()


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, router: Router):
        self.router = router

    async def Generate(self, request, context):
        trace = self.router.metrics.arrived()
        try:
            req = self.router.validator.parse(request)
        except ValueError as e:
            self.router.metrics.count("invalid_argument")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            async for resp in self.router.generate(req, trace):
                yield resp
        except RequestFailed as e:
            log.info("request failed req_id=%s code=%s: %s", req.client_request_id, e.code.name, e)
            await context.abort(e.code, str(e))


