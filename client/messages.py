"""The client's plain records, and the one place they meet protobuf.

`SamplingParams` mirrors `pdserve.v1.SamplingParams` field for field (unset = the server's
default, which is OpenAI's); `make_request` builds the `GenerateRequest`; `delta_from` turns
each `GenerateResponse` into a `Delta`. Validation here catches what the wire types cannot hold
(a negative `max_tokens`, a token id past 2**32) with a `ValueError` that names the field; the
server validates the rest and answers INVALID_ARGUMENT.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from enum import Enum
from typing import Sequence

from pdserve.v1 import generation_pb2 as gen_pb2

UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
INT32_MIN, INT32_MAX = -2**31, 2**31 - 1


class FinishReason(Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # ended by the server before finishing


_FINISH_FROM_WIRE = {gen_pb2.STOP: FinishReason.STOP, gen_pb2.LENGTH: FinishReason.LENGTH,
                     gen_pb2.ABORT: FinishReason.ABORT}


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling options of one request; None leaves a field unset (the server's default)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # log-probs of each token and of its top N alternatives (Delta.logprobs)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None and not _is_number(value):
                raise ValueError(f"{name} must be a number, got {value!r}")
        _check_int("top_k", self.top_k, INT32_MIN, INT32_MAX)
        _check_int("max_tokens", self.max_tokens, 1, UINT32_MAX)
        _check_int("seed", self.seed, 0, UINT64_MAX)
        _check_int("logprobs", self.logprobs, 0, UINT32_MAX)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(s, str) for s in stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        ids = tuple(self.stop_token_ids)
        for t in ids:
            _check_int("stop_token_ids", t, 0, UINT32_MAX)
        object.__setattr__(self, "stop_token_ids", ids)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    def to_proto(self) -> gen_pb2.SamplingParams:
        msg = gen_pb2.SamplingParams(stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos)
        for name in ("temperature", "top_p", "top_k", "min_p", "max_tokens", "seed", "logprobs", "presence_penalty",
                     "frequency_penalty"):
            value = getattr(self, name)
            if value is not None:
                setattr(msg, name, value)
        return msg


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if value is None:
        return
    if not _is_int(value) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")


Prompt = str | Sequence[int]


def make_request(prompt: Prompt, params: SamplingParams, request_id: str | None = None) -> gen_pb2.GenerateRequest:
    """A GenerateRequest for a text prompt or a list of token ids; a fresh id when none is given."""
    req = gen_pb2.GenerateRequest(request_id=request_id if request_id is not None else uuid.uuid4().hex,
                                  sampling_params=params.to_proto())
    if isinstance(prompt, str):
        req.prompt = prompt
    elif isinstance(prompt, (list, tuple)) and all(_is_int(t) and 0 <= t <= UINT32_MAX for t in prompt):
        req.token_ids.ids.extend(prompt)
    else:
        raise ValueError("prompt must be a string or a list of token ids (integers in [0, 2**32))")
    return req


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The model's log-probability of one generated token, and its top alternatives (most likely first)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability)


@dataclass(frozen=True, slots=True)
class Delta:
    """One streamed message: its new text and token ids; the last one has finish_reason and usage."""

    text: str
    token_ids: tuple[int, ...]
    request_id: str
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token id, when asked for
    num_steps: int = 0  # the engine steps its tokens came from (0: not counted by the server)

    @property
    def is_last(self) -> bool:
        return self.finish_reason is not None


def delta_from(msg: gen_pb2.GenerateResponse) -> Delta:
    reason = _FINISH_FROM_WIRE.get(msg.finish_reason)
    usage = Usage(msg.usage.prompt_tokens, msg.usage.completion_tokens) if reason is not None else None
    logprobs = tuple(TokenLogprobs(lp.logprob, tuple(zip(lp.top_token_ids, lp.top_logprobs))) for lp in msg.logprobs)
    return Delta(msg.text, tuple(msg.token_ids), msg.request_id, reason, usage, logprobs, msg.num_steps)


@dataclass(slots=True)
class Completion:
    """A whole response, as `complete()` returns it."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    request_id: str = ""
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        self.request_id = delta.request_id or self.request_id
        if delta.is_last:
            self.finish_reason, self.usage = delta.finish_reason, delta.usage
