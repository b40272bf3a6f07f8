"""The router's token stream on each decode worker: its requests' tokens, a message a step for all.

A decode worker that says so (`WorkerInfo.token_streams`) takes a `TokenStream` call from each
router and writes on it, each time its engine gives any of that router's requests tokens, one
`TokenBatch` for all of them (decode_worker/token_streams.py). `WorkerTokenStream` is that call
on the router's side: opened on the worker's first request and kept while it serves, its reader
hands each request's `TokenDelta` to the `Mailbox` that request registered under its id.

`StreamedCall` stands in for a request's Decode call, so the attempt's code reads it as it reads
a call (`read`, `cancel`): its deltas from its mailbox, and from the call itself (watched by one
read) how it ends. The call's failure is the request's; an OK end is the worker saying the last
delta is on the stream, and the request ends with that delta, which must follow within
FINAL_DELTA_WAIT_S (the two come on different HTTP/2 streams, so either may come first). A
failure does not overtake the tokens before it either: the worker ends the call once they are
written and says in its trailing metadata how many the stream carried, and the request reads
them (within FINAL_DELTA_WAIT_S) before it fails. When the token stream itself breaks (the
worker died, or drained), every request on it gets the stream's status, and the next request
opens a new one.

Deltas that wait in a request's mailbox when it reads (its client's writes fell behind the
stream) are read as one: with token streams the router, not the decode worker, merges a
request's backlog into one client message.

A worker whose stream does not open within OPEN_TIMEOUT_S gets its requests' tokens on their own
calls meanwhile, as one without token streams does.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from collections import deque

import grpc

from pdserve.serving.convert import STREAM_TOKENS_METADATA
from pdserve.v1 import worker_pb2

log = logging.getLogger("pdserve.router")

OPEN_TIMEOUT_S = 5.0  # for a new token stream's initial metadata
FINAL_DELTA_WAIT_S = 10.0  # for the last delta once a request's call ended OK


class _Ended:
    """A request's call ended: its watching read, done."""

    __slots__ = ("read",)

    def __init__(self, read: asyncio.Future):
        self.read = read


class Mailbox:
    """A request's deltas from the token stream and the ends of its call and of the stream, in the
    order they came (an `asyncio.Queue`'s part of it, with a look at what waits)."""

    __slots__ = ("items", "_waiter")

    def __init__(self):
        self.items: deque = deque()
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item) -> None:
        self.items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self):
        while not self.items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self.items.popleft()

    def merge_deltas(self, delta: worker_pb2.TokenDelta) -> int:
        """Append to `delta` the deltas waiting right behind it (up to its request's last), as one
        client message; how many it took."""
        n = 0
        while not delta.finish_reason and self.items and isinstance(self.items[0], worker_pb2.TokenDelta):
            more = self.items.popleft()
            steps = delta.num_steps + more.num_steps
            delta.MergeFrom(more)  # token ids and log-probs appended, a finish reason taken
            delta.num_steps, n = steps, n + 1
        return n


class _Broken:
    """The token stream ended: each request still on it fails with this status."""

    __slots__ = ("code", "details")

    def __init__(self, code: grpc.StatusCode, details: str):
        self.code, self.details = code, details


class _Event:
    """A `TokenDelta` from the token stream, shaped as the `DecodeEvent` a call's read returns."""

    __slots__ = ("tokens",)

    def __init__(self, tokens: worker_pb2.TokenDelta):
        self.tokens = tokens

    def WhichOneof(self, name: str) -> str:  # noqa: N802 (protobuf's name)
        return "tokens"


class WorkerTokenStream:
    """This router's `TokenStream` on one decode worker, and the mailboxes of the requests on it."""

    def __init__(self, stub, metadata):
        self.stub, self.metadata = stub, metadata
        self.stream_id = ""
        self.mailboxes: dict[str, Mailbox] = {}  # req_id -> its deltas, and the stream's end
        self._open: asyncio.Future | None = None  # True once open, False if it failed to
        self._task: asyncio.Task | None = None

    async def open(self) -> bool:
        """Whether the stream is open, opening it if it is not (at most OPEN_TIMEOUT_S)."""
        if self._task is None or self._task.done():
            self.stream_id = uuid.uuid4().hex
            self._open = asyncio.get_running_loop().create_future()
            self._task = asyncio.create_task(self._run(self.stream_id, self._open))
        if not self._open.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._open), OPEN_TIMEOUT_S)
            except TimeoutError:
                return False
        return self._open.result() and not self._task.done()

    def register(self, req_id: str) -> Mailbox:
        box = self.mailboxes[req_id] = Mailbox()
        return box

    def unregister(self, req_id: str, box: Mailbox) -> None:
        if self.mailboxes.get(req_id) is box:  # only its own
            del self.mailboxes[req_id]

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self, stream_id: str, opened: asyncio.Future) -> None:
        call = self.stub.TokenStream(worker_pb2.TokenStreamRequest(stream_id=stream_id), metadata=self.metadata)
        why = _Broken(grpc.StatusCode.UNAVAILABLE, "the decode worker ended its token stream")
        try:
            await call.initial_metadata()
            opened.set_result(not call.done())
            mailboxes = self.mailboxes
            async for batch in call:
                for rt in batch.requests:
                    box = mailboxes.get(rt.req_id)
                    if box is not None:
                        box.put_nowait(rt.tokens)
        except asyncio.CancelledError:
            why = _Broken(grpc.StatusCode.CANCELLED, "the router closed its token stream")
            raise
        except grpc.aio.AioRpcError as e:
            why = _Broken(e.code(), f"its token stream failed: {e.details()}")
            if not opened.done():
                log.info("token stream on a decode worker did not open (%s: %s): tokens come on each "
                         "request's own call", e.code().name, e.details())
        finally:
            call.cancel()
            if not opened.done():
                opened.set_result(False)
            mailboxes, self.mailboxes = self.mailboxes, {}
            for box in mailboxes.values():
                box.put_nowait(why)


def _stream_tokens(failure: BaseException) -> int:
    """How many tokens a failed call's token stream carried before its failure (its trailing
    metadata's `STREAM_TOKENS_METADATA`; 0 where it does not say)."""
    if not isinstance(failure, grpc.aio.AioRpcError):
        return 0
    for key, value in failure.trailing_metadata() or ():
        if key == STREAM_TOKENS_METADATA:
            try:
                return max(int(value), 0)
            except ValueError:
                return 0
    return 0


class StreamedCall:
    """A request's Decode (or PrefillAndDecode) call whose deltas come on a `WorkerTokenStream`,
    read as the call itself would be: `read()` gives its token events, then EOF, or raises its
    failure (or `CancelledError` once cancelled)."""

    def __init__(self, call, stream: WorkerTokenStream, req_id: str, mailbox: Mailbox):
        self.call, self.stream, self.req_id, self.mailbox = call, stream, req_id, mailbox
        self.finished = False  # its last delta was read
        self.ended = False  # its call ended OK (the worker sent the last delta)
        self.num_tokens = 0  # read from the stream
        self.failure: grpc.aio.AioRpcError | None = None  # its call's, raised once the tokens before it are read
        self.owed = 0  # how many tokens the stream carried before that failure (`STREAM_TOKENS_METADATA`)
        self._watch()

    def _watch(self) -> None:
        asyncio.ensure_future(self.call.read()).add_done_callback(self._ended)

    def _ended(self, read: asyncio.Future) -> None:
        if not read.cancelled():
            read.exception()  # retrieved: a request that ended before its call did never reads it
        self.mailbox.put_nowait(_Ended(read))

    async def read(self):
        if self.finished:
            return grpc.aio.EOF
        while True:
            if self.failure is not None and self.num_tokens >= self.owed:
                raise self.failure
            if self.ended or self.failure is not None:
                try:
                    async with asyncio.timeout(FINAL_DELTA_WAIT_S):
                        item = await self.mailbox.get()
                except TimeoutError:
                    if self.failure is not None:  # its tokens are lost with the stream: the failure stands
                        raise self.failure from None
                    raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, details=(
                        f"the request's call ended, and its last tokens did not come on the token stream "
                        f"within {FINAL_DELTA_WAIT_S:g} s")) from None
            else:
                item = await self.mailbox.get()
            if isinstance(item, worker_pb2.TokenDelta):
                self.mailbox.merge_deltas(item)  # those that came while this request's client write waited
                self.finished = bool(item.finish_reason)
                self.num_tokens += len(item.token_ids)
                return _Event(item)
            if isinstance(item, _Ended):
                if item.read.cancelled():
                    raise asyncio.CancelledError
                if (failure := item.read.exception()) is not None:
                    self.owed = _stream_tokens(failure)
                    if self.num_tokens >= self.owed:
                        raise failure
                    self.failure = failure  # the tokens the stream carried before it come first
                    continue
                event = item.read.result()
                if event is grpc.aio.EOF:
                    self.ended = True
                    continue
                self._watch()  # an event on the call itself (a worker that streams there): read on
                return event
            if self.failure is not None:
                raise self.failure
            raise grpc.aio.AioRpcError(item.code, details=item.details)  # the token stream's failure

    def cancel(self) -> bool:
        self.stream.unregister(self.req_id, self.mailbox)
        return self.call.cancel()
