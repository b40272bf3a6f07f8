"""Fitting a `StepCost` to measured steps: least squares with every coefficient >= 0.

A step's cost is a sum of non-negative parts, so a negative coefficient (noise fitting noise)
would predict negative costs for other shapes. With at most four features, the exact
non-negative least-squares solution is found by trying every subset of features, solving the
ordinary problem on each, and keeping the best one whose coefficients are all >= 0.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from pdserve.loadgen.costs import StepCost

FEATURES = ("fixed_s", "per_seq_s", "per_token_s", "per_context_token_s")


@dataclass(frozen=True, slots=True)
class StepPoint:
    """One measured step: its shape and its median wall time."""

    num_seqs: int
    num_tokens: int
    attention: int
    seconds: float

    def features(self) -> tuple[float, float, float, float]:
        return (1.0, float(self.num_seqs), float(self.num_tokens), float(self.attention))


@dataclass(frozen=True, slots=True)
class Fit:
    cost: StepCost
    rel_rms_error: float  # root mean square of (predicted - measured) / measured
    num_points: int

    def describe(self) -> str:
        return f"fit over {self.num_points} measured steps, relative RMS error {self.rel_rms_error:.1%}"


def fit_step_cost(points: list[StepPoint], use: tuple[str, ...] = FEATURES) -> Fit:
    """Non-negative least squares on relative error (so short steps count as much as long ones)."""
    import numpy as np

    if len(points) < len(use):
        raise ValueError(f"a fit over {len(use)} features needs at least {len(use)} points, got {len(points)}")
    cols = [FEATURES.index(name) for name in use]
    x = np.array([[p.features()[c] for c in cols] for p in points])
    y = np.array([p.seconds for p in points])
    w = 1.0 / y
    best, best_err = None, math.inf
    for k in range(1, len(cols) + 1):
        for subset in itertools.combinations(range(len(cols)), k):
            coef, *_ = np.linalg.lstsq(x[:, subset] * w[:, None], y * w, rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(len(cols))
            full[list(subset)] = coef
            err = float(np.sqrt(np.mean(((x @ full - y) * w) ** 2)))
            if err < best_err:
                best, best_err = full, err
    values = dict.fromkeys(FEATURES, 0.0)
    values.update({name: float(v) for name, v in zip(use, best)})
    return Fit(StepCost(**values), best_err, len(points))
