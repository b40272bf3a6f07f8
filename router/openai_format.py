"""OpenAI's response shapes, built from the router's `GenerateResponse` deltas: completions
(`text_completion`) and chat (`chat.completion`, `chat.completion.chunk`), with their two
log-probability shapes, usage, and the error shape.

Log-probabilities are the model's own (before penalties, temperature and filters), as the
engine computed them from the target model's logits. A token's string is its own decoding
(special tokens included); a token that is part of a multi-byte character decodes to U+FFFD,
and its `bytes` say so.
"""
from __future__ import annotations

import json

from aiohttp import web

from pdserve.engine.tokenizer import Tokenizer
from pdserve.serving.convert import FINISH_REASON_NAMES
from pdserve.v1 import generation_pb2 as gen_pb2


def error_response(status: int, message: str, param: str | None = None, code: str | int | None = None) -> web.Response:
    kind = {400: "invalid_request_error", 404: "invalid_request_error", 408: "invalid_request_error",
            413: "invalid_request_error", 401: "authentication_error", 429: "rate_limit_error"}.get(status, "server_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code if code is not None else status}}
    return web.json_response(body, status=status)


def sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class TokenText:
    """Token ids as the strings log-probabilities are keyed by."""

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer

    def __call__(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], False)


class Choice:
    """One choice's progress (one of `n`): the text so far and what its next chunk reports."""

    def __init__(self, index: int, token_text: TokenText, num_logprobs: int | None, prefix: str = ""):
        self.index, self.token_text, self.num_logprobs = index, token_text, num_logprobs
        self.prefix = prefix  # echo: the prompt's text, sent before the first delta
        self.text_parts: list[str] = [prefix] if prefix else []
        self.text_offset = len(prefix)
        self.token_ids: list[int] = []
        self.logprobs: list[gen_pb2.TokenLogprobs] = []
        self.finish_reason: str | None = None
        self.num_tokens = 0
        self.is_first = True

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def add(self, msg: gen_pb2.GenerateResponse) -> None:
        self.token_ids.extend(msg.token_ids)
        self.logprobs.extend(msg.logprobs)
        self.text_parts.append(msg.text)
        if msg.finish_reason:
            self.finish_reason = FINISH_REASON_NAMES.get(msg.finish_reason)
            self.num_tokens = msg.usage.completion_tokens

    # ---- log-probabilities ---------------------------------------------------------------
    def completion_logprobs(self, token_ids, rows) -> dict | None:
        """`{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` of these tokens."""
        if self.num_logprobs is None:
            return None
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tok, row in zip(token_ids, rows):
            text = self.token_text(tok)
            out["tokens"].append(text)
            out["token_logprobs"].append(row.logprob)
            out["top_logprobs"].append({self.token_text(t): lp for t, lp in zip(row.top_token_ids, row.top_logprobs)})
            out["text_offset"].append(self.text_offset)
            self.text_offset += len(text)
        return out

    def chat_logprobs(self, token_ids, rows) -> dict | None:
        """`{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}` of these tokens."""
        if self.num_logprobs is None:
            return None
        return {"content": [{**self._entry(tok, row.logprob), "top_logprobs": [
            self._entry(t, lp) for t, lp in zip(row.top_token_ids, row.top_logprobs)]}
            for tok, row in zip(token_ids, rows)]}

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    # ---- shapes ---------------------------------------------------------------------------
    def completion(self) -> dict:
        return {"index": self.index, "text": self.text, "finish_reason": self.finish_reason,
                "logprobs": self.completion_logprobs(self.token_ids, self.logprobs)}

    def chat(self) -> dict:
        return {"index": self.index, "message": {"role": "assistant", "content": self.text},
                "finish_reason": self.finish_reason, "logprobs": self.chat_logprobs(self.token_ids, self.logprobs)}

    def completion_chunk(self, msg: gen_pb2.GenerateResponse) -> dict:
        text = msg.text
        if self.is_first:
            text, self.is_first = self.prefix + text, False
        self.add(msg)
        return {"index": self.index, "text": text, "token_ids": list(msg.token_ids),
                "finish_reason": self.finish_reason, "logprobs": self.completion_logprobs(msg.token_ids, msg.logprobs)}

    def chat_chunk(self, msg: gen_pb2.GenerateResponse) -> dict:
        delta = {"content": msg.text}
        if self.is_first:
            delta, self.is_first = {"role": "assistant", **delta}, False
        self.add(msg)
        return {"index": self.index, "delta": delta, "finish_reason": self.finish_reason,
                "logprobs": self.chat_logprobs(msg.token_ids, msg.logprobs)}
