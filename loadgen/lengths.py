"""Length distributions of prompts and outputs, in tokens, written as short specs:

    fixed:128            always 128
    uniform:64,256       an integer uniform in [64, 256]
    lognormal:128,0.5    mean 128, sigma 0.5 of the underlying normal (median 128·e^(−σ²/2))
    lognormal:128,0.5,1024   the same, capped at 1024

Every draw is rounded and at least 1.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from enum import Enum


class LengthKind(Enum):
    FIXED = "fixed"
    UNIFORM = "uniform"
    LOGNORMAL = "lognormal"


_NUM_PARAMS = {LengthKind.FIXED: (1, 1), LengthKind.UNIFORM: (2, 2), LengthKind.LOGNORMAL: (2, 3)}


@dataclass(frozen=True, slots=True)
class LengthDistribution:
    kind: LengthKind
    params: tuple[float, ...]

    def __post_init__(self) -> None:
        low, high = _NUM_PARAMS[self.kind]
        if not low <= len(self.params) <= high:
            raise ValueError(f"{self.kind.value} takes {low}-{high} parameters, got {len(self.params)}")
        if any(not math.isfinite(p) for p in self.params):
            raise ValueError(f"{self.kind.value} parameters must be finite, got {self.params}")
        if self.kind is LengthKind.FIXED and self.params[0] < 1:
            raise ValueError(f"fixed length must be >= 1, got {self.params[0]:g}")
        if self.kind is LengthKind.UNIFORM and not 1 <= self.params[0] <= self.params[1]:
            raise ValueError(f"uniform bounds must satisfy 1 <= low <= high, got {self.params}")
        if self.kind is LengthKind.LOGNORMAL:
            if self.params[0] < 1 or self.params[1] < 0:
                raise ValueError(f"lognormal needs mean >= 1 and sigma >= 0, got {self.params}")
            if len(self.params) == 3 and self.params[2] < 1:
                raise ValueError(f"lognormal cap must be >= 1, got {self.params[2]:g}")

    @classmethod
    def parse(cls, spec: str) -> "LengthDistribution":
        """From 'kind:p1,p2,...'; ValueError says what is wrong."""
        name, _, rest = spec.strip().partition(":")
        try:
            kind = LengthKind(name.lower())
        except ValueError:
            raise ValueError(f"unknown length distribution {name!r} in {spec!r}: use "
                             f"{', '.join(k.value for k in LengthKind)}") from None
        try:
            params = tuple(float(p) for p in rest.split(",")) if rest else ()
        except ValueError:
            raise ValueError(f"length distribution parameters must be numbers, got {spec!r}") from None
        return cls(kind, params)

    @property
    def spec(self) -> str:
        return f"{self.kind.value}:" + ",".join(f"{p:g}" for p in self.params)

    @property
    def max_value(self) -> int | None:
        """The largest draw possible (None: unbounded)."""
        if self.kind is LengthKind.FIXED:
            return round(self.params[0])
        if self.kind is LengthKind.UNIFORM:
            return round(self.params[1])
        return round(self.params[2]) if len(self.params) == 3 else None

    def sample(self, rng: random.Random) -> int:
        if self.kind is LengthKind.FIXED:
            return max(1, round(self.params[0]))
        if self.kind is LengthKind.UNIFORM:
            return rng.randint(round(self.params[0]), round(self.params[1]))
        mean, sigma = self.params[:2]
        value = rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)
        cap = self.params[2] if len(self.params) == 3 else math.inf
        return max(1, round(min(value, cap)))
