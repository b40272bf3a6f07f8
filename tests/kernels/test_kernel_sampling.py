"""Sampling: hand-made exact cases (reference and kernel), the kernel's filtered distribution
against the reference's, sampled tokens against the reference on the same noise, and the
race's distribution against the exact filtered probabilities."""
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


def _safe_exponentials(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Exp(1) noise per row whose race winner leads the runner-up by at least 1e-3 relative.

    The kernel normalises in fp32 in its own order: a race within rounding (~1e-6) of a tie may
    legitimately go the other way, so the test draws away from ties instead of loosening the
    comparison.
    """
    rows = []
    for row in probs.double().cpu():
        while True:
            e = -torch.rand(row.shape, generator=gen, dtype=torch.float64).log()
            top = (row / e).topk(2).values
            if top[1] < top[0] * (1 - 1e-3):
                rows.append(e)
                break
    return torch.stack(rows).float()


@pytest.mark.parametrize("vocab", [10, 1100])  # 1100: the race carries across two tiles
def test_sample_kernel_matches_ref_on_same_noise(vocab, device):
    args = _random_case(8, vocab, device, seed=vocab + 1)
    gen = torch.Generator().manual_seed(7)
    probs = filter_probs_ref(*args)
    for _ in range(2):
        noise = _safe_exponentials(probs, gen).to(device)
        assert torch.equal(sample(*args, noise), sample_ref(*args, noise))


@pytest.mark.parametrize("impl", [sample_ref, sample], ids=["ref", "triton"])
def test_race_picks_what_the_noise_dictates(impl, device):
    # softmax of LOGITS: token 5 has p = .559, token 9 p = .004. With equal noise the most
    # likely token wins; make token 9's exponential 1000x smaller and it wins (p / E = 4 > .559)
    logits = torch.tensor([LOGITS] * 2, device=device)
    noise = torch.ones(2, 10)
    noise[1, 9] = 1e-3
    assert impl(logits, *_params(2, device), noise.to(device)).tolist() == [5, 9]
    # a filtered-out token never wins, however small its noise: top-k 3 keeps {5, 6, 1}
    assert impl(logits, *_params(2, device, top_k=3), noise.to(device)).tolist() == [5, 5]


def test_race_is_distributed_as_the_filtered_probabilities():
    """The exponential race against exact probabilities: a chi-square test over many rows
    of fresh noise (the kernel equals the reference on the same noise, above)."""
    from scipy import stats

    n = 20000
    logits = torch.tensor([LOGITS] * n)
    params = _params(n, "cpu", temperature=0.8, min_p=0.01)
    noise = -torch.rand(n, 10, generator=torch.Generator().manual_seed(3)).log()
    counts = torch.bincount(sample_ref(logits, *params, noise), minlength=10).double()
    expected = n * filter_probs_ref(logits[:1], *(p[:1] for p in params))[0].double()
    kept = expected > 0
    assert counts[~kept].sum() == 0
    expected = expected[kept] / expected[kept].sum() * n  # the exact sum scipy insists on
    assert stats.chisquare(counts[kept].numpy(), expected.numpy()).pvalue > 1e-3


def test_sample_greedy_ignores_noise(device):
    logits = torch.tensor([LOGITS] * 3, device=device)
    noise = torch.tensor([[1.0] * 10, [5.0] * 5 + [1e-6] * 5, [1e-6] * 5 + [5.0] * 5], device=device)
    ids = sample(logits, *_params(3, device, temperature=0.0), noise)
    assert ids.tolist() == [5, 5, 5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_argmax_rows_is_torchs_argmax(dtype):
    """The CPU's numpy path picks what torch's argmax picks: the first of tied maxima, a NaN over
    any number, on views, one row or many, under inference mode; other dtypes go through torch."""
    from pdserve.kernels import argmax_rows

    x = torch.randn(33, 4096, generator=torch.Generator().manual_seed(0)).to(dtype)
    x[3, [7, 900]] = 50.0  # a tie: the first wins
    x[4, [10, 11]] = float("nan")
    x[5, :] = -float("inf")
    cases = [x, x[:, 1000:3000], x[::2], x[6], x.t().contiguous().t()]
    with torch.inference_mode():
        cases.append(x.clone())
    for case in cases:
        got = argmax_rows(case)
        assert got.dtype == torch.int64 and torch.equal(got, case.argmax(-1))
    assert argmax_rows(x)[[3, 4, 5]].tolist() == [7, 10, 0]
