"""`AsyncClient`: the asyncio client of `pdserve.v1.Generation/Generate`.

    async with AsyncClient("127.0.0.1:50051") as client:
        async for delta in client.generate("def fib(n):", max_tokens=64):
            print(delta.text, end="")
        print((await client.complete("import os", max_tokens=16)).text)

Same semantics as `Client`: retries of UNAVAILABLE only before the first delta, one deadline
(`timeout`) for the whole call. Cancelling the task that iterates a stream cancels the RPC;
so do `await stream.aclose()` and leaving `async with stream:`. (Breaking out of `async for`
alone leaves the call to be cancelled when the stream is collected: close it to be sure.)
The channel is opened on first use, in the running event loop, which must be the one that
uses the client afterwards.
"""
from __future__ import annotations

import asyncio
import time

import grpc

from pdserve.client.channel import ConnectionOptions, open_aio_channel
from pdserve.client.errors import error_for, from_rpc_error
from pdserve.client.messages import Completion, Delta, Prompt, SamplingParams, delta_from, make_request
from pdserve.client.retry import Attempts, RetryPolicy
from pdserve.v1 import generation_pb2 as gen_pb2
from pdserve.v1 import generation_pb2_grpc


class AsyncStream:
    """The deltas of one Generate call, as an async iterator."""

    def __init__(self, client: "AsyncClient", request: gen_pb2.GenerateRequest, attempts: Attempts):
        self._client, self._request, self._attempts = client, request, attempts
        self._call = None
        self._is_closed = False

    @property
    def request_id(self) -> str:
        return self._request.request_id

    def __aiter__(self) -> "AsyncStream":
        return self

    async def __anext__(self) -> Delta:
        if self._is_closed:
            raise StopAsyncIteration
        try:
            msg = await (self._first() if self._call is None else self._call.read())
        except grpc.RpcError as e:
            closed_by_us = self._is_closed and e.code() == grpc.StatusCode.CANCELLED
            self._is_closed = True
            if closed_by_us:
                raise StopAsyncIteration from None
            raise from_rpc_error(e, self._attempts.num_made) from None
        except BaseException:  # our task was cancelled (or worse): the RPC goes with it
            self.cancel()
            raise
        if msg is grpc.aio.EOF:
            self._is_closed = True
            raise StopAsyncIteration
        delta = delta_from(msg)
        if delta.is_last:
            self._is_closed = True
        return delta

    async def _first(self) -> gen_pb2.GenerateResponse:
        stub = await self._client.stub()
        while True:
            self._attempts.num_made += 1
            self._call = stub.Generate(self._request, timeout=self._attempts.timeout(),
                                       metadata=self._client.options.call_metadata())
            try:
                msg = await self._call.read()
            except grpc.RpcError as e:
                wait = self._attempts.retry_after(e.code())
                if wait is None:
                    raise
                await asyncio.sleep(wait)
                continue
            if msg is grpc.aio.EOF:
                raise error_for(grpc.StatusCode.INTERNAL, "the server ended the stream without a message",
                                self._attempts.num_made)
            return msg

    def cancel(self) -> None:
        """Cancel the call if it is still running (idempotent)."""
        self._is_closed = True
        if self._call is not None:
            self._call.cancel()

    async def aclose(self) -> None:
        self.cancel()

    async def __aenter__(self) -> "AsyncStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self.cancel()

    def __del__(self) -> None:
        if getattr(self, "_call", None) is not None and not self._is_closed:
            self._call.cancel()


class AsyncClient:
    """A channel to one router, for asyncio. Arguments as `Client`'s."""

    def __init__(self, target: str, *, api_key: str | None = None, tls: bool = False,
                 root_certificates: bytes | str | None = None, metadata: dict[str, str] | None = None,
                 timeout: float | None = None, retry: RetryPolicy | None = None):
        self.options = ConnectionOptions.build(target, api_key, tls, root_certificates, metadata)
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.default_timeout = timeout
        self.retry = retry or RetryPolicy()
        self._channel: grpc.aio.Channel | None = None
        self._stub = None

    async def stub(self) -> generation_pb2_grpc.GenerationStub:
        if self._stub is None:
            self._channel = open_aio_channel(self.options)
            self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        return self._stub

    async def wait_ready(self, timeout: float, fail_fast: bool = False) -> None:
        """Until the channel connects; UnavailableError after `timeout` seconds, or with
        `fail_fast` as soon as a connection attempt fails (nothing listening, say)."""
        await self.stub()
        try:
            await asyncio.wait_for(self._connect(fail_fast), timeout)
        except asyncio.TimeoutError:
            raise error_for(grpc.StatusCode.UNAVAILABLE,
                            f"cannot connect to {self.options.target} within {timeout:g} s") from None

    async def _connect(self, fail_fast: bool) -> None:
        state = self._channel.get_state(try_to_connect=True)
        while state is not grpc.ChannelConnectivity.READY:
            if fail_fast and state is grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                raise error_for(grpc.StatusCode.UNAVAILABLE, f"cannot connect to {self.options.target}")
            await self._channel.wait_for_state_change(state)
            state = self._channel.get_state(try_to_connect=True)

    def generate(self, prompt: Prompt, *, timeout: float | None = None, request_id: str | None = None,
                 **sampling) -> AsyncStream:
        request = make_request(prompt, SamplingParams(**sampling), request_id)
        return AsyncStream(self, request, self._attempts(timeout))

    async def complete(self, prompt: Prompt, *, timeout: float | None = None, request_id: str | None = None,
                       **sampling) -> Completion:
        out = Completion()
        async with self.generate(prompt, timeout=timeout, request_id=request_id, **sampling) as stream:
            async for delta in stream:
                out.add(delta)
        return out

    def _attempts(self, timeout: float | None) -> Attempts:
        timeout = timeout if timeout is not None else self.default_timeout
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        return Attempts(self.retry, None if timeout is None else time.monotonic() + timeout)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
