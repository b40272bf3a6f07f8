"""OpenAI request bodies (`/v1/completions`, `/v1/chat/completions`) -> `OpenAIRequest`.

Strict, like OpenAI's own API: every field has one JSON type (`"stream": "no"` and
`"max_tokens": 1.5` are errors, as is `true` where a number belongs), a field we do not
implement is refused by name rather than ignored (`logit_bias`, `tools`, `best_of` > `n`, …),
an unknown field is refused by name, and JSON nested deeper than any valid request is refused
before it is walked. `null` means unset everywhere. Every refusal is an `OpenAIError` carrying
the HTTP status, the message and the offending parameter, for OpenAI's error shape.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from pdserve.router.chat_template import ChatMessage
from pdserve.v1 import generation_pb2 as gen_pb2

MAX_N = 16
MAX_LOGPROBS = 20
MAX_JSON_DEPTH = 16  # a chat request with content parts is 5 deep
MAX_MESSAGES = 1024
CHAT_ROLES = ("system", "developer", "user", "assistant")

# fields both endpoints take (value: what the sampling parameters call them)
_COMMON = {"model", "stream", "stream_options", "n", "max_tokens", "temperature", "top_p", "top_k", "min_p",
           "seed", "stop", "stop_token_ids", "presence_penalty", "frequency_penalty", "ignore_eos", "user",
           "logit_bias", "logprobs"}
_COMPLETIONS = _COMMON | {"prompt", "echo", "best_of", "suffix"}
_CHAT = _COMMON | {"messages", "top_logprobs", "max_completion_tokens", "tools", "tool_choice", "functions",
                   "function_call", "parallel_tool_calls", "response_format"}
# accepted only at the value that means "not used"
_ONLY_UNSET = {"suffix": "a suffix", "tools": "tools", "tool_choice": "tool_choice", "functions": "functions",
               "function_call": "function_call", "parallel_tool_calls": "parallel_tool_calls"}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def bad(message: str, param: str | None) -> OpenAIError:
    return OpenAIError(400, message, param, "invalid_value" if param else None)


@dataclass(slots=True)
class OpenAIRequest:
    """What the HTTP front end needs besides the `GenerateRequest` it validates through the router."""

    is_chat: bool
    model: str | None
    message: gen_pb2.GenerateRequest  # prompt or token ids, sampling params; for chat, the prompt is set later
    messages: list[ChatMessage] = field(default_factory=list)  # chat
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    num_logprobs: int | None = None  # top alternatives per token; None: no log-probs at all
    has_max_tokens: bool = True  # chat without max_tokens: up to the context


def parse_json(raw: bytes) -> Any:
    """The body as JSON; 400 when it is not JSON or nests deeper than `MAX_JSON_DEPTH`."""
    if _depth_exceeds(raw, MAX_JSON_DEPTH):
        raise bad(f"body nests deeper than {MAX_JSON_DEPTH} levels", None)
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise bad("body is not valid JSON", None) from None


def _depth_exceeds(raw: bytes, limit: int) -> bool:
    """Whether brackets outside strings nest deeper than `limit` (a scan, no recursion)."""
    depth, in_string, escaped = 0, False, False
    for byte in raw:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > limit:
                return True
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return False


# ---- typed getters: null is unset ------------------------------------------------------
def _get(body: dict, name: str, kind: str, check=None, why: str = ""):
    value = body.get(name)
    if value is None:
        return None
    ok = {"bool": isinstance(value, bool),
          "int": isinstance(value, int) and not isinstance(value, bool),
          "number": isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
          "str": isinstance(value, str),
          "dict": isinstance(value, dict),
          "list": isinstance(value, list)}[kind]
    if not ok:
        article = {"int": "an integer", "number": "a number", "bool": "a boolean", "str": "a string",
                   "dict": "an object", "list": "an array"}[kind]
        raise bad(f"{name} must be {article}, got {json.dumps(value)[:40]}", name)
    if check is not None and not check(value):
        raise bad(f"{name} {why}, got {value!r}", name)
    return value


def _check_fields(body: object, allowed: set[str]) -> dict:
    if not isinstance(body, dict):
        raise bad("body must be a JSON object", None)
    for name in body:
        if name not in allowed:
            raise bad(f"unrecognized request argument: {name}", name)
    for name, what in _ONLY_UNSET.items():
        value = body.get(name)
        # without tools, parallel_tool_calls (a boolean) and tool_choice "none" change nothing
        unset = (value is None or value == [] or (name == "tool_choice" and value == "none")
                 or (name == "parallel_tool_calls" and isinstance(value, bool)))
        if not unset:
            raise bad(f"{name} is not supported ({what} cannot be used with this server)", name)
    logit_bias = _get(body, "logit_bias", "dict")
    if logit_bias:
        raise bad("logit_bias is not supported", "logit_bias")
    return body


def _sampling(body: dict, msg: gen_pb2.GenerateRequest, max_tokens_field: str = "max_tokens") -> bool:
    """Fill `msg.sampling_params`; whether max_tokens was given."""
    sp = msg.sampling_params
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty"):
        value = _get(body, name, "number")
        if value is not None:
            setattr(sp, name, value)
    top_k = _get(body, "top_k", "int", lambda v: v >= -1, "must be >= -1 (-1 or 0: off)")
    if top_k is not None:
        sp.top_k = max(top_k, 0)
    max_tokens = _get(body, max_tokens_field, "int", lambda v: 1 <= v < 2**32, "must be >= 1")
    if max_tokens is not None:
        sp.max_tokens = max_tokens
    seed = _get(body, "seed", "int", lambda v: 0 <= v < 2**64, "must be in [0, 2**64)")
    if seed is not None:
        sp.seed = seed
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop if stop is not None else [])
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad("stop must be a string or a list of strings", "stop")
    sp.stop.extend(stop)
    stop_ids = _get(body, "stop_token_ids", "list") or []
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in stop_ids):
        raise bad("stop_token_ids must be a list of non-negative integers", "stop_token_ids")
    sp.stop_token_ids.extend(stop_ids)
    sp.ignore_eos = bool(_get(body, "ignore_eos", "bool"))
    return max_tokens is not None


def _common(body: dict, is_chat: bool) -> OpenAIRequest:
    model = _get(body, "model", "str")
    user = _get(body, "user", "str") or ""
    msg = gen_pb2.GenerateRequest(request_id=user[:256])
    n = _get(body, "n", "int", lambda v: 1 <= v <= MAX_N, f"must be in [1, {MAX_N}]") or 1
    stream = bool(_get(body, "stream", "bool"))
    options = _get(body, "stream_options", "dict")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad("stream_options is only allowed with stream: true", "stream_options")
        unknown = set(options) - {"include_usage"}
        if unknown:
            raise bad(f"stream_options.{sorted(unknown)[0]} is not supported", "stream_options")
        include_usage = bool(_get(options, "include_usage", "bool"))
    return OpenAIRequest(is_chat, model, msg, n=n, stream=stream, include_usage=include_usage)


def parse_completion(body: object) -> OpenAIRequest:
    body = _check_fields(body, _COMPLETIONS)
    req = _common(body, is_chat=False)
    best_of = _get(body, "best_of", "int")
    if best_of is not None and best_of != req.n:
        raise bad("best_of is not supported (other than equal to n)", "best_of")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        req.message.prompt = prompt
    elif (isinstance(prompt, list) and prompt
          and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in prompt)):
        req.message.token_ids.ids.extend(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad("prompt: batches of several prompts are not supported; send one per request (or use n)", "prompt")
    else:
        raise bad("prompt must be a string or a list of non-negative token ids", "prompt")
    req.echo = bool(_get(body, "echo", "bool"))
    _sampling(body, req.message)
    req.num_logprobs = _get(body, "logprobs", "int", lambda v: 0 <= v <= MAX_LOGPROBS, f"must be in [0, {MAX_LOGPROBS}]")
    if req.echo and req.num_logprobs is not None:
        raise bad("echo with logprobs is not supported (the prompt's log-probabilities are not computed)", "echo")
    _ask_logprobs(req)
    return req


def parse_chat(body: object) -> OpenAIRequest:
    body = _check_fields(body, _CHAT)
    req = _common(body, is_chat=True)
    fmt = _get(body, "response_format", "dict")
    if fmt is not None and fmt.get("type") != "text":
        raise bad("response_format: only {\"type\": \"text\"} is supported", "response_format")
    req.messages = _messages(body.get("messages"))
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise bad("max_tokens and max_completion_tokens are the same limit: give one", "max_completion_tokens")
    given = _sampling(body, req.message, "max_completion_tokens" if body.get("max_tokens") is None else "max_tokens")
    req.has_max_tokens = given
    wants = _get(body, "logprobs", "bool")
    top = _get(body, "top_logprobs", "int", lambda v: 0 <= v <= MAX_LOGPROBS, f"must be in [0, {MAX_LOGPROBS}]")
    if top is not None and not wants:
        raise bad("top_logprobs requires logprobs: true", "top_logprobs")
    req.num_logprobs = (top or 0) if wants else None
    _ask_logprobs(req)
    return req


def _ask_logprobs(req: OpenAIRequest) -> None:
    if req.num_logprobs is not None:
        req.message.sampling_params.logprobs = req.num_logprobs


def _messages(value: object) -> list[ChatMessage]:
    if not isinstance(value, list) or not value:
        raise bad("messages must be a non-empty array of messages", "messages")
    if len(value) > MAX_MESSAGES:
        raise bad(f"messages allows {MAX_MESSAGES} messages", "messages")
    return [_message(i, m) for i, m in enumerate(value)]


def _message(i: int, m: object) -> ChatMessage:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad(f"{where} must be an object", "messages")
    unknown = set(m) - {"role", "content", "name"}
    if unknown:
        raise bad(f"{where}.{sorted(unknown)[0]} is not supported", "messages")
    role = m.get("role")
    if role not in CHAT_ROLES:
        raise bad(f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {json.dumps(role)[:40]}", "messages")
    name = m.get("name")
    if name is not None and not isinstance(name, str):
        raise bad(f"{where}.name must be a string", "messages")
    return ChatMessage(role, _content(where, m.get("content")), name)


def _content(where: str, content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"{where}.content[{j}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) are "
                          "supported", "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise bad(f"{where}.content must be a string or an array of text parts", "messages")
