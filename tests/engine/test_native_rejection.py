"""The rejection sampler's rule in C++ (`cpu/rejection.cpp`): `pdserve::rejection_rows` against
`verify_batch` (whose reference is `verify_one`) on the draws the engine makes, the acceptance
uniforms and the last token's noise keyed by (seed, position, stream), with residuals that have no
mass, one-hot drafts (an n-gram's) and greedy rows among sampled ones; `pdserve::temperature_probs`
as the distribution the native race draws from; malformed calls refused with the reason. The same
rule inside the fused step: test_fused_step.py; in distribution: test_spec_decode.py."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine import rng
from pdserve.engine.spec_decode.rejection_sampler import verify_batch
from pdserve.kernels import native

pytestmark = pytest.mark.skipif(not native.load(), reason="the native CPU ops are needed")


def _case(seed: int, batch: int = 9, max_k: int = 4, vocab: int = 40):
    """Per sequence: p [k + 1, vocab] and q [k, vocab] (random, some entries zero, from softmaxes
    at random temperatures), drafts drawn from q, its seed and position; sequence 0 greedy (p and
    q one-hot), sequence 1's q one-hot on its drafts (an n-gram's), sequence 2's q p's rows with 1
    at each draft (not a distribution: every residual max(0, p - q) is empty, as float rounding
    leaves one at times in the engine, and the last token is raced over p), sequence 3 at depth
    0, sequence 5's q equal to p (every draft accepted)."""
    gen = torch.Generator().manual_seed(seed)
    ks = torch.randint(1, max_k + 1, (batch,), generator=gen)
    ks[3] = 0
    temps = torch.rand(batch, generator=gen) + 0.5
    temps[0] = 0.0
    ps, qs, ids = [], [], []
    for b, k in enumerate(ks.tolist()):
        logits = torch.randn(2 * k + 1, vocab, generator=gen) * 3
        logits[torch.rand(2 * k + 1, vocab, generator=gen) < 0.2] = -float("inf")
        logits[:, 0] = 0.0  # never an all-zero row
        probs = torch.ops.pdserve.temperature_probs(logits, temps[b].expand(2 * k + 1).contiguous())
        p, q = probs[:k + 1], probs[k + 1:]
        if b == 5:  # q = p: every draft accepted, the bonus token raced over p's last row
            q = p[:k].clone()
        drafts = torch.multinomial(q, 1, generator=gen).view(-1) if k else torch.empty(0, dtype=torch.int64)
        if b == 1:
            q = torch.zeros(k, vocab).scatter(-1, drafts[:, None], 1.0)
        if b == 2:  # q >= p everywhere and above it at the draft: every residual is empty
            q = p[:k].clone().scatter(-1, drafts[:, None], 1.0)
        ps.append(p)
        qs.append(q)
        ids.append(drafts)
    seeds = [int(s) for s in torch.randint(0, 2**62, (batch,), generator=gen)]
    seeds[4] = 2**64 - 5  # a seed past int64: its bits, as rng keys it
    positions = torch.randint(0, 5000, (batch,), generator=gen).tolist()
    return ps, qs, ids, ks, temps, seeds, positions


def _reference(ps, qs, ids, ks, temps, seeds, positions):
    """`verify_batch` with the engine's draws (`RejectionVerifier._verify_torch`'s)."""
    batch, max_k, vocab = len(ps), int(ks.max()), ps[0].shape[-1]
    p = torch.stack([torch.cat([x, x[-1:].expand(max_k + 1 - len(x), vocab)]) for x in ps])
    q = torch.stack([torch.cat([x, torch.zeros(max_k - len(x), vocab)]) for x in qs])
    drafts = torch.stack([torch.cat([x, torch.zeros(max_k - len(x), dtype=torch.int64)]) for x in ids])
    u = torch.tensor([[rng.uniform(s, n + i, rng.ACCEPT_STREAM) for i in range(max_k)]
                      for s, n in zip(seeds, positions)], dtype=torch.float64)
    sampled = [b for b in range(batch) if temps[b] > 0]

    def last_noise(accepted):
        noise = torch.ones(batch, vocab)
        noise[sampled] = rng.exponentials(
            [seeds[b] for b in sampled], [positions[b] + accepted[b] for b in sampled], vocab,
            [rng.SAMPLE_STREAM if accepted[b] == ks[b] else rng.RESIDUAL_STREAM for b in sampled],
            hash_fn=rng.NativeHash())
        return noise

    return verify_batch(p, q, drafts, ks, u, last_noise)


def _native(ps, qs, ids, ks, temps, seeds, positions):
    accepted, last = torch.ops.pdserve.rejection_rows(
        torch.cat(ps), torch.cat(qs), torch.cat(ids), ks, rng.seed_words(seeds), torch.tensor(positions), temps,
        rng.vocab_codes(ps[0].shape[-1]))
    return [x[:a].tolist() + [t] for x, a, t in zip(ids, accepted.tolist(), last.tolist())]


@pytest.mark.parametrize("seed", range(12))
def test_the_native_rule_equals_verify_batch_on_the_engines_draws(seed):
    case = _case(seed)
    assert _native(*case) == _reference(*case)


def test_the_cases_reach_every_outcome():
    """Over the cases above: drafts accepted and rejected, sequences that accept all and emit the
    bonus, and sequence 2 rejected, its empty residual falling back to p (the test above is not
    vacuous)."""
    emitted, depths, empty_residuals = [], [], 0
    for seed in range(12):
        case = _case(seed)
        tokens = _native(*case)
        emitted += tokens
        depths += case[3].tolist()
        empty_residuals += len(tokens[2]) - 1 < int(case[3][2])
    accepted = [len(t) - 1 for t in emitted]
    assert any(0 < a < k for a, k in zip(accepted, depths)) and any(a == k > 0 for a, k in zip(accepted, depths))
    assert any(a == 0 < k for a, k in zip(accepted, depths)) and empty_residuals >= 6


def test_temperature_probs_is_the_distribution_the_native_race_draws_from():
    """Its rows sum to 1 and are the softmax at the temperature (to float rounding); a row at
    temperature 0 is one-hot on the first largest logit; and racing them against noise picks what
    `pdserve::race_rows` picks from the logits."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=gen) * 4
    logits[1, 7] = logits[1, 9] = logits[1].max() + 1  # a tie: the first wins
    t = torch.tensor([1.0, 0.0, 0.7, 1.3, 2.0, 0.2])
    probs = torch.ops.pdserve.temperature_probs(logits, t)
    assert torch.allclose(probs.sum(-1), torch.ones(6), atol=1e-5)
    sampled = t > 0
    assert torch.allclose(probs[sampled], (logits[sampled] / t[sampled, None]).softmax(-1), rtol=1e-4, atol=1e-7)
    assert probs[1].nonzero().view(-1).tolist() == [7] and float(probs[1, 7]) == 1.0
    noise = -torch.rand(6, 300, generator=gen).log()
    assert (probs / noise).argmax(-1).tolist() == torch.ops.pdserve.race_rows(logits, t, noise).tolist()


def test_malformed_calls_are_refused_with_the_reason():
    ps, qs, ids, ks, temps, seeds, positions = _case(0)
    p, q, d = torch.cat(ps), torch.cat(qs), torch.cat(ids)
    args = dict(probs=p, draft_probs=q, drafts=d, depths=ks, seeds=rng.seed_words(seeds),
                positions=torch.tensor(positions), temperature=temps, codes=rng.vocab_codes(p.shape[-1]))

    def call(**change):
        return torch.ops.pdserve.rejection_rows(*{**args, **change}.values())

    bad_depths = ks.clone()
    bad_depths[0] = -1
    with pytest.raises(RuntimeError, match="depth -1 of sequence 0 is negative"):
        call(depths=bad_depths)
    with pytest.raises(RuntimeError, match=r"probs must be float32 \[\d+ \(each sequence's depth \+ 1\)"):
        call(probs=p[1:])
    with pytest.raises(RuntimeError, match="draft_probs must be float32"):
        call(draft_probs=q[:, 1:])
    bad_drafts = d.clone()
    bad_drafts[0] = p.shape[-1]
    with pytest.raises(RuntimeError, match=f"draft token {p.shape[-1]} out of range"):
        call(drafts=bad_drafts)
    with pytest.raises(RuntimeError, match="position of sequence 2 is negative"):
        call(positions=torch.tensor([0, 0, -3] + positions[3:]))
    with pytest.raises(RuntimeError, match="temperature must be float32"):
        call(temperature=temps.double())
    with pytest.raises(RuntimeError, match="codes must be int32"):
        call(codes=rng.vocab_codes(p.shape[-1] + 1))
    with pytest.raises(RuntimeError, match="temperature_probs: logits must be float32"):
        torch.ops.pdserve.temperature_probs(p, temps)


def test_the_samplers_distributions_are_the_native_races_where_rows_race_natively():
    """`Sampler.probs`: rows sampled by temperature alone (and greedy ones) get
    `pdserve::temperature_probs`, a filtered row the kernels' filter; a row's distribution is the
    same alone as beside others (the rejection sampler's q and p never depend on the batch)."""
    from pdserve.engine import SamplingParams
    from pdserve.engine.sampler import Sampler, param_tensors
    from pdserve.kernels import TORCH_OPS

    sampler = Sampler(TORCH_OPS, torch.device("cpu"))
    assert sampler.races_natively
    params = [SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0)]
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2)) * 3
    probs = sampler.probs(logits, params)
    assert torch.equal(probs[0], torch.ops.pdserve.temperature_probs(logits[:1], torch.tensor([0.8]))[0])
    assert torch.equal(probs[1], TORCH_OPS.filter_probs(logits[1:2], *param_tensors(params[1:2], logits.device))[0])
    assert probs[2].nonzero().view(-1).tolist() == [int(logits[2].argmax())]
    for i, p in enumerate(params):
        assert torch.equal(sampler.probs(logits[i:i + 1], [p])[0], probs[i])
