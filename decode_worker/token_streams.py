"""A router's token stream on this decode worker: every request's tokens of a step in one message.

Without it each request's deltas go on its own Decode stream: at 32 requests in flight that is 32
gRPC messages a step, written here and read by the router, and a served token's CPU past the
model is mostly those messages (BENCHMARKS.md, Streaming cost per token). A router that opened a
`TokenStream` names it in each `WorkRequest.token_stream`; the request's outputs then go to the
stream (`OpenStream.put`), whose coroutine wakes once a step and writes one `TokenBatch` with a
`RequestTokens` for each request that has new tokens. A request's own call still answers
`Admitted`, still ends with its failure's status (`DecodeRequest.events` keeps the failures),
and ends OK once its last delta is on the stream (`DONE`); cancelling it still aborts the request.
An engine failure reaches the call only once the outputs before it are written on the stream
(`OpenStream.put_failure`), and the call's trailing metadata says how many tokens the stream
carried (`STREAM_TOKENS_METADATA`): the router reads those before it fails the request.

A batch holds each request's newest output (outputs are cumulative: the newest has every token of
the others), so a stream that fell behind its engine merges, as a request's own stream does
(`merge_backlog`). When the stream ends (the router cancelled it, or went away) the requests
bound to it are ended as cancelled, their blocks freed. Once the worker has drained, its streams
end OK (`close`), so stopping it does not wait out the server's grace period for them.
"""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import grpc

from pdserve.engine.disagg import DecodeState
from pdserve.engine.outputs import RequestOutput
from pdserve.serving.convert import FINISH_REASONS, logprobs_message
from pdserve.serving.kv_transfer import TransferError, TransferFailure
from pdserve.v1 import worker_pb2

if TYPE_CHECKING:
    from pdserve.decode_worker.server import DecodeRequest

DONE = object()  # put on a request's events once its last delta is on its token stream


class OpenStream:
    """One router's stream: the requests that name it, and the outputs waiting for its next batch.

    `merge` (the worker's `merge_backlog`): a request keeps one waiting output, its newest (each
    has every token of those before it), in the place of its first, so what waits while the
    router reads slowly is bounded by the requests, not by the steps; the outputs it replaced are
    counted in `num_merged`. Otherwise every output waits for a message of its own."""

    def __init__(self, stream_id: str, merge: bool = True):
        self.stream_id = stream_id
        self.merge = merge
        self.newest: dict[DecodeRequest, RequestOutput] = {}  # merge: each request's newest output waiting
        self.pending: list[tuple[DecodeRequest, RequestOutput]] = []  # not merge: (DecodeRequest, its output), as they came
        self.num_merged = 0  # outputs replaced by a newer one before they were sent
        self.failures: list[tuple[DecodeRequest, object]] = []  # each to its request's events once what came before is sent
        self.bound: set[DecodeRequest] = set()  # live requests whose tokens go here
        self.wake = asyncio.Event()
        self.closed = False

    def put(self, r: DecodeRequest, out: RequestOutput) -> None:
        if not self.merge:
            self.pending.append((r, out))
        elif r in self.newest:
            self.newest[r] = out  # keeps its place: the order of first outputs
            self.num_merged += 1
        else:
            self.newest[r] = out
        self.wake.set()

    def put_failure(self, r: DecodeRequest, failure) -> None:
        """The failure that ends r (an engine step's), for its call once the outputs that came
        before it are written: its tokens go out ahead of it."""
        self.failures.append((r, failure))
        self.wake.set()

    def close(self) -> None:
        """End the stream once what waits is sent."""
        self.closed = True
        self.wake.set()

    @property
    def waiting(self) -> bool:
        return bool(self.newest or self.pending or self.failures)

    def take(self) -> tuple[list[dict[DecodeRequest, RequestOutput]], int, list[tuple[DecodeRequest, object]]]:
        """What waits: the outputs of successive batches (a request at most once in each, in the
        order of its first output), how many outputs were merged away since the last take, and
        the failures to hand on once those batches are written. Merged, one batch of each
        request's newest output; otherwise a batch a request's output waits for (a message per
        output, as a request's own stream sends with `merge_backlog` off)."""
        failures, self.failures = self.failures, []
        if self.merge:
            newest, self.newest = self.newest, {}
            merged, self.num_merged = self.num_merged, 0
            return [newest], merged, failures
        pending, self.pending = self.pending, []
        batches: list[dict[DecodeRequest, RequestOutput]] = [{}]
        for r, out in pending:
            if r in batches[-1]:
                batches.append({})
            batches[-1][r] = out
        return batches, 0, failures


def fill_delta(delta: worker_pb2.TokenDelta, out: RequestOutput, num_sent: int, num_steps_sent: int) -> None:
    """Write into `delta` the tokens of `out` after the first `num_sent` it generated (those its
    stream sent), with the engine steps they came from (those after the first `num_steps_sent`)."""
    delta.token_ids.extend(out.token_ids[num_sent:])
    if out.finish_reason:
        delta.finish_reason = FINISH_REASONS[out.finish_reason.value]
    delta.num_steps = out.num_steps - num_steps_sent
    if out.logprobs is not None:
        delta.logprobs.extend(logprobs_message(row) for row in out.logprobs[num_sent:])


def token_delta(out: RequestOutput, num_sent: int, num_steps_sent: int) -> worker_pb2.DecodeEvent:
    """`fill_delta`'s tokens as a request's own stream sends them."""
    event = worker_pb2.DecodeEvent()
    fill_delta(event.tokens, out, num_sent, num_steps_sent)
    return event


class TokenStreams:
    """The decode worker servicer's token streams (a mixin: `self` is a `DecodeWorkerServicer`)."""

    async def _until_done(self, r: DecodeRequest, context) -> None:
        """The call of a request whose tokens go on a token stream: it returns once the last of
        them is on the stream, and ends with a failure's status. The first wait covers the
        transfer (reserved requests); then the request fails when its stream has sent it nothing
        for `stream_timeout_s`."""
        timeout = self.config.kv_transfer_timeout_s if r.state is DecodeState.RESERVED else self.config.stream_timeout_s
        r.last_sent = time.monotonic()
        while True:
            try:
                async with asyncio.timeout(timeout):
                    item = await r.events.get()
            except TimeoutError:
                idle = time.monotonic() - r.last_sent
                if r.state is DecodeState.RUNNING and idle < self.config.stream_timeout_s:
                    timeout = self.config.stream_timeout_s - idle  # it was sent tokens since the wait began
                    continue
                item = self._timed_out(r, timeout)
            if item is DONE:
                return
            await self._abort_if_failed(r, item, context)

    async def TokenStream(self, request, context):
        """A router's stream of its requests' tokens (`token_streams.py`): a `TokenBatch` each time
        the engine gave any of them tokens, until the router cancels it or this worker drained."""
        await self.check_accepting(context)  # not while draining: the stream would outlive the drain
        sid = request.stream_id
        if not sid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "TokenStreamRequest.stream_id is empty")
        if sid in self.token_streams:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"token stream {sid!r} is already open")
        stream = self.token_streams[sid] = OpenStream(sid, self.config.merge_backlog)
        try:
            await context.send_initial_metadata(())
            while not (stream.closed and not stream.waiting):
                await stream.wake.wait()
                stream.wake.clear()
                batches, merged, failures = stream.take()
                self.num_merged_outputs += merged
                for outputs in batches:
                    batch, done = worker_pb2.TokenBatch(), []
                    now = time.monotonic()
                    for r, out in outputs.items():
                        if not r.is_live:
                            continue  # ended meanwhile
                        fill_delta(batch.requests.add(req_id=r.req_id).tokens, out, r.num_tokens, r.num_steps)
                        self.num_stream_tokens += len(out.token_ids) - r.num_tokens
                        r.num_tokens, r.num_steps, r.last_sent = len(out.token_ids), out.num_steps, now
                        if out.finished:
                            r.state = DecodeState.FINISHED
                            done.append(r)
                    if batch.requests:
                        self.num_stream_messages += 1
                        yield batch
                    for r in done:  # its last tokens are written: its own call ends OK
                        r.events.put_nowait(DONE)
                for r, failure in failures:  # the tokens before it are written: its call fails
                    r.events.put_nowait(failure)
        finally:
            del self.token_streams[sid]
            for r in list(stream.bound):
                self._end(r, TransferError(TransferFailure.ABORTED, f"its token stream {sid!r} ended"))

    async def drain(self, timeout_s: float) -> int:
        """`WorkerService.drain`, then the routers' token streams end (no request needs them)."""
        remaining = await super().drain(timeout_s)
        for stream in self.token_streams.values():
            stream.close()
        return remaining
