"""Sampling filters (temperature, top-k, top-p, min-p) and sampling from explicit noise.

Sampling is one path: filter, then draw by the exponential race, argmax_v p(v) / E(v) with
E(v) i.i.d. Exp(1) (the Gumbel-max trick: log p(v) - log E(v) is log p plus Gumbel noise), which
picks v with probability exactly p(v). The random draws are inputs (a row of exponentials per
sampled row; a uniform per row for `sample_from_probs_ref`, the inverse CDF the rejection
sampler uses for its residual draws), so a kernel and its reference consume the same randomness
and can be compared exactly; where the draws come from (seed and position) is the engine's
business. Filters apply in the order temperature → top-k → top-p → min-p.
Per-row parameter conventions: temperature 0 = greedy (one-hot argmax), top_k 0 = off,
top_p 1 = off, min_p 0 = off.
"""
from __future__ import annotations

import numpy as np
import torch

from pdserve.kernels._triton import tl, triton


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(-1)`, the first index of each row's largest value (a NaN counts as largest), as
    int64 on x's device. On the CPU through numpy: torch's CPU argmax over the last dimension took
    28 µs for 5 rows of a 4096-token vocabulary (a batch-1 verification), 184 µs for 32 rows and
    960 µs for 160, where numpy's took 2, 8.5 and 80 (one thread, Intel Xeon; scratch timing),
    and every CPU step picks its tokens through it. Inside a compiled graph, on another device or
    for a dtype numpy lacks, torch's own."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64) or torch.compiler.is_compiling():
        return x.argmax(-1)
    return torch.from_numpy(np.asarray(x.detach().numpy().argmax(-1), dtype=np.int64))


def _top_k_top_p_mask(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """True where a token is removed. logits: [num_rows, vocab_size] float32."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    drop_sorted = rank >= k[:, None]
    probs = sorted_logits.masked_fill(drop_sorted, float("-inf")).softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    # keep the smallest prefix whose mass reaches p; the top token always stays. top_p >= 1 is
    # off outright: a float32 cumsum reaches 1.0 before the tail ends and would drop tail tokens
    is_top_p = (top_p < 1)[:, None]
    drop_sorted |= (mass_before >= top_p[:, None]) & (rank > 0) & is_top_p
    return torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)


def filter_probs_ref(
    logits: torch.Tensor,  # [num_rows, vocab_size]
    temperature: torch.Tensor,  # [num_rows] float
    top_k: torch.Tensor,  # [num_rows] int
    top_p: torch.Tensor,  # [num_rows] float
    min_p: torch.Tensor,  # [num_rows] float
) -> torch.Tensor:  # [num_rows, vocab_size] float32, rows sum to 1
    """The distribution a request samples from, after its own sampling parameters."""
    logits = logits.float()
    is_greedy = temperature <= 0
    scaled = logits / torch.where(is_greedy, 1.0, temperature.float())[:, None]
    # the mask sorts the whole vocabulary per row; most requests use neither filter, so skip it
    # then (one host sync, cheap on the CPU where this reference is the production path)
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        scaled = scaled.masked_fill(_top_k_top_p_mask(scaled, top_k, top_p), float("-inf"))
    probs = scaled.softmax(-1)
    if bool((min_p > 0).any()):  # likewise min-p, and greedy rows below
        below_min = probs < (min_p.float() * probs.max(-1).values)[:, None]
        probs = probs.masked_fill(below_min, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    if not bool(is_greedy.any()):
        return probs
    greedy = torch.zeros_like(probs).scatter(-1, argmax_rows(logits)[:, None], 1.0)
    return torch.where(is_greedy[:, None], greedy, probs)


def sample_from_probs_ref(
    probs: torch.Tensor,  # [num_rows, vocab_size] float32, rows sum to ~1
    uniforms: torch.Tensor,  # [num_rows] float in [0, 1)
) -> torch.Tensor:  # [num_rows] int64
    """Inverse-CDF sampling in token-id order: the first id whose cumulative mass exceeds u.

    Zero-probability ids are never chosen, whatever u is.
    """
    cdf = probs.double().cumsum(-1)
    target = uniforms.double() * cdf[:, -1]
    ids = torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1)
    return ids.clamp(max=probs.shape[-1] - 1)


def race_ref(
    probs: torch.Tensor,  # [num_rows, vocab_size] float32, rows sum to ~1
    exponentials: torch.Tensor,  # [num_rows, vocab_size] float32, i.i.d. Exp(1)
) -> torch.Tensor:  # [num_rows] int64
    """The exponential race: the first id with the largest p / E. A zero-probability id never
    wins (0 / E = 0 < p / E of any id with p > 0)."""
    return argmax_rows(probs / exponentials)


def sample_ref(
    logits: torch.Tensor,  # [num_rows, vocab_size]
    temperature: torch.Tensor,  # [num_rows]
    top_k: torch.Tensor,  # [num_rows]
    top_p: torch.Tensor,  # [num_rows]
    min_p: torch.Tensor,  # [num_rows]
    exponentials: torch.Tensor,  # [num_rows, vocab_size]
) -> torch.Tensor:  # [num_rows] int64
    """Filter, then race. A greedy row's filtered distribution is one-hot: its argmax wins."""
    return race_ref(filter_probs_ref(logits, temperature, top_k, top_p, min_p), exponentials)


# --- Triton ------------------------------------------------------------------------------
#
# One program per row, streaming the vocabulary in BLOCK_V tiles; no sort. Each filter is a
# threshold on the scaled logit, found by binary search over the float32 bit pattern mapped
# to an order-preserving integer key, so thresholds are exact logit values:
#
#   top-k: the largest key t with count(key >= t) >= k          (the k-th largest logit)
#   top-p: the smallest key t with mass(key > t) < top_p        (mass over the top-k set)
#   min-p: p >= min_p * p_max, i.e. the reference's test applied per token
#
# Each search costs ~32 passes over the row. Ties at a top-k threshold keep every tied token
# (the reference's sort keeps an arbitrary k of them); tests avoid ties. Sampling then races
# the filtered distribution against the row's exponentials: the first id with the largest
# p / E, the reference's argmax.


@triton.jit
def float_key(x):
    """Order-preserving int64 key of float32 values (negative floats: flip the magnitude bits)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)


@triton.jit
def sample_kernel(
    logits_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, exponentials_ptr, probs_ptr, token_ids_ptr,
    vocab_size, logits_row_stride, probs_row_stride, exponentials_row_stride,
    WRITE_PROBS: tl.constexpr, SAMPLE: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * logits_row_stride
    temperature = tl.load(temperature_ptr + row).to(tl.float32)
    is_greedy = temperature <= 0
    is_sampling = temperature > 0
    divisor = tl.where(is_greedy, 1.0, temperature)  # the same division as the reference: exact
    top_k = tl.load(top_k_ptr + row).to(tl.int64)
    top_p = tl.load(top_p_ptr + row).to(tl.float32)
    min_p = tl.load(min_p_ptr + row).to(tl.float32)
    offs = tl.arange(0, BLOCK_V)

    # pass: max and (first) argmax of the scaled logits
    m = tl.full([], float("-inf"), tl.float32)
    best = tl.full([], 0, tl.int64)
    for v0 in range(0, vocab_size, BLOCK_V):
        x = tl.load(logits_row + v0 + offs, mask=v0 + offs < vocab_size, other=float("-inf")).to(tl.float32) / divisor
        tile_max = tl.max(x, 0)
        best = tl.where(tile_max > m, v0 + tl.argmax(x, 0).to(tl.int64), best)
        m = tl.maximum(m, tile_max)
    key_max = float_key(m)
    no_key = tl.full([], -2147483649, tl.int64)  # below every key: "keep everything"

    # top-k: invariant count(key >= lo) >= k > count(key >= hi); skipped when off or greedy
    is_top_k = (top_k > 0) & (top_k < vocab_size) & is_sampling
    lo = no_key
    hi = tl.where(is_top_k, key_max + 1, no_key + 1)
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        count = tl.zeros([], tl.int64)
        for v0 in range(0, vocab_size, BLOCK_V):
            is_in = v0 + offs < vocab_size
            x = tl.load(logits_row + v0 + offs, mask=is_in, other=0.0).to(tl.float32) / divisor
            count += tl.sum((is_in & (float_key(x) >= mid)).to(tl.int64), 0)
        lo = tl.where(count >= top_k, mid, lo)
        hi = tl.where(count >= top_k, hi, mid)
    threshold = lo

    # top-p over the top-k set: invariant mass(key > lo) >= top_p > mass(key > hi)
    total_k = _masked_exp_sum(logits_row, divisor, m, threshold, vocab_size, BLOCK_V)
    is_top_p = (top_p < 1) & is_sampling
    lo = threshold - 1
    hi = tl.where(is_top_p, key_max, threshold)
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        mass = tl.zeros([], tl.float32)
        for v0 in range(0, vocab_size, BLOCK_V):
            is_in = v0 + offs < vocab_size
            x = tl.load(logits_row + v0 + offs, mask=is_in, other=float("-inf")).to(tl.float32) / divisor
            key = float_key(x)
            mass += tl.sum(tl.where(is_in & (key > mid) & (key >= threshold), tl.exp(x - m), 0.0), 0)
        is_inside = mass / total_k < top_p
        lo = tl.where(is_inside, lo, mid)
        hi = tl.where(is_inside, mid, hi)
    threshold = hi

    # min-p on the top-k/top-p distribution, then the normaliser of what is left
    total = _masked_exp_sum(logits_row, divisor, m, threshold, vocab_size, BLOCK_V)
    min_prob = min_p * (1.0 / total)  # p_max = exp(0) / total
    kept_total = tl.zeros([], tl.float32)
    for v0 in range(0, vocab_size, BLOCK_V):
        p = _filtered_probs(logits_row, v0 + offs, vocab_size, divisor, m, threshold, total, min_prob)
        kept_total += tl.sum(p, 0)

    # final pass: write the distribution, or race it against the row's exponentials
    best_score = tl.full([], -1.0, tl.float32)
    chosen = tl.full([], 0, tl.int64)
    for v0 in range(0, vocab_size, BLOCK_V):
        ids = v0 + offs
        p = _filtered_probs(logits_row, ids, vocab_size, divisor, m, threshold, total, min_prob) / kept_total
        if WRITE_PROBS:
            p_out = tl.where(is_greedy, tl.where(ids == best, 1.0, 0.0), p)
            tl.store(probs_ptr + row * probs_row_stride + ids, p_out, mask=ids < vocab_size)
        if SAMPLE:
            e = tl.load(exponentials_ptr + row * exponentials_row_stride + ids, mask=ids < vocab_size, other=1.0)
            score = tl.where(p > 0, p / e, -1.0)
            tile_best = tl.max(score, 0)
            tile_arg = v0 + tl.argmax(score, 0).to(tl.int64)  # first of equals, like torch.argmax
            chosen = tl.where(tile_best > best_score, tile_arg, chosen)
            best_score = tl.maximum(best_score, tile_best)
    if SAMPLE:
        tl.store(token_ids_ptr + row, tl.where(is_greedy, best, chosen))


@triton.jit
def _masked_exp_sum(logits_row, divisor, m, threshold, vocab_size, BLOCK_V: tl.constexpr):
    """sum of exp(x - m) over tokens with key(x) >= threshold."""
    offs = tl.arange(0, BLOCK_V)
    total = tl.zeros([], tl.float32)
    for v0 in range(0, vocab_size, BLOCK_V):
        is_in = v0 + offs < vocab_size
        x = tl.load(logits_row + v0 + offs, mask=is_in, other=float("-inf")).to(tl.float32) / divisor
        total += tl.sum(tl.where(is_in & (float_key(x) >= threshold), tl.exp(x - m), 0.0), 0)
    return total


@triton.jit
def _filtered_probs(logits_row, ids, vocab_size, divisor, m, threshold, total, min_prob):
    """Probabilities after top-k/top-p (key >= threshold) and min-p, before renormalising."""
    is_in = ids < vocab_size
    x = tl.load(logits_row + ids, mask=is_in, other=float("-inf")).to(tl.float32) / divisor
    p = tl.where(is_in & (float_key(x) >= threshold), tl.exp(x - m) / total, 0.0)
    return tl.where(p < min_prob, 0.0, p)


def _launch_sample(logits, temperature, top_k, top_p, min_p, exponentials, write_probs: bool):
    num_rows, vocab_size = logits.shape
    assert logits.dim() == 2 and logits.stride(1) == 1, f"logits must be [num_rows, vocab] with contiguous rows, got {logits.stride()}"
    for name, t in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("min_p", min_p)):
        assert t.shape == (num_rows,), f"{name} must be [{num_rows}], got {tuple(t.shape)}"
    assert not top_k.dtype.is_floating_point, f"top_k must be integers, got {top_k.dtype}"
    probs = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=logits.device) if write_probs else None
    token_ids = None if write_probs else torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if exponentials is not None:
        assert exponentials.shape == (num_rows, vocab_size) and exponentials.stride(1) == 1, \
            f"exponentials must be [{num_rows}, {vocab_size}] with contiguous rows, got {tuple(exponentials.shape)}"
    if num_rows > 0:
        out = probs if probs is not None else token_ids
        noise = exponentials if exponentials is not None else logits  # unread when writing probs
        sample_kernel[(num_rows,)](
            logits, temperature, top_k, top_p, min_p, noise, out, out,
            vocab_size, logits.stride(0), probs.stride(0) if probs is not None else 0, noise.stride(0),
            WRITE_PROBS=write_probs, SAMPLE=not write_probs,
            BLOCK_V=min(1024, triton.next_power_of_2(vocab_size)),
        )
    return probs if write_probs else token_ids


def filter_probs(
    logits: torch.Tensor,  # [num_rows, vocab_size]
    temperature: torch.Tensor,  # [num_rows] float
    top_k: torch.Tensor,  # [num_rows] int
    top_p: torch.Tensor,  # [num_rows] float
    min_p: torch.Tensor,  # [num_rows] float
) -> torch.Tensor:  # [num_rows, vocab_size] float32, rows sum to 1
    """Triton `filter_probs_ref`."""
    return _launch_sample(logits, temperature, top_k, top_p, min_p, None, write_probs=True)


def sample(
    logits: torch.Tensor,  # [num_rows, vocab_size]
    temperature: torch.Tensor,  # [num_rows]
    top_k: torch.Tensor,  # [num_rows]
    top_p: torch.Tensor,  # [num_rows]
    min_p: torch.Tensor,  # [num_rows]
    exponentials: torch.Tensor,  # [num_rows, vocab_size]
) -> torch.Tensor:  # [num_rows] int64
    """Triton `sample_ref`: filter and race in one kernel, never materialising the probs."""
    return _launch_sample(logits, temperature, top_k, top_p, min_p, exponentials, write_probs=False)
