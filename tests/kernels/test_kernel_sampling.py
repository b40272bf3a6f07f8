"""Sampling: hand-made exact cases (reference and kernel), the kernel's filtered distribution
against the reference's, sampled tokens against the reference on the same uniforms, and a
stratified distribution check."""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels.sampling import filter_probs, filter_probs_ref, sample, sample_ref

IMPLS = {"ref": filter_probs_ref, "triton": filter_probs}
LOGITS = [0.1, 2.3, 0.4, 1.2, -0.5, 4.0, 3.1, 0.0, 1.1, -1.0]


def _params(n, device, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    return (torch.full((n,), temperature, device=device), torch.full((n,), top_k, dtype=torch.int64, device=device),
            torch.full((n,), top_p, device=device), torch.full((n,), min_p, device=device))


def _kept(probs: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs[0] > 0).flatten().tolist())


@pytest.mark.parametrize("impl", IMPLS)
def test_top_p_keeps_smallest_prefix_reaching_p(impl, device):
    # softmax: 5 -> .559, 6 -> .227 (mass before 1: .786 < .8), 1 -> .102 (mass before 3: .888)
    probs = IMPLS[impl](torch.tensor([LOGITS], device=device), *_params(1, device, top_p=0.8))
    assert _kept(probs) == {5, 6, 1}
    torch.testing.assert_close(probs.sum(), torch.tensor(1.0, device=device))


@pytest.mark.parametrize("impl", IMPLS)
def test_top_k_keeps_k(impl, device):
    probs = IMPLS[impl](torch.tensor([LOGITS], device=device), *_params(1, device, top_k=3))
    assert _kept(probs) == {5, 6, 1}


@pytest.mark.parametrize("impl", IMPLS)
def test_min_p_drops_below_fraction_of_max(impl, device):
    # p_i / p_max = exp(x_i - 4.0): token 1 is e^-1.7 = .18 >= .1, token 3 is e^-2.8 = .06 < .1
    probs = IMPLS[impl](torch.tensor([LOGITS], device=device), *_params(1, device, min_p=0.1))
    assert _kept(probs) == {5, 6, 1}


@pytest.mark.parametrize("impl", IMPLS)
def test_temperature_half_doubles_log_prob_gaps(impl, device):
    logits = torch.tensor([LOGITS], device=device)
    base = IMPLS[impl](logits, *_params(1, device)).double().log()
    cold = IMPLS[impl](logits, *_params(1, device, temperature=0.5)).double().log()
    torch.testing.assert_close(cold - cold[0, 5], 2 * (base - base[0, 5]), atol=1e-4, rtol=1e-4)  # fp32 softmax


@pytest.mark.parametrize("impl", IMPLS)
def test_temperature_zero_is_one_hot_argmax(impl, device):
    probs = IMPLS[impl](torch.tensor([LOGITS], device=device), *_params(1, device, temperature=0.0, top_k=2))
    assert probs[0].tolist() == [1.0 if i == 5 else 0.0 for i in range(10)]


def test_top_p_one_is_off_even_for_long_tails(device):
    # A float32 cumsum over 32k probabilities reaches 1.0 before the tail ends; top_p = 1 must
    # still keep every token (the reference used to drop ~1-2k of them here).
    logits = 3 * torch.randn(2, 32000, generator=torch.Generator().manual_seed(0))
    probs = filter_probs_ref(logits.to(device), *_params(2, device))
    assert bool((probs > 0).all())


def _random_case(num_rows: int, vocab: int, device: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    # continuous random logits: no ties, so top-k's threshold keeps exactly k (see sampling.py)
    logits = 2 * torch.randn(num_rows, vocab, generator=gen)
    temperature = torch.tensor([1.0, 0.0, 0.7, 1.3, 1.0, 0.5, 2.0, 1.0])[:num_rows]
    top_k = torch.tensor([0, 3, 5, 0, 10, 3, 0, vocab + 5])[:num_rows]
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.73, 0.9, 0.55, 0.37, 0.0])[:num_rows]
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.05, 0.1, 0.02, 0.0])[:num_rows]
    return [t.to(device) for t in (logits, temperature, top_k, top_p, min_p)]


@pytest.mark.parametrize("vocab", [10, 300, 2500])  # 2500: three 1024-wide tiles, partial last
def test_filter_probs_kernel_matches_ref(vocab, device):
    args = _random_case(8, vocab, device, seed=vocab)
    probs, expected = filter_probs(*args), filter_probs_ref(*args)
    # Same kept set exactly (thresholds are exact logit values; the random top_p/min_p values
    # are nowhere near a cumulative-mass boundary of these seeded rows), and probabilities
    # equal up to fp32 summation order in the normalisers.
    assert torch.equal(probs > 0, expected > 0)
    torch.testing.assert_close(probs, expected, atol=1e-6, rtol=1e-5)


def _safe_uniforms(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One uniform per row, at least 1e-3 of mass away from every CDF boundary.

    The kernel sums the CDF in fp32 in its own order, the reference in fp64: a uniform within
    rounding (~1e-6) of a boundary may legitimately pick the neighbouring token, so the test
    draws away from boundaries instead of loosening the comparison.
    """
    cdf = probs.double().cumsum(-1) / probs.double().sum(-1, keepdim=True)
    out = []
    for row in cdf.cpu():
        while True:
            u = float(torch.rand((), generator=gen, dtype=torch.float64))
            if bool(((row - u).abs() > 1e-3).all()):
                out.append(u)
                break
    return torch.tensor(out, dtype=torch.float32)


@pytest.mark.parametrize("vocab", [10, 1100])  # 1100: the CDF carries across two tiles
def test_sample_kernel_matches_ref_on_same_uniforms(vocab, device):
    args = _random_case(8, vocab, device, seed=vocab + 1)
    gen = torch.Generator().manual_seed(7)
    probs = filter_probs_ref(*args)
    for _ in range(2):
        uniforms = _safe_uniforms(probs, gen).to(device)
        assert torch.equal(sample(*args, uniforms), sample_ref(*args, uniforms))


def test_sample_stratified_counts_match_probabilities(device):
    # N stratified uniforms (i + 0.5) / N through an exact inverse CDF give each token
    # N * p rounded either way: a distribution test with no sampling noise at all.
    # (top-k/top-p are off here: their threshold searches cost ~30 interpreted passes per row;
    # the hand-made and matching tests cover them)
    n = 100
    logits = torch.tensor([LOGITS] * n, device=device)
    params = _params(n, device, temperature=0.8, min_p=0.01)
    uniforms = ((torch.arange(n) + 0.5) / n).to(device)
    counts = torch.bincount(sample(logits, *params, uniforms), minlength=10).double()
    expected = n * filter_probs_ref(logits[:1], *(p[:1] for p in params))[0].double()
    assert bool(((counts - expected).abs() <= 1.0).all()), (counts, expected)


def test_sample_greedy_ignores_uniforms(device):
    logits = torch.tensor([LOGITS] * 3, device=device)
    ids = sample(logits, *_params(3, device, temperature=0.0), torch.tensor([0.0, 0.5, 0.999], device=device))
    assert ids.tolist() == [5, 5, 5]


def test_sample_is_deterministic(device):
    args = _random_case(4, 300, device, seed=3)
    uniforms = torch.rand(4, generator=torch.Generator().manual_seed(1)).to(device)
    assert torch.equal(sample(*args, uniforms), sample(*args, uniforms))
