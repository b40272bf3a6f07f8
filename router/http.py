"""OpenAI-compatible HTTP front end: `POST /v1/completions` (streaming as server-sent events),
`GET /v1/models`, `GET /health`, `GET /metrics` (the router's Prometheus metrics). It builds the
same `GenerateRequest` the gRPC API takes and runs it through the same `Router`, so validation,
admission, cancellation and metrics are shared.

Status codes: 400 for bad input (the message names the field), 429 when no worker can admit
the request, 503 when workers fail. A client that disconnects mid-stream cancels the request,
which frees its blocks on both workers.
"""
from __future__ import annotations

import json
import logging
import time

import grpc
from aiohttp import web

from pdserve.serving.convert import FINISH_REASON_NAMES
from pdserve.serving.metrics import metrics_handler, start_http_app
from pdserve.v1 import generation_pb2 as gen_pb2
from pdserve.router.request import RequestFailed
from pdserve.router.server import Router

log = logging.getLogger("pdserve.router.http")

# OpenAI field -> our SamplingParams field (all optional)
_SAMPLING_FIELDS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "max_tokens": int,
                    "seed": int}
_UNSUPPORTED = ("n", "best_of", "logprobs", "echo", "suffix", "logit_bias")
_HTTP_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
                grpc.StatusCode.DEADLINE_EXCEEDED: 504}
MAX_BODY_BYTES = 8 << 20
OPEN_PATHS = ("/health", "/ready", "/metrics", "/prometheus/targets")  # probes and scrapes: no API key


def _error(status: int, message: str, param: str | None = None) -> web.Response:
    kind = "invalid_request_error" if status == 400 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.json_response(body, status=status)


def completion_request(body: object) -> gen_pb2.GenerateRequest:
    """OpenAI completions body -> GenerateRequest. ValueError names the field."""
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    for name in _UNSUPPORTED:
        if body.get(name) not in (None, 1 if name in ("n", "best_of") else None, False):
            raise ValueError(f"{name} is not supported")
    req = gen_pb2.GenerateRequest(request_id=str(body.get("user") or ""))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        req.prompt = prompt
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
        req.token_ids.ids.extend(prompt)
    else:
        raise ValueError("prompt must be a string or a list of non-negative token ids")
    sp = req.sampling_params
    for name, kind in _SAMPLING_FIELDS.items():
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
            raise ValueError(f"{name} must be a number{' (integer)' if kind is int else ''}, got {value!r}")
        if kind is int and not (-2**31 <= value < 2**64):
            raise ValueError(f"{name} is out of range: {value!r}")
        if name == "max_tokens" and value < 1:
            raise ValueError(f"max_tokens must be >= 1, got {value!r}")
        if name == "seed" and value < 0:
            raise ValueError(f"seed must be >= 0, got {value!r}")
        setattr(sp, name, kind(value))
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ValueError("stop must be a string or a list of strings")
    sp.stop.extend(stop)
    sp.ignore_eos = bool(body.get("ignore_eos", False))
    return req


class CompletionsApp:
    def __init__(self, router: Router, model_name: str):
        self.router, self.model_name = router, model_name

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self.authenticate])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", metrics_handler(self.router.metrics.registry))
        app.router.add_get("/prometheus/targets", self.prometheus_targets)
        return app

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
            return _error(status, str(e))

    async def prometheus_targets(self, _request: web.Request) -> web.Response:
        """Prometheus HTTP service discovery: `pdserve serve`'s processes (404 for a standalone router)."""
        if self.router.prometheus_targets is None:
            return _error(404, "no targets: this router does not run under `pdserve serve`")
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
            {"id": self.model_name, "object": "model", "owned_by": "pdserve"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        trace = self.router.metrics.arrived()
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):  # deep nesting too: 400, not 500
            self.router.metrics.count("invalid_argument")
            return _error(400, "body is not valid JSON")
        try:
            self.router.check_accepting()
            req = self.router.validator.parse(completion_request(body))
        except ValueError as e:  # the gRPC-side names ("sampling_params.top_p") read as OpenAI's ("top_p")
            self.router.metrics.count("invalid_argument")
            message = str(e).removeprefix("sampling_params.")
            return _error(400, message, param=message.split(" ", 1)[0])
        except RequestFailed as e:
            self.router.metrics.count(e.code.name.lower())
            return _error(_HTTP_STATUS.get(e.code, 503), str(e))
        meta = {"id": f"cmpl-{req.req_id}", "created": int(time.time()), "model": self.model_name}
        if body.get("stream"):
            return await self._stream(request, req, trace, meta)
        return await self._complete(req, trace, meta)

    async def _complete(self, req, trace, meta: dict) -> web.Response:
        text, last = [], None
        try:
            async for resp in self.router.generate(req, trace):
                text.append(resp.text)
                last = resp
        except RequestFailed as e:
            return _error(_HTTP_STATUS.get(e.code, 503), str(e))
        choice = {"index": 0, "text": "".join(text), "logprobs": None,
                  "finish_reason": FINISH_REASON_NAMES.get(last.finish_reason)}
        return web.json_response({**meta, "object": "text_completion", "choices": [choice],
                                  "usage": _usage(last)})

    async def _stream(self, request: web.Request, req, trace, meta: dict) -> web.StreamResponse:
        gen = self.router.generate(req, trace)
        try:
            first = await anext(gen)  # admission failures still get a proper status code
        except RequestFailed as e:
            return _error(_HTTP_STATUS.get(e.code, 503), str(e))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        try:
            msg = first
            while msg is not None:
                await resp.write(_sse({**meta, "object": "text_completion", "choices": [_chunk_choice(msg)],
                                       **({"usage": _usage(msg)} if msg.finish_reason else {})}))
                msg = await anext(gen, None)
        except RequestFailed as e:
            await resp.write(_sse({"error": {"message": str(e), "type": "server_error", "code": e.code.name}}))
        finally:
            await gen.aclose()  # a vanished client lands here too: the workers' calls are cancelled
        await resp.write(b"data: [DONE]\n\n")
        return resp


def _chunk_choice(msg: gen_pb2.GenerateResponse) -> dict:
    return {"index": 0, "text": msg.text, "logprobs": None, "token_ids": list(msg.token_ids),
            "finish_reason": FINISH_REASON_NAMES.get(msg.finish_reason)}


def _usage(msg: gen_pb2.GenerateResponse) -> dict:
    u = msg.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def _sse(obj: dict) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


async def start_http(router: Router, host: str, port: int, model_name: str = "pdserve",
                     ssl_context=None) -> tuple[web.AppRunner, int]:
    """Serve the HTTP API (HTTPS with `ssl_context`); returns the runner and the bound port."""
    # handler_cancellation: a client gone mid-request cancels the handler, and so the request
    runner, bound = await start_http_app(CompletionsApp(router, model_name).app(), host, port, ssl_context,
                                         handler_cancellation=True)
    log.info("http listening address=%s:%d", host, bound)
    return runner, bound
