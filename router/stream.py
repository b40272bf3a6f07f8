"""`ClientStream`: what one client has been sent — token ids, text through the incremental
detokenizer (UTF-8 safe, stop strings held back and cut), usage on the last message. It
outlives any one worker: after a failover the new workers' tokens continue the same stream.
"""
from __future__ import annotations

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.tokenizer import Tokenizer
from pdserve.router.request import RouterRequest
from pdserve.v1 import generation_pb2 as gen_pb2


class ClientStream:
    def __init__(self, req: RouterRequest, tokenizer: Tokenizer | None):
        self.req = req
        self.sent_ids: list[int] = []
        self.finished = False
        self._detok = None
        if tokenizer is not None:
            decode = lambda ids: tokenizer.decode(ids, req.params.skip_special_tokens)  # noqa: E731
            self._detok = IncrementalDetokenizer(decode, req.prompt_token_ids, req.params.stop)

    def delta(self, ids: list[int], reason: int, logprobs=(), steps: int = 0) -> gen_pb2.GenerateResponse:
        """The message for a worker's token delta (`reason`: its finish reason, or unset;
        `logprobs`: `TokenLogprobs` per token, when the request asked for them; `steps`: the
        engine steps its tokens came from, 0 if not counted)."""
        if self._detok is not None and not self._detok.has_stop:
            self._detok.add_many(ids)  # a merged delta's tokens decoded at once
        elif self._detok is not None:
            for i, tok in enumerate(ids):
                self._detok.add(tok)
                if self._detok.stopped:  # a stop string ended inside this delta
                    ids, reason = ids[:i + 1], gen_pb2.STOP
                    break
        self.sent_ids.extend(ids)
        self.finished = reason != gen_pb2.FINISH_REASON_UNSPECIFIED
        text = self._detok.take_delta(final=self.finished) if self._detok else ""
        resp = gen_pb2.GenerateResponse(request_id=self.req.client_request_id, token_ids=ids, text=text,
                                        logprobs=list(logprobs)[:len(ids)], num_steps=steps)
        if self.finished:
            resp.finish_reason = reason
            resp.usage.prompt_tokens = len(self.req.prompt_token_ids)
            resp.usage.completion_tokens = len(self.sent_ids)
        return resp
