"""The verification rules by hand (`spec_decode/rejection_sampler.py`, `spec_decode/coupled.py`):
hand-made cases of the rejection sampler, its refusals of bad input, the greedy fast path, and the
batched rules against the readable per-sequence ones on the same draws."""
from __future__ import annotations

import itertools

import pytest
import torch

from pdserve.engine.spec_decode.coupled import emit_matching, verify_coupled_batch, verify_coupled_one
from pdserve.engine.spec_decode.rejection_sampler import verify_batch, verify_greedy, verify_one


def one_hot(*ids, v=4):
    t = torch.zeros(len(ids), v)
    t[torch.arange(len(ids)), torch.tensor(ids)] = 1
    return t


def flat_noise(k, v=4):
    """Equal exponentials everywhere: the race then picks the most likely token."""
    return torch.ones(k + 1, v)


def test_rejected_at_first_position_yields_residual_token():
    p = one_hot(2, 1, 1)  # target wants 2, then 1
    q = one_hot(3, 1)  # draft proposed 3 (p=0): rejected; residual max(0, p-q) is all on 2
    assert verify_one(p, q, [3, 1], [0.0, 0.0], flat_noise(2)) == [2]


def test_all_accepted_yields_bonus_from_last_row():
    p = torch.cat([one_hot(0, 1), torch.tensor([[0.1, 0.2, 0.3, 0.4]])])
    q = one_hot(0, 1)
    noise = flat_noise(2)
    noise[2] = torch.tensor([1.0, 1.0, 0.5, 1.0])  # p / E: .1 .2 .6 .4 -> 2
    assert verify_one(p, q, [0, 1], [0.99, 0.99], noise) == [0, 1, 2]


def test_draft_token_with_q_zero_is_accepted():
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.25] * 4])
    q = torch.tensor([[1.0, 0.0, 0.0, 0.0]])  # x = 1 has q = 0 < p
    noise = flat_noise(1)
    noise[1, 0] = 0.5  # the bonus row is uniform: the smaller exponential wins
    assert verify_one(p, q, [1], [0.999], noise) == [1, 0]


def test_acceptance_probability_is_min_one_p_over_q():
    p = torch.tensor([[0.3, 0.7], [0.5, 0.5]])
    q = torch.tensor([[0.6, 0.4]])  # x = 0: accept iff u < 0.5
    assert verify_one(p, q, [0], [0.49], flat_noise(1, 2))[0] == 0
    assert verify_one(p, q, [0], [0.51], flat_noise(1, 2)) == [1]  # residual max(0, p-q) = [0, .3]


def test_greedy_verify_matches_verify_one_on_one_hot_distributions():
    """The greedy fast path against the general sampler fed the one-hot p and q that greedy
    filtering produces, over every draft/argmax pattern of a small vocabulary, any draws."""
    v, k = 3, 3
    for argmax in itertools.product(range(v), repeat=k + 1):
        for drafts in itertools.product(range(v), repeat=k):
            expected = verify_one(one_hot(*argmax, v=v), one_hot(*drafts, v=v), list(drafts), [0.7] * k,
                                  torch.rand(k + 1, v) + 0.1)
            assert verify_greedy(list(argmax), list(drafts)) == expected, (argmax, drafts)
            picks = torch.tensor([argmax])  # the batched emit on argmax picks is the same rule
            assert emit_matching(picks, torch.tensor([drafts]), torch.tensor([k])) == [expected]


def test_greedy_verify_rejects_wrong_lengths():
    with pytest.raises(ValueError, match="need 3 target argmaxes"):
        verify_greedy([0, 1], [0, 1])


@pytest.mark.parametrize("p, q, ids, match", [
    (torch.tensor([[0.5, 0.6], [0.5, 0.5]]), torch.tensor([[0.5, 0.5]]), [0], "target_probs rows must sum to 1"),
    (torch.tensor([[0.5, 0.5], [0.5, 0.5]]), torch.tensor([[1.5, -0.5]]), [0], "draft_probs has negative"),
    (torch.tensor([[0.5, 0.5], [0.5, 0.5]]), torch.tensor([[0.5, 0.5]]), [2], r"draft token ids must be in \[0, 2\)"),
    (torch.tensor([[0.5, 0.5]]), torch.tensor([[0.5, 0.5]]), [0], "need 2 target rows"),
])
def test_rejection_sampler_rejects_bad_input(p, q, ids, match):
    with pytest.raises(ValueError, match=match):
        verify_one(p, q, ids, [0.5] * len(ids), flat_noise(len(ids), 2))


def _random_verify_case(seed: int, batch: int = 7, max_k: int = 4, vocab: int = 6):
    """Random target/draft distributions (some with zeros), drafts drawn from q, per-sequence k."""
    gen = torch.Generator().manual_seed(seed)

    def dist(*shape):
        w = torch.rand(*shape, vocab, generator=gen) * (torch.rand(*shape, vocab, generator=gen) > 0.3)
        w[..., 0] += 1e-3  # never an all-zero row
        return w / w.sum(-1, keepdim=True)

    p, q = dist(batch, max_k + 1), dist(batch, max_k)
    ids = torch.multinomial(q.view(-1, vocab), 1, generator=gen).view(batch, max_k)
    ks = torch.randint(1, max_k + 1, (batch,), generator=gen)
    u = torch.rand(batch, max_k, generator=gen, dtype=torch.float64)
    noise = -torch.rand(batch, max_k + 1, vocab, generator=gen).log()
    return p, q, ids, ks, u, noise


@pytest.mark.parametrize("seed", range(20))
def test_batched_rejection_equals_verify_one_on_the_same_draws(seed):
    p, q, ids, ks, u, noise = _random_verify_case(seed)
    last_noise = lambda accepted: noise[torch.arange(len(accepted)), torch.tensor(accepted)]  # noqa: E731
    batched = verify_batch(p, q, ids, ks, u, last_noise)
    for b, k in enumerate(ks.tolist()):
        assert batched[b] == verify_one(p[b, :k + 1], q[b, :k], ids[b, :k].tolist(), u[b, :k].tolist(),
                                        noise[b, :k + 1]), b


@pytest.mark.parametrize("seed", range(20))
def test_batched_coupled_equals_verify_coupled_one_on_the_same_draws(seed):
    p, _, ids, ks, _, noise = _random_verify_case(seed)
    picks = (p / noise).argmax(-1)
    ids = torch.where(torch.rand(ids.shape, generator=torch.Generator().manual_seed(seed)) < 0.6, picks[:, :-1], ids)
    batched = verify_coupled_batch(p, ids, ks, noise)
    for b, k in enumerate(ks.tolist()):
        assert batched[b] == verify_coupled_one(p[b, :k + 1], ids[b, :k].tolist(), noise[b, :k + 1]), b
    assert any(len(t) > 1 for t in batched)  # the case exercises acceptance


def test_coupled_emits_the_target_draws_while_drafts_match():
    p = torch.tensor([[0.5, 0.5], [0.9, 0.1], [0.2, 0.8]])
    noise = torch.tensor([[1.0, 0.5], [1.0, 1.0], [1.0, 1.0]])  # target draws: 1, 0, 1
    assert verify_coupled_one(p, [1, 0], noise) == [1, 0, 1]  # all kept, then the bonus draw
    assert verify_coupled_one(p, [1, 1], noise) == [1, 0]  # second mismatches: the target's 0
    assert verify_coupled_one(p, [0, 0], noise) == [1]
