"""One request's timings as the client saw them, and the latencies derived from them.

All times are seconds from the start of the run (`time.perf_counter()` based). The
definitions match the router's Prometheus histograms, so the two can be compared:

    sent ──TTFT──► first delta with tokens ──ITL per token──► last delta with tokens (e2e)

- TTFT: sent → the first delta that carries tokens;
- e2e: sent → the last delta that carries tokens (the finish reason travels on it);
- TPOT (per request): (e2e − TTFT) / (tokens − 1), for requests of two tokens or more;
- ITL (per token): a delta of n tokens arriving t seconds after the previous one counts t/n,
  n times (a speculative step delivers several tokens in one delta).

A request that waited for the concurrency cap has `sent_s` later than `scheduled_s`; latencies
start at `sent_s`, as in vLLM's benchmark (`client_wait_s` shows the difference).
"""
from __future__ import annotations

from dataclasses import dataclass, field

OK = "OK"


@dataclass(slots=True)
class RequestRecord:
    index: int
    scheduled_s: float  # planned arrival
    max_tokens: int
    num_prompt_tokens: int | None = None  # from the server's usage when it sends one
    sent_s: float | None = None
    delta_times_s: list[float] = field(default_factory=list)  # deltas that carried tokens
    delta_tokens: list[int] = field(default_factory=list)
    end_s: float | None = None  # the stream ended (finished or failed)
    status: str = OK  # a gRPC status code name (HTTP errors mapped to one), or OK
    error: str = ""
    # the engine steps each delta's tokens came from, where the server counts them (gRPC); 0: not counted
    delta_steps: list[int] = field(default_factory=list)

    def add_delta(self, now_s: float, num_tokens: int, num_steps: int = 0) -> None:
        if num_tokens > 0:
            self.delta_times_s.append(now_s)
            self.delta_tokens.append(num_tokens)
            self.delta_steps.append(num_steps)

    @property
    def is_ok(self) -> bool:
        return self.status == OK and bool(self.delta_times_s)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.delta_tokens)

    @property
    def client_wait_s(self) -> float | None:
        return None if self.sent_s is None else self.sent_s - self.scheduled_s

    @property
    def ttft_s(self) -> float | None:
        return self.delta_times_s[0] - self.sent_s if self.is_ok else None

    @property
    def e2e_s(self) -> float | None:
        return self.delta_times_s[-1] - self.sent_s if self.is_ok else None

    @property
    def tpot_s(self) -> float | None:
        n = self.num_output_tokens
        if not self.is_ok or n < 2:
            return None
        return (self.delta_times_s[-1] - self.delta_times_s[0]) / (n - 1)

    def itls_s(self) -> list[float]:
        out = []
        for i in range(1, len(self.delta_times_s)):
            n = self.delta_tokens[i]
            out.extend([(self.delta_times_s[i] - self.delta_times_s[i - 1]) / n] * n)
        return out

    def to_json(self) -> dict:
        return {"index": self.index, "scheduled_s": self.scheduled_s, "sent_s": self.sent_s,
                "status": self.status, "error": self.error, "max_tokens": self.max_tokens,
                "num_prompt_tokens": self.num_prompt_tokens, "num_output_tokens": self.num_output_tokens,
                "ttft_s": self.ttft_s, "tpot_s": self.tpot_s, "e2e_s": self.e2e_s,
                "delta_times_s": self.delta_times_s, "delta_tokens": self.delta_tokens,
                "delta_steps": self.delta_steps, "end_s": self.end_s}

    @classmethod
    def from_json(cls, obj: dict) -> "RequestRecord":
        return cls(obj["index"], obj["scheduled_s"], obj["max_tokens"], obj.get("num_prompt_tokens"),
                   obj.get("sent_s"), list(obj["delta_times_s"]), list(obj["delta_tokens"]), obj.get("end_s"),
                   obj["status"], obj.get("error", ""), list(obj.get("delta_steps", [0] * len(obj["delta_tokens"]))))
