"""Adaptive speculation depth: each sequence's k follows its recent acceptance, through a cost
model of target and draft step times that knows the batch size.

For a sequence with per-token acceptance rate α, k draft tokens yield on average
E(k) = (1 − α^(k+1)) / (1 − α) tokens per step. Its share of a step's cost, in a batch of B
decoding sequences each verifying k + 1 positions, is

    cost(k) = T_target(B·(k+1)) / B + k · T_draft(B) / B

with T(n) the measured time of a forward pass over n tokens. The depth picked maximises
E(k) / cost(k); k = 0 (plain decoding) wins when verification stops being nearly free, as at
large batches. A sequence that stops speculating drifts back to the prior, so it tries again.
"""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.sequence import Sequence


class LinearCost:
    """seconds ≈ a + b·n, fit by exponentially weighted least squares over observed passes,
    starting from a weak prior (two pseudo-observations on the prior line)."""

    def __init__(self, a: float, b: float, decay: float = 0.97):
        self.decay = decay
        self._s = [0.0] * 5  # weighted sums of 1, n, n², t, n·t
        for n in (1, 64):
            self.observe(n, a + b * n, weight=0.5)
        self.a, self.b = a, b

    def observe(self, n: int, seconds: float, weight: float = 1.0) -> None:
        s = [x * self.decay for x in self._s]
        for i, v in enumerate((1.0, n, n * n, seconds, n * seconds)):
            s[i] += weight * v
        self._s = s
        w, sn, snn, st, snt = s
        det = w * snn - sn * sn
        if det > 1e-12:
            b = (w * snt - sn * st) / det
            self.b = max(b, 0.0)
            self.a = max((st - self.b * sn) / w, 0.0)

    def __call__(self, n: int) -> float:
        return self.a + self.b * n


@dataclass(slots=True)
class _Acceptance:
    accepted: float = 0.0
    trials: float = 0.0


class AdaptiveDepth:
    PRIOR, PRIOR_WEIGHT, DECAY, DRIFT = 0.7, 2.0, 0.8, 0.97

    def __init__(self, max_k: int, adaptive: bool, target_cost: LinearCost, draft_cost: LinearCost | None):
        self.max_k, self.adaptive = max_k, adaptive
        self.target_cost, self.draft_cost = target_cost, draft_cost
        self._acc: dict[str, _Acceptance] = {}

    def alpha(self, req_id: str) -> float:
        acc = self._acc.get(req_id, _Acceptance())
        return (acc.accepted + self.PRIOR * self.PRIOR_WEIGHT) / (acc.trials + self.PRIOR_WEIGHT)

    def expected_tokens(self, alpha: float, k: int) -> float:
        return k + 1.0 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)

    def step_cost(self, k: int, batch_size: int) -> float:
        b = max(batch_size, 1)
        draft = self.draft_cost(b) if self.draft_cost else 0.0
        return self.target_cost(b * (k + 1)) / b + k * draft / b

    def choose(self, seq: Sequence, batch_size: int, limit: int) -> int:
        """k for this step, at most `limit` (room left before max_tokens / the context end)."""
        top = max(0, min(self.max_k, limit))
        if not self.adaptive or top == 0:
            return top
        alpha = self.alpha(seq.req_id)
        rates = [self.expected_tokens(alpha, k) / self.step_cost(k, batch_size) for k in range(top + 1)]
        k = max(range(top + 1), key=rates.__getitem__)
        if k == 0:  # not speculating: forget slowly so the sequence tries again later
            acc = self._acc.setdefault(seq.req_id, _Acceptance())
            acc.accepted *= self.DRIFT
            acc.trials *= self.DRIFT
        return k

    def record(self, req_id: str, k: int, num_accepted: int) -> None:
        acc = self._acc.setdefault(req_id, _Acceptance())
        acc.accepted = acc.accepted * self.DECAY + num_accepted
        acc.trials = acc.trials * self.DECAY + num_accepted + (1 if num_accepted < k else 0)

    def forget(self, req_id: str) -> None:
        self._acc.pop(req_id, None)
