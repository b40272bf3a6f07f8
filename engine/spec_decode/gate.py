"""`SpeculationGate`: speculate only where it measurably pays, per batch size.

The depth model (`depth.py`) picks each sequence's k from predicted costs; this gate checks the
prediction against what happens. For each batch-size bucket (1, 2–3, 4–7, 8–15, …) it keeps a
decayed sum of wall seconds and of emitted tokens over recent steady pure-decode steps, with and
without speculation, and lets a step speculate only while that is the cheaper mode per token.
Each mode first runs a short burst to be measured; afterwards the losing mode runs one burst
every PERIOD steps, so a change in acceptance or load is noticed. This is what keeps speculation from being slower than plain decoding at batch sizes
where verification is not free (a compute-bound CPU, large batches), whatever the model says.
"""
from __future__ import annotations


class SpeculationGate:
    BURST = 4  # steps a mode runs when it is measured
    PERIOD = 64  # every PERIOD steps, the losing mode runs for one BURST
    DECAY = 0.9  # per observation, for the decayed sums of seconds and tokens

    def __init__(self) -> None:
        self._sums: dict[tuple[int, bool], list[float]] = {}  # (bucket, speculated) -> [seconds, tokens]
        self._steps: dict[int, int] = {}

    @staticmethod
    def bucket(batch_size: int) -> int:
        return max(batch_size, 1).bit_length()

    def allow(self, batch_size: int) -> bool:
        """Whether this step may speculate: a burst of each mode first, then the cheaper one,
        with a burst of the other every PERIOD steps."""
        b = self.bucket(batch_size)
        self._steps[b] = n = self._steps.get(b, 0) + 1
        if n <= 2 * self.BURST:
            return n <= self.BURST
        spec, plain = self.seconds_per_token(batch_size, True), self.seconds_per_token(batch_size, False)
        if spec is None or plain is None:
            return spec is None
        exploring = n % self.PERIOD < self.BURST
        return (spec <= plain) != exploring

    def observe(self, batch_size: int, speculated: bool, seconds: float, num_tokens: int) -> None:
        """A steady pure-decode step's wall time and the tokens it emitted."""
        sums = self._sums.setdefault((self.bucket(batch_size), speculated), [0.0, 0.0])
        sums[0] = sums[0] * self.DECAY + seconds
        sums[1] = sums[1] * self.DECAY + num_tokens

    def seconds_per_token(self, batch_size: int, speculated: bool) -> float | None:
        sums = self._sums.get((self.bucket(batch_size), speculated))
        return sums[0] / sums[1] if sums and sums[1] > 0 else None
