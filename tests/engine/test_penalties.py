"""Presence and frequency penalties: OpenAI's formula by hand, the batched function against the
reference, the engine against a hand-written greedy loop on `transformers`, and speculative
decoding with penalties: greedy tokens equal to plain decoding, sampled tokens distributed as
the penalized target says (the verifier applies the penalties to the target's rows)."""
from __future__ import annotations

import itertools

import pytest
import torch

from tinymodels import hf_model
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.model_runner import BatchEntry
from pdserve.engine.penalties import apply_penalties_ref, penalize
from pdserve.engine.sampler import param_tensors
from pdserve.engine.sequence import Sequence
from pdserve.kernels import TORCH_OPS
from scipy import stats


def test_reference_is_openais_formula_by_hand():
    logits = torch.tensor([1.0, 2.0, 3.0, 0.5])
    # token 0 generated once, token 2 twice: 1 - (1*0.25 + 0.5), 3 - (2*0.25 + 0.5); others untouched
    got = apply_penalties_ref(logits, [2, 0, 2], presence_penalty=0.5, frequency_penalty=0.25)
    assert got.tolist() == [0.25, 2.0, 2.0, 0.5]
    # negative penalties encourage repetition
    assert apply_penalties_ref(logits, [3], -1.0, -0.5).tolist() == [1.0, 2.0, 3.0, 2.0]
    assert apply_penalties_ref(logits, [], 2.0, 2.0).tolist() == logits.tolist()


def seq(prompt, outputs, **params) -> Sequence:
    s = Sequence("r", list(prompt), SamplingParams(**params), seed=0)
    s.output_token_ids = list(outputs)
    return s


def test_batched_rows_count_outputs_and_the_drafts_before_each_row():
    torch.manual_seed(0)
    logits = torch.randn(5, 12)
    a = seq([1, 2], [3, 3, 4], presence_penalty=0.7, frequency_penalty=0.3)
    b = seq([5], [6], frequency_penalty=1.0)
    plain = seq([7], [7, 8])  # no penalties: untouched
    # a verifies 3 drafts (4 rows), b one plain row; plain has no logits this step
    entries = [BatchEntry(a, 4, 4, extra_token_ids=[4, 9, 9]), BatchEntry(plain, 1, 0), BatchEntry(b, 1, 1)]
    got = penalize(logits, entries)
    want = [apply_penalties_ref(logits[i], [3, 3, 4] + [4, 9, 9][:i], 0.7, 0.3) for i in range(4)]
    want.append(apply_penalties_ref(logits[4], [6], 0.0, 1.0))
    torch.testing.assert_close(got, torch.stack(want))


def test_failover_prompt_tail_counts_as_generated():
    logits = torch.zeros(1, 6)
    s = seq([1, 2, 3, 3], [4], frequency_penalty=1.0, num_output_tokens_in_prompt=2)  # 3, 3 were generated
    assert penalize(logits, [BatchEntry(s, 1, 1)])[0].tolist() == [0, 0, 0, -2, -1, 0]


def test_no_penalty_returns_the_same_tensor():
    logits = torch.randn(2, 6)
    assert penalize(logits, [BatchEntry(seq([1], [2]), 2, 2)]) is logits


@pytest.fixture(scope="module")
def target(checkpoint):
    return checkpoint("llama")


def hf_penalized_greedy(path, prompt: list[int], n: int, presence: float, frequency: float) -> list[int]:
    model, ids, out = hf_model(path), list(prompt), []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        tok = int(apply_penalties_ref(logits, out, presence, frequency).argmax())
        out.append(tok)
        ids.append(tok)
    return out


PROMPT = [11, 12, 13] * 4
PENALIZED = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.5)


@pytest.fixture(scope="module")
def expected(target):
    return hf_penalized_greedy(target, PROMPT, 16, 1.5, 0.5)


def test_engine_greedy_with_penalties_matches_a_hand_written_loop(target, expected):
    got = LLM(target).generate([PROMPT], PENALIZED)[0].token_ids
    plain = LLM(target).generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    assert got == expected
    assert got != plain.token_ids  # the penalties changed what was generated


def test_speculation_applies_the_penalties_to_the_target(target, expected):
    """The target drafting for itself proposes its unpenalized argmax; verification must judge
    those drafts against the penalized rows, so the output equals plain penalized decoding."""
    llm = LLM(target, draft_model=target, num_speculative_tokens=3, spec_adaptive=False)
    assert llm.generate([PROMPT], PENALIZED)[0].token_ids == expected
    st = llm.engine.speculator.stats
    assert st.num_drafts > 0 and 0 < st.num_accepted_tokens < st.num_draft_tokens


VOCAB = 24


def assert_matches(samples: torch.Tensor, exact: torch.Tensor, n: int) -> None:
    """Chi-square at significance 1e-3 over the cells expected >= 5 times (the rest pooled)."""
    counts = torch.bincount(samples, minlength=VOCAB).double()
    assert counts[exact <= 1e-9].sum() == 0, "a token outside the support was emitted"
    expected = exact * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum(0, keepdim=True)])
    exp = torch.cat([expected[big], expected[~big].sum(0, keepdim=True)])
    if exp[-1] < 5:
        obs, exp = obs[:-1], exp[:-1] / exp[:-1].sum() * obs[:-1].sum()
    assert stats.chisquare(obs.numpy(), exp.numpy()).pvalue > 1e-3


SMALL_PROMPT = [3, 9, 4]


def test_sampled_speculation_with_penalties_is_exact_in_distribution(checkpoint):
    t = checkpoint("llama", seed=11, vocab_size=VOCAB)
    d = checkpoint("llama", seed=12, vocab_size=VOCAB, num_hidden_layers=1)
    params = dict(temperature=1.0, max_tokens=3, ignore_eos=True, presence_penalty=1.0, frequency_penalty=0.8)
    llm = LLM(t, draft_model=d, num_speculative_tokens=2, spec_adaptive=False, max_num_seqs=256,
              max_num_batched_tokens=4096)
    n = 2000
    outs = llm.generate([SMALL_PROMPT] * n, [SamplingParams(**params, seed=s) for s in range(n)])
    assert llm.engine.speculator.stats.num_accepted_tokens >= 20
    model, sp = hf_model(t), SamplingParams(**params)

    def next_probs(prefixes: list[list[int]]) -> torch.Tensor:  # P(next | prompt + prefix), penalized
        with torch.no_grad():
            logits = model(torch.tensor([SMALL_PROMPT + p for p in prefixes])).logits[:, -1].float()
        logits = torch.stack([apply_penalties_ref(row, p, 1.0, 0.8) for row, p in zip(logits, prefixes)])
        return TORCH_OPS.filter_probs(logits, *param_tensors([sp] * len(prefixes), logits.device)).double()

    p1 = next_probs([[]])[0]
    p2 = p1 @ next_probs([[a] for a in range(VOCAB)])
    p3_given = next_probs([[a, b] for a, b in itertools.product(range(VOCAB), repeat=2)]).view(VOCAB, VOCAB, VOCAB)
    p3 = torch.einsum("a,ab,abc->c", p1, next_probs([[a] for a in range(VOCAB)]), p3_given)
    assert_matches(torch.tensor([o.token_ids[1] for o in outs]), p2, n)
    assert_matches(torch.tensor([o.token_ids[2] for o in outs]), p3, n)


def test_penalties_are_validated():
    with pytest.raises(ValueError, match="presence_penalty"):
        SamplingParams(presence_penalty=2.5)
    with pytest.raises(ValueError, match="frequency_penalty"):
        SamplingParams(frequency_penalty=float("nan"))
