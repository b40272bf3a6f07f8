"""When and how long to wait before trying a call again.

Only UNAVAILABLE is retried, and only before the call's first response arrived: once tokens
have reached the caller, a second attempt would send them again. Backoff follows gRPC's own
retry design (A6): attempt n waits uniform(0, min(max_backoff, initial * multiplier**(n-1)))
seconds ("full jitter", so many clients failing at once do not come back in step), and never
past the call's deadline.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass

import grpc

RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE})


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    max_attempts: int = 3  # 1: never retry
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ValueError(f"max_attempts must be an integer >= 1, got {self.max_attempts!r}")
        if self.initial_backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError("initial_backoff_s and max_backoff_s must be >= 0")
        if self.multiplier < 1:
            raise ValueError(f"multiplier must be >= 1, got {self.multiplier!r}")

    def backoff_s(self, attempt: int, rng: random.Random) -> float:
        """Seconds to wait after failed attempt number `attempt` (1-based)."""
        cap = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (attempt - 1))
        return rng.uniform(0.0, cap)


class Attempts:
    """One call's attempts: whether another may start, and how long to sleep first.
    The sync and asyncio clients share it and do their own sleeping."""

    def __init__(self, policy: RetryPolicy, deadline: float | None, rng: random.Random | None = None):
        self.policy = policy
        self.deadline = deadline  # time.monotonic() seconds, or None
        self.rng = rng or random.Random()
        self.num_made = 0

    def timeout(self) -> float | None:
        """Seconds left for the next attempt (None: no deadline)."""
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - time.monotonic())

    def retry_after(self, code: grpc.StatusCode) -> float | None:
        """After a failure before any response: seconds to wait before retrying, or None to give up."""
        if code not in RETRYABLE or self.num_made >= self.policy.max_attempts:
            return None
        wait = self.policy.backoff_s(self.num_made, self.rng)
        if self.deadline is not None and time.monotonic() + wait >= self.deadline:
            return None
        return wait
