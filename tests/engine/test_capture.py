"""Graph capture (`engine/capture.py`): a captured forward computes what the eager one does.

The CPU capture compiles the model once (tens of seconds); one engine covers batch 1 and a
batch of several sequences, decode steps and speculative verification, greedy and seeded
sampling, all through the single graph it traces."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import EngineConfig

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], list(range(3, 40)), [11, 12, 13] * 10]


@pytest.fixture(scope="module")
def target(checkpoint):
    return checkpoint("llama")


@pytest.mark.slow
def test_compiled_forward_gives_the_eager_tokens(target):
    from torch._dynamo.utils import counters

    graphs_before = counters["stats"]["unique_graphs"]
    options = dict(speculative_method="ngram", num_speculative_tokens=3, spec_adaptive=False)
    eager, compiled = LLM(target, **options), LLM(target, graph_capture="compile", **options)
    capture = compiled.engine.runner.capture
    assert capture is not None and capture.compile_seconds > 0  # compiled at start-up, not in a request
    for params in (SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                   SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=5)):
        for prompts in (PROMPTS[:1], PROMPTS):
            want = [o.token_ids for o in eager.generate(prompts, params)]
            assert [o.token_ids for o in compiled.generate(prompts, params)] == want
    assert not capture.is_broken and compiled.engine.speculator.stats.num_drafts > 0
    assert counters["stats"]["unique_graphs"] - graphs_before == 1  # one graph for every batch size and length


def test_graph_capture_option_is_validated():
    with pytest.raises(ValueError, match="graph_capture"):
        EngineConfig(model="m", graph_capture="sometimes")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_cuda_graphs_need_cuda(target):
    with pytest.raises(ValueError, match="needs a CUDA device"):
        LLM(target, graph_capture="cuda_graphs")
