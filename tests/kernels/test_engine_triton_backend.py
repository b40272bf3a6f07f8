"""The whole engine on the Triton path (interpreted on CPU) gives the torch path's greedy tokens."""
from __future__ import annotations

from pdserve.engine import LLM, SamplingParams


def test_triton_backend_matches_torch_backend(checkpoint):
    path = checkpoint("llama", num_hidden_layers=1)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [3, 4]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    torch_out = LLM(path, kernel_backend="torch").generate(prompts, params)
    llm = LLM(path, kernel_backend="triton", max_num_batched_tokens=8)  # chunked: extend + decode kernels
    assert llm.engine.ops.name == "triton"
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in torch_out]
