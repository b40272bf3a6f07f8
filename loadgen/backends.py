"""The two ways `pdserve bench` talks to a running system, behind one interface:

- `GrpcBackend`: `pdserve.v1.Generation/Generate` through `pdserve.client.AsyncClient`;
- `HttpBackend`: OpenAI `POST /v1/completions` with `"stream": true`, reading server-sent
  events with aiohttp. A chunk's tokens are its `token_ids` (pdserve sends them); a server
  that sends none counts one token per non-empty chunk.

`send` fills a `RequestRecord` as deltas arrive and never raises for a failed request: the
failure is the record's `status` (a gRPC code name; HTTP statuses map to the same names).
`check` fails fast, with a `TargetError`, when the target cannot be reached at all.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import time
from dataclasses import dataclass

from pdserve.client import AsyncClient, GenerationError, RetryPolicy
from pdserve.loadgen.records import RequestRecord
from pdserve.loadgen.workload import RequestSpec

CONNECT_TIMEOUT_S = 10.0
HTTP_STATUS_CODES = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
                     429: "RESOURCE_EXHAUSTED", 499: "CANCELLED", 500: "INTERNAL", 501: "UNIMPLEMENTED",
                     503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}


class TargetError(ValueError):
    """The target cannot be reached (bad input as far as the command line is concerned)."""


@dataclass(frozen=True, slots=True)
class BenchSampling:
    temperature: float | None = 0.0
    top_p: float | None = None
    ignore_eos: bool = True  # every request generates exactly its max_tokens

    def kwargs(self, max_tokens: int) -> dict:
        out = {"max_tokens": max_tokens, "ignore_eos": self.ignore_eos}
        for name in ("temperature", "top_p"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


class GrpcBackend:
    def __init__(self, target: str, sampling: BenchSampling, timeout_s: float, api_key: str | None = None,
                 tls: bool = False, root_certificates: str | None = None, connections: int = 1):
        # a load test measures the system as it is: no client retries hiding UNAVAILABLE
        self.clients = [AsyncClient(target, api_key=api_key, tls=tls, root_certificates=root_certificates,
                                    timeout=timeout_s, retry=RetryPolicy(max_attempts=1)) for _ in range(connections)]
        if connections > 1:  # channels of one process share a connection to a target unless each has its own pool
            for c in self.clients:
                c.options = dataclasses.replace(c.options, channel_options=(
                    *c.options.channel_options, ("grpc.use_local_subchannel_pool", 1)))
        self._turn = itertools.cycle(self.clients)
        self.sampling = sampling
        self.name = f"grpc://{target}"

    async def check(self) -> None:
        try:
            await asyncio.gather(*(c.wait_ready(CONNECT_TIMEOUT_S, fail_fast=True) for c in self.clients))
        except GenerationError as e:
            raise TargetError(f"--target: {e.details}") from None

    async def send(self, spec: RequestSpec, rec: RequestRecord, t0: float) -> None:
        prompt = list(spec.prompt) if isinstance(spec.prompt, tuple) else spec.prompt
        try:
            async with next(self._turn).generate(prompt, **self.sampling.kwargs(spec.max_tokens)) as stream:
                async for delta in stream:
                    rec.add_delta(time.perf_counter() - t0, len(delta.token_ids), delta.num_steps)
                    if delta.usage is not None:
                        rec.num_prompt_tokens = delta.usage.prompt_tokens
        except GenerationError as e:
            rec.status, rec.error = e.code.name, e.details
        finally:
            rec.end_s = time.perf_counter() - t0

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients))


class HttpBackend:
    def __init__(self, url: str, sampling: BenchSampling, timeout_s: float, api_key: str | None = None,
                 model: str | None = None):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--http must be a URL starting with http:// or https://, got {url!r}")
        self.base = url.rstrip("/").removesuffix("/v1/completions")
        self.sampling, self.timeout_s, self.model = sampling, timeout_s, model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.name = self.base
        self._session = None

    def session(self):
        import aiohttp

        if self._session is None:
            # no connection cap: an open-loop test must not queue requests in the client
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=self.headers)
        return self._session

    async def check(self) -> None:
        import aiohttp

        try:
            async with self.session().get(self.base + "/health",
                                          timeout=aiohttp.ClientTimeout(total=CONNECT_TIMEOUT_S)) as resp:
                await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise TargetError(f"cannot reach --http {self.base}: {e.__class__.__name__} {e}".rstrip()) from None

    def body(self, spec: RequestSpec) -> dict:
        prompt = list(spec.prompt) if isinstance(spec.prompt, tuple) else spec.prompt
        body = {"prompt": prompt, "stream": True, **self.sampling.kwargs(spec.max_tokens)}
        if self.model:
            body["model"] = self.model
        return body

    async def send(self, spec: RequestSpec, rec: RequestRecord, t0: float) -> None:
        import aiohttp

        try:
            async with self.session().post(self.base + "/v1/completions", json=self.body(spec),
                                           timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as resp:
                if resp.status != 200:
                    rec.status = HTTP_STATUS_CODES.get(resp.status, f"HTTP_{resp.status}")
                    rec.error = (await resp.text())[:500]
                    return
                await self._read_events(resp, rec, t0)
        except asyncio.TimeoutError:
            rec.status, rec.error = "DEADLINE_EXCEEDED", f"no answer within {self.timeout_s:g} s"
        except aiohttp.ClientError as e:
            rec.status, rec.error = "UNAVAILABLE", f"{e.__class__.__name__}: {e}"
        finally:
            rec.end_s = time.perf_counter() - t0

    @staticmethod
    async def _read_events(resp, rec: RequestRecord, t0: float) -> None:
        async for raw in resp.content:
            line = raw.decode("utf-8", errors="replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            event = json.loads(data)
            if "error" in event:
                err = event["error"]
                rec.status, rec.error = str(err.get("code") or "UNKNOWN"), str(err.get("message", ""))
                return
            choice = (event.get("choices") or [{}])[0]
            ids = choice.get("token_ids")
            rec.add_delta(time.perf_counter() - t0, len(ids) if ids is not None else int(bool(choice.get("text"))))
            usage = event.get("usage")
            if usage:
                rec.num_prompt_tokens = usage.get("prompt_tokens")
        rec.status, rec.error = "UNAVAILABLE", "the event stream ended without [DONE]"

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
