"""Reproducible randomness: every draw is a pure function of (request seed, token position,
stream), so a request samples the same tokens in any batch, on any worker, after preemption
or failover. `stream` separates independent draws at one position (e.g. the speculative
acceptance test and the residual sample)."""
from __future__ import annotations

import torch

_MASK = (1 << 64) - 1

SAMPLE_STREAM = 0
ACCEPT_STREAM = 1
RESIDUAL_STREAM = 2
DRAFT_STREAM = 3


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def uniform(seed: int, position: int, stream: int = SAMPLE_STREAM) -> float:
    """A uniform in [0, 1) with 53 random bits."""
    x = _splitmix64(_splitmix64(seed & _MASK) ^ ((position << 4) | stream))
    return (x >> 11) * (1.0 / (1 << 53))


def uniforms(seeds: list[int], positions: list[int], stream: int = SAMPLE_STREAM) -> torch.Tensor:
    """[len(seeds)] float64."""
    return torch.tensor([uniform(s, p, stream) for s, p in zip(seeds, positions)], dtype=torch.float64)
