"""Turning a `GenerateRequest` into a validated, tokenized, seeded `RouterRequest`.

Every rejection is a `ValueError` whose message starts with the offending field's name; the
server answers it with INVALID_ARGUMENT.
"""
from __future__ import annotations

import random
import uuid
from dataclasses import dataclass
from typing import Callable

import grpc

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import Tokenizer
from pdserve.router.request import RequestFailed, RouterRequest
from pdserve.serving.convert import check_stop_limits, sampling_kwargs
from pdserve.v1 import generation_pb2

MAX_REQUEST_ID_CHARS = 256


@dataclass(frozen=True, slots=True)
class Limits:
    max_model_len: int
    vocab_size: int
    max_prompt_chars: int


class Validator:
    """`context()` gives (max_model_len, vocab_size) that every decode worker accepts, or None
    while no decode worker has reported (requests are then UNAVAILABLE, not guessed at)."""

    def __init__(self, tokenizer: Tokenizer | None, max_prompt_chars: int, context: Callable[[], tuple[int, int] | None]):
        self.tokenizer = tokenizer
        self.max_prompt_chars = max_prompt_chars
        self.context = context
        self._rng = random.Random()

    @property
    def limits(self) -> Limits:
        context = self.context()
        if context is None:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, "no decode worker has joined yet")
        return Limits(*context, self.max_prompt_chars)

    def parse(self, msg: generation_pb2.GenerateRequest) -> RouterRequest:
        """Validate and tokenize: ValueError naming the field, or RequestFailed(UNAVAILABLE)."""
        if len(msg.request_id) > MAX_REQUEST_ID_CHARS:
            raise ValueError(f"request_id has {len(msg.request_id)} characters; the limit is {MAX_REQUEST_ID_CHARS}")
        lim = self.limits
        ids = self._prompt_ids(msg, lim)
        params = self._params(msg.sampling_params, lim, room=lim.max_model_len - len(ids))
        return RouterRequest(uuid.uuid4().hex, msg.request_id or f"req-{uuid.uuid4().hex[:12]}", ids, params)

    def _prompt_ids(self, msg: generation_pb2.GenerateRequest, lim: Limits) -> list[int]:
        which = msg.WhichOneof("input")
        if which is None:
            raise ValueError("prompt: one of prompt or token_ids is required")
        if which == "prompt":
            if not msg.prompt:
                raise ValueError("prompt is empty")
            if len(msg.prompt) > lim.max_prompt_chars:
                raise ValueError(f"prompt has {len(msg.prompt)} characters; the limit is {lim.max_prompt_chars}")
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; send token_ids")
            ids = self.tokenizer.encode(msg.prompt)
            field = "prompt"
        else:
            ids = list(msg.token_ids.ids)
            field = "token_ids"
            if not ids:
                raise ValueError("token_ids is empty")
            unknown = [t for t in ids if t >= lim.vocab_size]
            if unknown:
                raise ValueError(f"token_ids contains unknown token ids {unknown[:5]} (vocabulary size {lim.vocab_size})")
        if not ids:
            raise ValueError(f"{field} is empty after tokenization")
        if len(ids) >= lim.max_model_len:
            raise ValueError(f"{field} has {len(ids)} tokens; the model's context is {lim.max_model_len}, "
                             "which leaves no room to generate")
        return ids

    def _params(self, msg: generation_pb2.SamplingParams, lim: Limits, room: int) -> SamplingParams:
        """`room`: tokens the context leaves after the prompt. An explicit max_tokens beyond it is
        an error; the default (16) shrinks to fit."""
        check_stop_limits(msg.stop, msg.stop_token_ids)
        unknown = [t for t in msg.stop_token_ids if t >= lim.vocab_size]
        if unknown:
            raise ValueError(f"sampling_params.stop_token_ids contains unknown token ids {unknown[:5]}")
        if msg.HasField("max_tokens") and msg.max_tokens > room:
            raise ValueError(f"sampling_params.max_tokens is {msg.max_tokens}, but the model's context "
                             f"({lim.max_model_len}) leaves room for {room} tokens after the prompt")
        kwargs = sampling_kwargs(msg)
        kwargs["max_tokens"] = min(kwargs["max_tokens"], room)
        if kwargs["seed"] is None:
            kwargs["seed"] = self._rng.getrandbits(63)  # both workers must sample with the same seed
        try:
            return SamplingParams(**kwargs)
        except ValueError as e:
            raise ValueError(str(e).replace("SamplingParams.", "sampling_params.", 1)) from None
