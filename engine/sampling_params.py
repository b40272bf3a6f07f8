"""`SamplingParams`: what a request asks of the sampler, validated where it is built."""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    """OpenAI-style sampling knobs. `temperature=0` is greedy; an unset `seed` is drawn at random
    when the request is added, so every request's randomness is reproducible from its seed."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) = off
    min_p: float = 0.0
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None  # top-N log-probabilities per generated token
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        _check(_is_real(self.temperature) and self.temperature >= 0,
               "temperature", self.temperature, "must be a finite number >= 0")
        _check(_is_real(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]")
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k", self.top_k, "must be an integer >= 0 (0 or -1 = off)")
        _check(_is_real(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "must be in [0, 1]")
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", self.max_tokens, "must be an integer >= 1")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop, "must be non-empty strings")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", self.stop_token_ids, "must be non-negative integers")
        _check(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**64),
               "seed", self.seed, "must be an integer in [0, 2**64)")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
               "logprobs", self.logprobs, "must be an integer in [0, 20]")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check(ok: bool, name: str, value: object, why: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} {why}, got {value!r}")
