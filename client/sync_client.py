"""`Client`: the blocking client of `pdserve.v1.Generation/Generate`.

    with Client("127.0.0.1:50051") as client:
        for delta in client.generate("def fib(n):", max_tokens=64, temperature=0):
            print(delta.text, end="")
        print(client.complete("import os", max_tokens=16).text)

`generate` returns a `Stream` of `Delta`s. The call starts when the first delta is asked for;
UNAVAILABLE before that first delta is retried (`RetryPolicy`), never after. `timeout` is one
deadline for the whole call, retries included. Closing the stream (`close()`, leaving its
`with` block, or dropping it) cancels the RPC, which frees the request's blocks on the server.
"""
from __future__ import annotations

import time

import grpc

from pdserve.client.channel import ConnectionOptions, open_channel
from pdserve.client.errors import GenerationError, error_for, from_rpc_error
from pdserve.client.messages import Completion, Delta, Prompt, SamplingParams, delta_from, make_request
from pdserve.client.retry import Attempts, RetryPolicy
from pdserve.v1 import generation_pb2 as gen_pb2
from pdserve.v1 import generation_pb2_grpc


class Stream:
    """The deltas of one Generate call; iterate it, or close it to cancel the call."""

    def __init__(self, stub: generation_pb2_grpc.GenerationStub, request: gen_pb2.GenerateRequest,
                 metadata: tuple, attempts: Attempts):
        self._stub, self._request, self._metadata, self._attempts = stub, request, metadata, attempts
        self._call = None
        self._is_closed = False

    @property
    def request_id(self) -> str:
        return self._request.request_id

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> Delta:
        if self._is_closed:
            raise StopIteration
        try:
            msg = self._first() if self._call is None else next(self._call)
        except StopIteration:
            self._is_closed = True
            raise
        except grpc.RpcError as e:
            if self._is_closed and e.code() == grpc.StatusCode.CANCELLED:
                raise StopIteration from None  # closed by us, from another thread
            self._is_closed = True
            raise from_rpc_error(e, self._attempts.num_made) from None
        delta = delta_from(msg)
        if delta.is_last:
            self._is_closed = True
        return delta

    def _first(self) -> gen_pb2.GenerateResponse:
        """Start the call and read its first message, retrying UNAVAILABLE while none arrived."""
        while True:
            self._attempts.num_made += 1
            self._call = self._stub.Generate(self._request, timeout=self._attempts.timeout(),
                                             metadata=self._metadata)
            try:
                return next(self._call)
            except StopIteration:
                raise error_for(grpc.StatusCode.INTERNAL, "the server ended the stream without a message",
                                self._attempts.num_made) from None
            except grpc.RpcError as e:
                wait = self._attempts.retry_after(e.code())
                if wait is None:
                    raise
                time.sleep(wait)

    def close(self) -> None:
        """Cancel the call if it is still running (idempotent)."""
        self._is_closed = True
        if self._call is not None:
            self._call.cancel()

    cancel = close

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_call", None) is not None and not self._is_closed:
            self._call.cancel()


class Client:
    """A channel to one router. Keyword arguments of `generate`/`complete` beyond `timeout` and
    `request_id` are `SamplingParams` fields (temperature, top_p, top_k, min_p, max_tokens, stop,
    stop_token_ids, seed, ignore_eos)."""

    def __init__(self, target: str, *, api_key: str | None = None, tls: bool = False,
                 root_certificates: bytes | str | None = None, metadata: dict[str, str] | None = None,
                 timeout: float | None = None, retry: RetryPolicy | None = None):
        self.options = ConnectionOptions.build(target, api_key, tls, root_certificates, metadata)
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.default_timeout = timeout
        self.retry = retry or RetryPolicy()
        self._channel = open_channel(self.options)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    def wait_ready(self, timeout: float) -> None:
        """Until the channel connects; UnavailableError after `timeout` seconds."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise error_for(grpc.StatusCode.UNAVAILABLE,
                            f"cannot connect to {self.options.target} within {timeout:g} s") from None

    def generate(self, prompt: Prompt, *, timeout: float | None = None, request_id: str | None = None,
                 **sampling) -> Stream:
        request = make_request(prompt, SamplingParams(**sampling), request_id)
        return Stream(self._stub, request, self.options.call_metadata(), self._attempts(timeout))

    def complete(self, prompt: Prompt, *, timeout: float | None = None, request_id: str | None = None,
                 **sampling) -> Completion:
        """The whole response at once (the stream, joined)."""
        out = Completion()
        with self.generate(prompt, timeout=timeout, request_id=request_id, **sampling) as stream:
            for delta in stream:
                out.add(delta)
        return out

    def _attempts(self, timeout: float | None) -> Attempts:
        timeout = timeout if timeout is not None else self.default_timeout
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        return Attempts(self.retry, None if timeout is None else time.monotonic() + timeout)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["Client", "Stream", "GenerationError"]
