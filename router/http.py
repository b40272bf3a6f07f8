"""OpenAI-compatible HTTP front end: `POST /v1/completions` and `POST /v1/chat/completions`
(streaming as server-sent events), `GET /v1/models`, `GET /health`, `GET /ready`, `GET /metrics`
(the router's Prometheus metrics). Bodies are parsed strictly (`openai_params.py`), a chat is
rendered with the model's own chat template (`chat_template.py`), and the result is the same
`GenerateRequest` the gRPC API takes, run through the same `Router`, so validation, admission,
cancellation and metrics are shared. Responses take OpenAI's shapes (`openai_format.py`).

`n` > 1 fans out into n requests whose seeds derive from the request's (choice 0 keeps it, so
n = 1 and n = 2 agree on the first choice), run concurrently; their choices carry their index.

Status codes, in OpenAI's error shape: 400 for bad input (naming the parameter), 404 for a model
this server does not serve, 408 for a body that does not arrive within the body timeout, 413 for
one larger than MAX_BODY_BYTES (said from its Content-Length, before it is read), 429 when no
worker can admit the request, 503 when workers fail. A client that disconnects mid-stream cancels
its requests, which frees their blocks on both workers. Every wait on a client is bounded: a
connection with no request in progress (new, idle between requests, or stalled in its headers)
is closed after the idle timeout, and so is a stream whose client takes nothing for as long.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time

import grpc
from aiohttp import web

from pdserve.router.chat_template import ChatTemplate, TemplateError
from pdserve.router.openai_format import Choice, TokenText, error_response, sse, usage
from pdserve.router.openai_params import OpenAIError, OpenAIRequest, parse_chat, parse_completion, parse_json
from pdserve.router.request import RequestFailed, RouterRequest
from pdserve.router.server import Router
from pdserve.serving.metrics import HTTP_IDLE_TIMEOUT_S, metrics_handler, start_http_app
from pdserve.serving.tracing import extract

log = logging.getLogger("pdserve.router.http")

_HTTP_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
                grpc.StatusCode.DEADLINE_EXCEEDED: 504, grpc.StatusCode.UNAUTHENTICATED: 401}
# the gRPC-side field a validation message names -> the OpenAI parameter it came from
_OPENAI_PARAM = {"token_ids": "prompt", "request_id": "user"}
MAX_BODY_BYTES = 8 << 20
BODY_TIMEOUT_S = 30.0  # a request's body must have arrived this long after its headers (408)
OPEN_PATHS = ("/health", "/ready", "/metrics", "/prometheus/targets")  # probes and scrapes: no API key
_END = object()


def writer(resp: web.StreamResponse, timeout_s: float):
    """resp.write, where a write that the client does not take within `timeout_s` (the
    connection's buffers full: it reads nothing) raises TimeoutError."""
    async def write(data: bytes) -> None:
        async with asyncio.timeout(timeout_s):
            await resp.write(data)
    return write


def derive_seed(seed: int, index: int) -> int:
    """Choice `index`'s seed: the request's own for choice 0, a hash of (seed, index) after."""
    if index == 0:
        return seed
    return int.from_bytes(hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest(), "big")


def fan_out(req: RouterRequest, n: int) -> list[RouterRequest]:
    if n == 1:
        return [req]
    return [dataclasses.replace(req, req_id=f"{req.req_id}-{i}",
                                params=dataclasses.replace(req.params, seed=derive_seed(req.params.seed, i)))
            for i in range(n)]


class OpenAIApp:
    def __init__(self, router: Router, model_name: str, chat_template: ChatTemplate | None = None,
                 shared_port: bool = False, body_timeout_s: float = BODY_TIMEOUT_S, idle_timeout_s: float = HTTP_IDLE_TIMEOUT_S):
        self.router, self.model_name, self.chat_template = router, model_name, chat_template
        self.body_timeout_s, self.idle_timeout_s = body_timeout_s, idle_timeout_s
        self.token_text = TokenText(router.tokenizer)
        self.shared_port = shared_port  # other router processes listen on this port too (SO_REUSEPORT)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self.authenticate])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        metrics = self.not_here if self.shared_port else metrics_handler(self.router.metrics.registry)
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/prometheus/targets", self.prometheus_targets)
        return app

    async def not_here(self, _request: web.Request) -> web.Response:
        """/metrics on a shared port would answer for whichever router the connection reached: a
        scrape there would mix their counters without a word, so it fails, saying where to look."""
        return web.Response(status=404, text="this router shares its HTTP port with other router processes: "
                            "/metrics here would answer for whichever one the connection reached; scrape each "
                            "router at its own metrics port (GET /prometheus/targets lists them)\n")

    @web.middleware
    async def authenticate(self, request: web.Request, handler):
        """API keys (when configured) on the API; probes and /metrics need none. A request
        holds its key's slot until its response is done."""
        if request.path in OPEN_PATHS:
            return await handler(request)
        keys = self.router.api_keys
        try:
            key = keys.identify(request.headers.get("Authorization"))
            with keys.lease(key):
                return await handler(request)
        except RequestFailed as e:
            self.router.metrics.count(e.code.name.lower())
            status = 401 if e.code == grpc.StatusCode.UNAUTHENTICATED else _HTTP_STATUS.get(e.code, 503)
            return error_response(status, str(e), None, "invalid_api_key" if status == 401 else None)

    async def prometheus_targets(self, _request: web.Request) -> web.Response:
        """Prometheus HTTP service discovery: `pdserve serve`'s processes (404 for a standalone router)."""
        if self.router.prometheus_targets is None:
            return error_response(404, "no targets: this router does not run under `pdserve serve`")
        return web.json_response(self.router.prometheus_targets())

    async def health(self, _request: web.Request) -> web.Response:
        """Liveness: the process answers."""
        return web.json_response({"status": "ok"})

    async def ready(self, _request: web.Request) -> web.Response:
        """Readiness: 200 while the router can serve a request now, else 503 saying why."""
        missing = "shutting down" if self.router.is_draining else self.router.pool.missing()
        if missing is None:
            return web.json_response({"status": "ready"})
        return web.json_response({"status": "not ready", "reason": missing}, status=503)

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "pdserve"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, is_chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, is_chat=True)

    # ---- one request: parse, validate, fan out, answer -------------------------------------
    async def _serve(self, request: web.Request, is_chat: bool) -> web.StreamResponse:
        trace = self.router.metrics.arrived()
        try:
            raw = await self._read_body(request)
        except (web.HTTPRequestEntityTooLarge, TimeoutError) as e:  # counted like every other answer
            self.router.metrics.count("invalid_argument")
            resp = (error_response(413, f"the request body is larger than {MAX_BODY_BYTES} bytes", None, "request_too_large")
                    if isinstance(e, web.HTTPRequestEntityTooLarge) else
                    error_response(408, f"the request body did not arrive within {self.body_timeout_s:g} s of its "
                                   "headers", None, "request_timeout"))
            resp.force_close()  # the rest of the body is not read
            return resp
        try:
            oreq, req = await self._parse(raw, is_chat)
        except OpenAIError as e:
            self.router.metrics.count("not_found" if e.status == 404 else "invalid_argument")
            return error_response(e.status, str(e), e.param, e.code)
        except ValueError as e:  # the gRPC-side names ("sampling_params.top_p") read as OpenAI's ("top_p")
            self.router.metrics.count("invalid_argument")
            message = str(e).removeprefix("sampling_params.")
            if is_chat and message.startswith("prompt"):
                message = "messages: the rendered conversation" + message.removeprefix("prompt")
            param = message.split(" ", 1)[0].rstrip(":")
            return error_response(400, message, _OPENAI_PARAM.get(param, param), "invalid_value")
        except RequestFailed as e:
            self.router.metrics.count(e.code.name.lower())
            return error_response(_HTTP_STATUS.get(e.code, 503), str(e))
        reqs = fan_out(req, oreq.n)
        traces = [trace] + [self.router.metrics.arrived() for _ in reqs[1:]]
        kind = "chatcmpl" if is_chat else "cmpl"
        meta = {"id": f"{kind}-{req.req_id}", "created": int(time.time()), "model": self.model_name}
        prefix = self._echo_prefix(oreq, req)
        choices = [Choice(i, self.token_text, oreq.num_logprobs, prefix) for i in range(oreq.n)]
        parent = extract(request.headers)  # the client's traceparent, if any
        if oreq.stream:
            return await self._stream(request, oreq, reqs, traces, choices, meta, parent)
        return await self._complete(oreq, reqs, traces, choices, meta, parent)

    async def _read_body(self, request: web.Request) -> bytes:
        """The whole body, within the body timeout (TimeoutError); one whose Content-Length is
        over the limit is refused before any of it is read."""
        if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
            raise web.HTTPRequestEntityTooLarge(max_size=MAX_BODY_BYTES, actual_size=request.content_length)
        async with asyncio.timeout(self.body_timeout_s):
            return await request.read()

    async def _parse(self, raw: bytes, is_chat: bool) -> tuple[OpenAIRequest, RouterRequest]:
        oreq = parse_chat(parse_json(raw)) if is_chat else parse_completion(parse_json(raw))
        if oreq.model is not None and oreq.model != self.model_name:
            raise OpenAIError(404, f"The model `{oreq.model}` does not exist (this server serves "
                              f"`{self.model_name}`)", "model", "model_not_found")
        if is_chat:
            oreq.message.prompt = self._render(oreq)
        self.router.check_accepting()
        req = await self.router.parse(oreq.message)  # tokenizing off the event loop
        return oreq, self._fit_context(oreq, req)

    def _render(self, oreq: OpenAIRequest) -> str:
        if self.chat_template is None:
            raise OpenAIError(400, f"the model `{self.model_name}` has no chat template (no chat_template in its "
                              "tokenizer_config.json): use /v1/completions", "messages", "no_chat_template")
        try:
            return self.chat_template.render(oreq.messages)
        except TemplateError as e:
            raise OpenAIError(400, f"messages: {e}", "messages", "invalid_value") from None

    def _fit_context(self, oreq: OpenAIRequest, req: RouterRequest) -> RouterRequest:
        """max_tokens must fit the model's context beside the prompt; a chat without it gets
        the rest of the context."""
        max_model_len = self.router.validator.limits.max_model_len
        room = max_model_len - len(req.prompt_token_ids)
        if not oreq.has_max_tokens:
            return dataclasses.replace(req, params=dataclasses.replace(req.params, max_tokens=room))
        if req.params.max_tokens > room:
            name = "max_tokens"
            raise OpenAIError(400, f"{name} is {req.params.max_tokens}, but the prompt has {len(req.prompt_token_ids)} "
                              f"tokens and the model's context is {max_model_len}: at most {room}", name,
                              "context_length_exceeded")
        return req

    def _echo_prefix(self, oreq: OpenAIRequest, req: RouterRequest) -> str:
        if not oreq.echo:
            return ""
        if oreq.message.WhichOneof("input") == "prompt":
            return oreq.message.prompt
        return self.router.tokenizer.decode(req.prompt_token_ids) if self.router.tokenizer else ""

    async def _complete(self, oreq, reqs, traces, choices: list[Choice], meta: dict, parent) -> web.Response:
        async def run(req, trace, choice):
            async for msg in self.router.generate(req, trace, parent):
                choice.add(msg)

        tasks = [asyncio.ensure_future(run(*args)) for args in zip(reqs, traces, choices)]
        try:
            await asyncio.gather(*tasks)
        except RequestFailed as e:
            return error_response(_HTTP_STATUS.get(e.code, 503), str(e))
        finally:
            for t in tasks:
                t.cancel()
        body = {**meta, "object": "chat.completion" if oreq.is_chat else "text_completion",
                "choices": [c.chat() if oreq.is_chat else c.completion() for c in choices],
                "usage": usage(len(reqs[0].prompt_token_ids), sum(c.num_tokens for c in choices))}
        return web.json_response(body)

    async def _stream(self, request, oreq, reqs, traces, choices: list[Choice], meta: dict,
                      parent) -> web.StreamResponse:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i, req, trace):
            try:
                async for msg in self.router.generate(req, trace, parent):
                    queue.put_nowait((i, msg))
            except RequestFailed as e:
                queue.put_nowait((i, e))
            queue.put_nowait((i, _END))

        tasks = [asyncio.ensure_future(pump(i, r, t)) for i, (r, t) in enumerate(zip(reqs, traces))]
        try:
            i, first = await queue.get()  # admission failures still get a proper status code
            if isinstance(first, RequestFailed):
                return error_response(_HTTP_STATUS.get(first.code, 503), str(first))
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            write = writer(resp, self.idle_timeout_s)
            try:
                await self._write_events(write, oreq, choices, meta, queue, (i, first), len(tasks))
                await write(sse("[DONE]"))
            except TimeoutError:  # the client takes nothing: its connection goes, and its requests
                log.warning("a streaming client took nothing for %g s; its connection is closed", self.idle_timeout_s)
                request.transport.close()
            return resp
        finally:
            for t in tasks:  # a vanished client lands here too: the workers' calls are cancelled
                t.cancel()

    async def _write_events(self, write, oreq, choices, meta, queue, item, num_open: int) -> None:
        obj = "chat.completion.chunk" if oreq.is_chat else "text_completion"
        prompt_tokens = 0
        while True:
            i, msg = item
            if msg is _END:
                num_open -= 1
                if num_open == 0:
                    break
            elif isinstance(msg, RequestFailed):
                await write(sse({"error": {"message": str(msg), "type": "server_error", "code": msg.code.name}}))
            else:
                choice = choices[i]
                chunk = choice.chat_chunk(msg) if oreq.is_chat else choice.completion_chunk(msg)
                event = {**meta, "object": obj, "choices": [chunk]}
                if msg.finish_reason:
                    prompt_tokens = msg.usage.prompt_tokens
                    if not oreq.is_chat:  # completions have always carried it on a choice's last chunk
                        event["usage"] = usage(prompt_tokens, msg.usage.completion_tokens)
                await write(sse(event))
            item = await queue.get()
        if oreq.include_usage:
            await write(sse({**meta, "object": obj, "choices": [],
                                  "usage": usage(prompt_tokens, sum(c.num_tokens for c in choices))}))


async def start_http(router: Router, host: str, port: int, model_name: str = "pdserve",
                     chat_template: ChatTemplate | None = None, ssl_context=None,
                     reuse_port: bool = False, idle_timeout_s: float = HTTP_IDLE_TIMEOUT_S,
                     body_timeout_s: float = BODY_TIMEOUT_S) -> tuple[web.AppRunner, int]:
    """Serve the HTTP API (HTTPS with `ssl_context`); returns the runner and the bound port.
    `reuse_port`: the port shared with the other routers of a system (SO_REUSEPORT).
    `idle_timeout_s`: a connection with no request in progress is closed after it (aiohttp's
    keep-alive timeout, which also runs from a connection's start and through its headers), and
    so is a streaming one whose client takes nothing for as long;
    `body_timeout_s`: a request's body must arrive within it (408)."""
    # handler_cancellation: a client gone mid-request cancels the handler, and so the request
    app = OpenAIApp(router, model_name, chat_template, shared_port=reuse_port, body_timeout_s=body_timeout_s,
                    idle_timeout_s=idle_timeout_s).app()
    runner, bound = await start_http_app(app, host, port, ssl_context, reuse_port=reuse_port,
                                         handler_cancellation=True, keepalive_timeout=idle_timeout_s)
    log.info("http listening address=%s:%d", host, bound)
    return runner, bound
