"""Sampling: exact filter cases, seeded determinism whatever shares the batch, and the sampled
distribution against the exact processed one."""
from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from pdserve.engine import LLM, SamplingParams
from pdserve.engine import rng
from pdserve.engine.sampler import Sampler, param_tensors
from pdserve.kernels import TORCH_OPS

LOGITS = torch.tensor([[0.1, 2.3, 0.4, 1.2, -0.5, 4.0, 3.1, 0.0, 1.1, -1.0]])


def probs(params: SamplingParams, logits=LOGITS) -> torch.Tensor:
    return TORCH_OPS.filter_probs(logits, *param_tensors([params] * len(logits), logits.device))


def test_top_p_keeps_smallest_set_reaching_p():
    kept = set(probs(SamplingParams(top_p=0.8))[0].nonzero().flatten().tolist())
    assert kept == {5, 6, 1}


def test_top_k_keeps_k():
    p = probs(SamplingParams(top_k=3))[0]
    assert set(p.nonzero().flatten().tolist()) == {5, 6, 1}
    assert math.isclose(float(p.sum()), 1.0, rel_tol=1e-6)


def test_temperature_half_doubles_logit_gaps():
    logp = probs(SamplingParams(temperature=0.5))[0].log()
    gaps = logp - logp[5]
    torch.testing.assert_close(gaps, 2 * (LOGITS[0] - LOGITS[0, 5]), rtol=1e-4, atol=1e-4)


def test_min_p_drops_tokens_below_share_of_max():
    p = probs(SamplingParams(min_p=0.3))[0]  # p(6)/p(5) = e^-0.9 = 0.41 stays, p(1)/p(5) = 0.18 goes
    assert set(p.nonzero().flatten().tolist()) == {5, 6}


def test_greedy_is_argmax_whatever_the_draw():
    s = Sampler(TORCH_OPS, torch.device("cpu"))
    greedy = SamplingParams(temperature=0)
    toks = s.sample(LOGITS.repeat(50, 1), [greedy] * 50, list(range(50)), [3] * 50)
    assert set(toks) == {5}


def test_all_greedy_fast_path_matches_the_general_sample():
    torch.manual_seed(1)
    logits = torch.randn(64, 300)
    greedy = [SamplingParams(temperature=0)] * 64
    noise = rng.exponentials(list(range(64)), [9] * 64, 300)
    general = TORCH_OPS.sample(logits, *param_tensors(greedy, logits.device), noise).tolist()
    assert Sampler(TORCH_OPS, torch.device("cpu")).sample(logits, greedy, list(range(64)), [9] * 64) == general


def test_same_seed_and_position_same_token_in_any_batch():
    s = Sampler(TORCH_OPS, torch.device("cpu"))
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    p = SamplingParams(temperature=1.0, top_p=0.9)
    alone = [s.sample(logits[i:i + 1], [p], [1000 + i], [7 + i])[0] for i in range(6)]
    order = [3, 0, 5, 1, 4, 2]
    mixed = s.sample(logits[order], [p] * 6, [1000 + i for i in order], [7 + i for i in order])
    assert mixed == [alone[i] for i in order]


def test_seeded_request_same_tokens_alone_or_in_a_batch(checkpoint):
    llm = LLM(checkpoint("llama"))
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], params)[0].token_ids
    others = SamplingParams(temperature=0.7, seed=9, max_tokens=10, ignore_eos=True)
    batch = llm.generate([[1, 2, 3, 4, 5, 6, 7, 8, 9], [5, 6, 7], [40] * 30], [others, params, others])
    assert batch[1].token_ids == alone
    unseeded = llm.generate([[5, 6, 7]] * 2, SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True))
    assert unseeded[0].token_ids != unseeded[1].token_ids  # each unseeded request draws its own seed


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.05, top_k=6),
])
def test_sampled_distribution_matches_processed_distribution(params):
    n = 40000
    exact = probs(params)[0].double()
    noise = rng.exponentials(list(range(n)), [17] * n, 10)  # the engine's own noise, seeds 0..n-1
    toks = TORCH_OPS.sample(LOGITS.repeat(n, 1), *param_tensors([params] * n, LOGITS.device), noise)
    counts = torch.bincount(toks, minlength=10).double()
    kept = exact > 0
    assert counts[~kept].sum() == 0, "a filtered-out token was sampled"
    # chi-square goodness of fit over the kept tokens, at significance 1e-3
    expected = exact[kept] / exact[kept].sum() * counts.sum()
    _, pvalue = stats.chisquare(counts[kept].numpy(), expected.numpy())
    assert pvalue > 1e-3
    # total variation: P(TV >= eps) <= 2^k exp(-2 n eps^2) (Bretagnolle-Huber-Carol); delta = 1e-3
    k = int(kept.sum())
    eps = math.sqrt((k * math.log(2) + math.log(1e3)) / (2 * n))
    assert 0.5 * float((counts / n - exact).abs().sum()) < eps


def test_uniforms_are_uniform_and_stream_separated():
    u = rng.uniforms([7] * 20000, list(range(20000)))
    assert stats.kstest(u.numpy(), "uniform").pvalue > 1e-3
    assert rng.uniform(7, 3, rng.ACCEPT_STREAM) != rng.uniform(7, 3, rng.SAMPLE_STREAM)


def test_exponentials_are_exponential_independent_and_keyed():
    e = rng.exponentials(list(range(50)), [3] * 50, 4096)
    assert stats.kstest(e.flatten().double().numpy(), "expon").pvalue > 1e-3
    # neighbouring vocabulary entries and neighbouring rows (seeds, positions) uncorrelated
    pairs = [(e[:, :-1], e[:, 1:]), (e[:-1], e[1:])]
    by_position = rng.exponentials([7] * 50, list(range(50)), 4096)
    pairs.append((by_position[:-1], by_position[1:]))
    for a, b in pairs:
        assert abs(float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])) < 0.01
    # a pure function of (seed, position, stream), whatever else is in the call
    assert torch.equal(rng.exponentials([9, 7], [4, 5], 300)[1], rng.exponentials([7], [5], 300)[0])
    assert not torch.equal(rng.exponentials([7], [5], 300, rng.DRAFT_STREAM), rng.exponentials([7], [5], 300))


def test_logprobs_returned_when_asked(checkpoint):
    llm = LLM(checkpoint("llama"))
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == 4
    for tok, row in zip(out.token_ids, out.logprobs):
        assert row[0][0] == tok and len(row) == 4
        assert row[0][1] == pytest.approx(row[1][1])  # greedy: the sampled token is the top one


@pytest.mark.gpu
def test_two_builds_in_one_step_keep_their_own_values_on_cuda():
    """A verification builds sampling tensors twice before anything waits for the stream: the
    second build must not overwrite the pinned host buffers while the first one's copies are
    still queued (behind a long product here, so they are)."""
    from pdserve.engine.sampler import SamplingTensors

    tensors = SamplingTensors(torch.device("cuda"))
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        a = a @ a / 64  # keeps the stream busy for a while
    first = tensors.build([SamplingParams(temperature=0.5, top_k=7)] * 3)
    second = tensors.build([SamplingParams(temperature=1.5, top_k=9)] * 3)
    torch.cuda.synchronize()
    assert first[0].tolist() == [0.5] * 3 and first[1].tolist() == [7] * 3
    assert second[0].tolist() == [1.5] * 3 and second[1].tolist() == [9] * 3
