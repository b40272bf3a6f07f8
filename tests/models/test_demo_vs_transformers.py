"""The shipped demo pair through pdserve equals transformers on the same weights, and speculative
decoding with the pair keeps greedy output unchanged."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.model_runner import BatchEntry
from tinymodels import hf_model

MODELS = Path(__file__).resolve().parents[2] / "models"
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\nclass Config:\n    def __init__(self", "    return"]


@pytest.fixture(scope="module")
def target() -> LLM:
    return LLM(MODELS / "demo")


@pytest.mark.parametrize("name", ["demo", "demo-draft"])
def test_logits_match_transformers(name):
    llm = LLM(MODELS / name)
    ref_model = hf_model(MODELS / name)
    for prompt in PROMPTS:
        ids = llm.engine.tokenize(prompt)
        with torch.no_grad():
            ref = ref_model(torch.tensor([ids])).logits[0]
        seq = llm.engine.make_sequence("probe", ids, SamplingParams())
        assert llm.engine.block_manager.allocate(seq, len(ids))
        ours = llm.engine.runner.execute([BatchEntry(seq, len(ids), len(ids))])
        llm.engine.block_manager.free(seq)
        # bf16 weights upcast to float32 on both sides; fused projections round differently
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=2e-4)


def test_greedy_generation_equals_transformers(target):
    """pdserve's greedy continuation of each prompt, token for token, is transformers' own
    `generate` on the same weights (float32 on both sides), and its text is that of the tokens."""
    ref_model = hf_model(MODELS / "demo")
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    for prompt, out in zip(PROMPTS, target.generate(PROMPTS, params)):
        ids = target.engine.tokenize(prompt)
        with torch.no_grad():
            ref = ref_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=48, min_new_tokens=48,
                                     eos_token_id=None, pad_token_id=ref_model.config.pad_token_id)
        assert out.token_ids == ref[0, len(ids):].tolist(), prompt
        assert out.text == target.engine.tokenizer.decode(out.token_ids, True)


def test_demo_pair_speculation_keeps_greedy_output(target):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [o.token_ids for o in target.generate(PROMPTS, params)]
    spec = LLM(MODELS / "demo", draft_model=MODELS / "demo-draft", num_speculative_tokens=4, spec_adaptive=False)
    assert [o.token_ids for o in spec.generate(PROMPTS, params)] == want
    st = spec.engine.speculator.stats
    assert st.acceptance_rate > 0.3, f"the demo draft should agree with its target often: {st}"
