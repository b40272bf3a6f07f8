"""The coupled verifier (`spec_decode/coupled.py`) end to end: a seeded sampled request's tokens
are a pure function of (seed, position), the same with or without speculation, at any depth,
with any proposer and in any batch. (Its exactness in distribution is tested beside the
rejection sampler's in test_spec_decode.py, its rules by hand in test_verification_rules.py.)"""
from __future__ import annotations

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import EngineConfig

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], list(range(3, 40)), [11, 12, 13] * 10, [7]]
PARAMS = [SamplingParams(temperature=1.0, seed=s, max_tokens=24, ignore_eos=True) for s in (3, 17, 99, 2024)]
PARAMS[1] = SamplingParams(temperature=0.8, top_p=0.9, seed=17, max_tokens=24, ignore_eos=True)
PARAMS[2] = SamplingParams(temperature=1.2, top_k=20, min_p=0.02, seed=99, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def target(checkpoint):
    return checkpoint("llama")


@pytest.fixture(scope="module")
def draft(checkpoint):  # a different (worse) model: its proposals are often wrong
    return checkpoint("llama", seed=7, num_hidden_layers=1, hidden_size=32, intermediate_size=64)


@pytest.fixture(scope="module")
def plain_tokens(target):
    """Each request alone, without speculation: the reference."""
    llm = LLM(target)
    return [llm.generate([p], sp)[0].token_ids for p, sp in zip(PROMPTS, PARAMS)]


@pytest.mark.parametrize("options", [
    dict(draft="other", num_speculative_tokens=1, spec_adaptive=False),
    dict(draft="other", num_speculative_tokens=3, spec_adaptive=False),
    dict(draft="other", num_speculative_tokens=4),  # adaptive depth: k changes from step to step
    dict(draft="self", num_speculative_tokens=4, spec_adaptive=False),  # every draft accepted
    dict(speculative_method="ngram", num_speculative_tokens=4, spec_adaptive=False),
], ids=["draft-k1", "draft-k3", "draft-adaptive", "perfect-draft-k4", "ngram-k4"])
def test_sampled_tokens_depend_on_seed_and_position_only(target, draft, plain_tokens, options):
    options = dict(options)
    which = options.pop("draft", None)
    if which:
        options["draft_model"] = target if which == "self" else draft
    llm = LLM(target, spec_verifier="coupled", **options)
    batch = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    assert batch == plain_tokens
    order = [2, 0, 3, 1]  # another batch: other neighbours, other row order
    shuffled = llm.generate([PROMPTS[i] for i in order], [PARAMS[i] for i in order])
    assert [o.token_ids for o in shuffled] == [plain_tokens[i] for i in order]
    alone = llm.generate([PROMPTS[1]], PARAMS[1])[0].token_ids
    assert alone == plain_tokens[1]
    st = llm.engine.speculator.stats
    assert st.num_drafts > 0  # speculation really ran
    if which:  # and kept drafts (n-gram lookups on a random model's samples are rarely right)
        assert st.num_accepted_tokens > 0
    if which == "self":
        assert st.acceptance_rate == 1.0


def test_spec_verifier_option_is_validated():
    with pytest.raises(ValueError, match="spec_verifier"):
        EngineConfig(model="m", spec_verifier="optimistic")
