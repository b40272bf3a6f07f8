"""`ApiKeys`: who may use the public APIs, and how much.

When keys are configured (`--api-key`, repeatable, or `PDSERVE_API_KEY`, comma separated), every
request to the public gRPC API (`authorization: Bearer <key>` metadata) and the OpenAI HTTP API
(the same header) must present one: UNAUTHENTICATED / HTTP 401 otherwise. `/health`, `/ready`
and `/metrics` need none. Each key may be limited in requests per second (a token bucket with a
burst of one second's worth) and in requests in flight; past either, RESOURCE_EXHAUSTED / 429.
A request holds its key's slot (`lease`) until it ends.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc

from pdserve.router.request import RequestFailed

API_KEY_ENV = "PDSERVE_API_KEY"


@dataclass(slots=True)
class _Usage:
    tokens: float
    last: float
    in_flight: int = 0


@dataclass
class ApiKeys:
    keys: tuple[str, ...] = ()
    rate_limit: float | None = None  # requests per second per key
    max_concurrency: int | None = None  # requests in flight per key
    _usage: dict[str, _Usage] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if any(len(k) < 8 for k in self.keys):
            raise ValueError("API keys must be at least 8 characters")
        if self.rate_limit is not None and self.rate_limit <= 0:
            raise ValueError(f"--api-key-rate-limit must be > 0, got {self.rate_limit}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--api-key-max-concurrency must be >= 1, got {self.max_concurrency}")
        self._digests = {hashlib.sha256(k.encode()).digest(): k for k in self.keys}

    @classmethod
    def from_flags(cls, keys: list[str] | None, rate_limit: float | None, max_concurrency: int | None) -> ApiKeys:
        found = list(keys or []) + [k for k in os.environ.get(API_KEY_ENV, "").split(",") if k.strip()]
        return cls(tuple(k.strip() for k in found), rate_limit, max_concurrency)

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def identify(self, authorization: str | None) -> str | None:
        """The key a request presents (None when keys are off); UNAUTHENTICATED when it has none
        or a wrong one."""
        if not self.enabled:
            return None
        scheme, _, presented = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not presented:
            raise RequestFailed(grpc.StatusCode.UNAUTHENTICATED, "an API key is required: send "
                                "'authorization: Bearer <key>'")
        digest = hashlib.sha256(presented.strip().encode()).digest()
        for known, key in self._digests.items():  # constant time per key
            if hmac.compare_digest(known, digest):
                return key
        raise RequestFailed(grpc.StatusCode.UNAUTHENTICATED, "the API key is not valid")

    @contextmanager
    def lease(self, key: str | None):
        """Hold one of the key's request slots for the duration; RESOURCE_EXHAUSTED past its limits."""
        if key is None:
            yield
            return
        now = time.monotonic()
        burst = max(1.0, self.rate_limit or 0.0)
        usage = self._usage.setdefault(key, _Usage(tokens=burst, last=now))
        if self.rate_limit is not None:
            usage.tokens = min(burst, usage.tokens + (now - usage.last) * self.rate_limit)
            usage.last = now
            if usage.tokens < 1:
                raise RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"this API key is limited to {self.rate_limit:g} requests per second")
        if self.max_concurrency is not None and usage.in_flight >= self.max_concurrency:
            raise RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"this API key is limited to {self.max_concurrency} requests in flight")
        if self.rate_limit is not None:
            usage.tokens -= 1
        usage.in_flight += 1
        try:
            yield
        finally:
            usage.in_flight -= 1
