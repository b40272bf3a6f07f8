"""What the engine hands back per request: cumulative state plus the delta of this step."""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.sequence import FinishReason


@dataclass(slots=True)
class RequestOutput:
    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all generated so far
    text: str  # all text released so far
    new_token_ids: list[int] = field(default_factory=list)  # this step's
    new_text: str = ""
    finished: bool = False
    finish_reason: FinishReason | None = None
    logprobs: list[list[tuple[int, float]]] | None = None
    num_cached_tokens: int = 0
    # the outputs that carried this request's tokens so far: its first token's, then one per
    # decode step (a speculative step's tokens are one). Cumulative, like token_ids
    num_steps: int = 0

    @property
    def finish_reason_str(self) -> str | None:
        return self.finish_reason.value if self.finish_reason else None
