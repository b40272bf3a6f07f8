"""Reproducible randomness: every draw is a pure function of (request seed, token position,
stream), so a request samples the same tokens in any batch, on any worker, after preemption
or failover. `stream` separates independent draws at one position (e.g. the speculative
acceptance test and the residual sample).

Two kinds of draws:

- `uniform(s)`: one uniform per (seed, position, stream), for the rejection sampler's
  acceptance tests.
- `exponentials`: a whole row of i.i.d. Exp(1) variables per (seed, position, stream), one per
  vocabulary entry, for sampling by the exponential race: argmax_v p(v) / E(v) is distributed
  exactly as p (it is the Gumbel-max trick, log p(v) - log E(v) with -log E a Gumbel). Every
  sampled token (plain sampling, a draft's samples, the coupled verifier) is drawn this way, so
  the same noise gives the same token wherever it is drawn. The row is an integer hash of
  (row key, vocabulary index) in 32-bit integer tensor arithmetic, identical on every device.
"""
from __future__ import annotations

from typing import Callable

import torch

_MASK = (1 << 64) - 1
_M32 = (1 << 32) - 1

SAMPLE_STREAM = 0
ACCEPT_STREAM = 1
RESIDUAL_STREAM = 2
DRAFT_STREAM = 3


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def row_key(seed: int, position: int, stream: int = SAMPLE_STREAM) -> int:
    """64 random bits for (seed, position, stream)."""
    return _splitmix64(_splitmix64(seed & _MASK) ^ ((position << 4) | stream))


def uniform(seed: int, position: int, stream: int = SAMPLE_STREAM) -> float:
    """A uniform in [0, 1) with 53 random bits."""
    return (row_key(seed, position, stream) >> 11) * (1.0 / (1 << 53))


def uniforms(seeds: list[int], positions: list[int], stream: int = SAMPLE_STREAM) -> torch.Tensor:
    """[len(seeds)] float64."""
    return torch.tensor([uniform(s, p, stream) for s, p in zip(seeds, positions)], dtype=torch.float64)


def exponentials(
    seeds: list[int], positions: list[int], vocab_size: int, stream: int | list[int] = SAMPLE_STREAM,
    device: torch.device | str = "cpu", hash_fn: Callable | None = None,
) -> torch.Tensor:  # [len(seeds), vocab_size] float32, i.i.d. Exp(1)
    """Row i: Exp(1) noise for the token at positions[i] of the request seeded seeds[i] (in
    stream[i] when given a list). hash_fn: `hash_uniforms`, a compiled copy of it, or the native
    hash (`NativeHash`, `kernels/cpu/noise.cpp`, which makes the rows' keys too): the same bits,
    integer arithmetic and one exact scaling; the logarithm stays torch's own, whose last bit a
    compiler's vectorised log does not always reproduce."""
    streams = stream if isinstance(stream, list) else [stream] * len(seeds)
    if isinstance(hash_fn, NativeHash):  # the keys made natively too
        rows = torch.tensor([[_int64(s & _MASK), p, st] for s, p, st in zip(seeds, positions, streams)],
                            dtype=torch.int64)
        return hash_fn.rows(rows.view(-1, 3), _vocab_codes(vocab_size, "cpu")).log_().neg_()
    keys = [row_key(s, p, st) for s, p, st in zip(seeds, positions, streams)]
    k = torch.tensor([[_int32(key & _M32), _int32(key >> 32)] for key in keys], dtype=torch.int32, device=device)
    return (hash_fn or hash_uniforms)(k, _vocab_codes(vocab_size, device)).log_().neg_()


class NativeHash:
    """The native hash (`kernels/cpu/noise.cpp`, CPU only) as `exponentials`' hash_fn: called
    with (keys, codes) it is `pdserve::hash_uniforms`; `exponentials` calls its `rows` instead,
    `pdserve::hash_rows`, which makes each row's key from (seed, position, stream) too, as
    `row_key` does. At 40 rows of the demo's 4096 entries, the keys made in Python and the tensor
    built from them took 45 µs of the 165 the noise took (scratch timing, Intel Xeon)."""

    def __init__(self) -> None:
        self.keys, self.rows = torch.ops.pdserve.hash_uniforms, torch.ops.pdserve.hash_rows

    def __call__(self, keys: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        return self.keys(keys, codes)


def seed_words(seeds: list[int]) -> torch.Tensor:
    """[len(seeds)] int64: each seed's 64 bits, as the native ops take a seed (`NativeHash`'s rows,
    the rejection sampler's rule)."""
    return torch.tensor([_int64(s & _MASK) for s in seeds], dtype=torch.int64)


def vocab_codes(vocab_size: int) -> torch.Tensor:
    """[vocab_size] int32 on the CPU: the codes the hash mixes with a row's key, for native ops that
    hash rows themselves."""
    return _vocab_codes(vocab_size, "cpu")


def hash_uniforms(
    keys: torch.Tensor,  # [rows, 2] int32: each row's 64-bit key as two halves
    codes: torch.Tensor,  # [vocab_size] int32: `_vocab_codes`
) -> torch.Tensor:  # [rows, vocab_size] float32, 24 random bits each, in (0, 1)
    """The hash itself, a pure tensor function (so it can be compiled into one loop)."""
    x = codes[None, :] ^ keys[:, :1]
    x = _mix32_(x)
    x ^= keys[:, 1:]
    x = _mix32_(x)
    return ((x >> 8) & 0xFFFFFF).float().add_(0.5).mul_(1.0 / (1 << 24))


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit xorshift-multiply finaliser (Wellons' lowbias32), in place on int32 tensors:
    multiplication wraps modulo 2^32, and the masks make the arithmetic shifts logical."""
    x ^= (x >> 16) & 0xFFFF
    x *= _int32(0x7FEB352D)
    x ^= (x >> 15) & 0x1FFFF
    x *= _int32(0x846CA68B)
    x ^= (x >> 16) & 0xFFFF
    return x


def _int64(u: int) -> int:
    """The int64 with the bits of the unsigned 64-bit u."""
    return u - (1 << 64) if u >= (1 << 63) else u


def _int32(u: int) -> int:
    """The int32 with the bits of the unsigned 32-bit u."""
    return u - (1 << 32) if u >= (1 << 31) else u


_CODES: dict[tuple[int, str], torch.Tensor] = {}


def _vocab_codes(vocab_size: int, device) -> torch.Tensor:
    """Vocabulary indices spread over 32 bits (a golden-ratio multiple), cached per size."""
    key = (vocab_size, str(device))
    if key not in _CODES:
        codes = [_int32(v * 0x9E3779B1 & _M32) for v in range(vocab_size)]
        _CODES[key] = torch.tensor(codes, dtype=torch.int32, device=device)
    return _CODES[key]
