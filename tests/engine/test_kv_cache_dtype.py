"""A 16-bit KV cache under a float32 model on the CPU (`EngineConfig.kv_cache_dtype`): twice the
blocks in the same memory, K and V rounded once when written, and every path of the step (the
native forward, the torch ops, chunked prefill, speculation) reading the same rounded values, so
they agree with one another token for token; against a float32 cache, close but not identical."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import EngineConfig, resolve_kv_dtype
from pdserve.engine.disagg import describe
from pdserve.router.workers import pairing_differences
from pdserve.serving.convert import worker_info

PROMPTS = [[3 + i, 17, 40 + 3 * i, 9, 100 - i] * (4 + 7 * i) for i in range(4)]  # 20 to 125 tokens
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
MEMORY = 1 << 20  # few enough blocks that the pool's size follows the bytes, not max_num_seqs


def _tokens(llm: LLM, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def target(checkpoint):
    return str(checkpoint("llama"))


@pytest.mark.parametrize("cache_dtype", ["bfloat16", "float16"])
def test_a_16_bit_cache_holds_twice_the_blocks_and_every_path_reads_the_same_values(target, cache_dtype):
    wide = LLM(target, kv_cache_memory_bytes=MEMORY)
    native = LLM(target, kv_cache_memory_bytes=MEMORY, kv_cache_dtype=cache_dtype)
    k_cache = native.engine.runner.kv_caches[0][0]
    assert k_cache.dtype == getattr(torch, cache_dtype)
    assert native.engine.runner.model.model.embed_tokens.weight.dtype == torch.float32  # the model stays float32
    assert native.engine.block_manager.num_blocks == 2 * wide.engine.block_manager.num_blocks
    assert native.engine.runner.native_forward is not None  # the native op takes the 16-bit cache
    want = _tokens(native)
    # the torch ops (their write rounds as the native one does), and prefill in 32-token chunks
    torch_ops = LLM(target, kv_cache_memory_bytes=MEMORY, kv_cache_dtype=cache_dtype, cpu_attention="torch",
                    cpu_linear="torch")
    assert torch_ops.engine.runner.native_forward is None
    assert _tokens(torch_ops) == want
    chunked = LLM(target, kv_cache_memory_bytes=MEMORY, kv_cache_dtype=cache_dtype, max_num_batched_tokens=32)
    assert _tokens(chunked) == want
    # against float32 K/V: the same distributions within the rounding
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    for a, b in zip(wide.generate(PROMPTS, params), native.generate(PROMPTS, params)):
        top_a, top_b = dict(a.logprobs[0]), dict(b.logprobs[0])
        for token in set(top_a) & set(top_b):
            assert abs(top_a[token] - top_b[token]) < 0.05


def test_speculation_over_a_16_bit_cache_gives_plain_decodings_tokens(target, checkpoint):
    """The draft's cache takes the same dtype; verification reads the rounded K/V that plain
    decoding reads, so greedy output is plain decoding's, and a sampled request's too (the
    coupled verifier: the target's own draws)."""
    draft = str(checkpoint("llama", seed=1))
    plain = LLM(target, kv_cache_dtype="bfloat16")
    spec = LLM(target, kv_cache_dtype="bfloat16", draft_model=draft, num_speculative_tokens=3)
    assert spec.engine.draft_runner.kv_caches[0][0].dtype == torch.bfloat16
    assert _tokens(spec) == _tokens(plain)
    sampled = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=7)
    assert _tokens(spec, sampled) == _tokens(plain, sampled)


def test_kv_cache_dtype_is_validated(target):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(model=target, kv_cache_dtype="int8")
    f32, bf16, cpu = torch.float32, torch.bfloat16, torch.device("cpu")
    assert resolve_kv_dtype("auto", bf16, cpu, "torch") == bf16
    assert resolve_kv_dtype("bfloat16", bf16, cpu, "torch") == bf16
    assert resolve_kv_dtype("float16", f32, cpu, "torch") == torch.float16
    with pytest.raises(ValueError, match="kv_cache_dtype 'float32' under a bfloat16 model"):
        resolve_kv_dtype("float32", bf16, cpu, "torch")
    with pytest.raises(ValueError, match="only the CPU's torch kernels"):
        resolve_kv_dtype("bfloat16", f32, cpu, "triton")
    with pytest.raises(ValueError, match="only the CPU's torch kernels"):
        resolve_kv_dtype("bfloat16", f32, torch.device("cuda"), "triton")
    with pytest.raises(ValueError, match="under a bfloat16 model"):  # through the engine
        LLM(target, dtype="bfloat16", kv_cache_dtype="float16")


def test_workers_with_different_cache_dtypes_do_not_pair(target):
    """A prefill worker's K/V land as bytes in the decode worker's cache: the router pairs two
    workers only where their caches' dtypes agree (and says which field differs)."""
    wide = describe(LLM(target, kv_cache_memory_bytes=MEMORY).engine)
    narrow = describe(LLM(target, kv_cache_memory_bytes=MEMORY, kv_cache_dtype="bfloat16").engine)
    assert (wide.dtype, wide.kv_dtype, narrow.dtype, narrow.kv_dtype) == ("float32", "float32", "float32", "bfloat16")
    diffs = pairing_differences(worker_info("prefill", wide), worker_info("decode", narrow))
    assert diffs == ["kv_dtype: prefill has 'float32', decode has 'bfloat16'"]
    assert pairing_differences(worker_info("prefill", narrow), worker_info("decode", narrow)) == []
    older = worker_info("prefill", wide)
    older.kv_dtype = ""  # a worker from before the field: its cache has its model's dtype
    assert pairing_differences(older, worker_info("decode", wide)) == []
    assert pairing_differences(older, worker_info("decode", narrow)) == [
        "kv_dtype: prefill has 'float32', decode has 'bfloat16'"]
