"""`SpeculationGate`: speculate only where it measurably pays, per batch size.

The depth model (`depth.py`) picks each sequence's k from predicted costs; this gate checks the
prediction against what happens. For each batch-size bucket (1, 2–3, 4–7, 8–15, …) it keeps a
moving average of wall seconds per emitted token over recent pure-decode steps, with and without
speculation, and lets a step speculate only while that is the cheaper mode. Every
`EXPLORE_EVERY`-th step of a bucket runs the other mode, so a change in acceptance or load is
noticed. This is what keeps speculation from being slower than plain decoding at batch sizes
where verification is not free (a compute-bound CPU, large batches), whatever the model says.
"""
from __future__ import annotations


class SpeculationGate:
    EXPLORE_EVERY = 16
    SMOOTHING = 0.2

    def __init__(self) -> None:
        self._cost: dict[tuple[int, bool], float] = {}  # (bucket, speculated) -> seconds per token
        self._steps: dict[int, int] = {}

    @staticmethod
    def bucket(batch_size: int) -> int:
        return max(batch_size, 1).bit_length()

    def allow(self, batch_size: int) -> bool:
        """Whether this step may speculate."""
        b = self.bucket(batch_size)
        self._steps[b] = n = self._steps.get(b, 0) + 1
        spec, plain = self._cost.get((b, True)), self._cost.get((b, False))
        if spec is None:  # measure speculation first, then plain decoding
            return True
        if plain is None:
            return False
        better = spec <= plain
        return (not better) if n % self.EXPLORE_EVERY == 0 else better

    def observe(self, batch_size: int, speculated: bool, seconds: float, num_tokens: int) -> None:
        """A pure-decode step's wall time and the tokens it emitted."""
        if num_tokens <= 0:
            return
        key = (self.bucket(batch_size), speculated)
        per_token = seconds / num_tokens
        old = self._cost.get(key)
        self._cost[key] = per_token if old is None else old + self.SMOOTHING * (per_token - old)

    def seconds_per_token(self, batch_size: int, speculated: bool) -> float | None:
        return self._cost.get((self.bucket(batch_size), speculated))
