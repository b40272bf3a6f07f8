"""pdserve's model equals transformers' on the same random weights: logits, and greedy tokens
through the whole engine (batching, chunked prefill, preemption)."""
from __future__ import annotations

import pytest
import torch

from tinymodels import hf_greedy, hf_model
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.disagg import engine_identity
from pdserve.engine.model.llama import PackedLinear
from pdserve.engine.model_runner import BatchEntry
from pdserve.kernels import native

ARCHS = ["llama", "llama_linear", "qwen2", "mistral"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def engine_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Logits at every prompt position, through the paged cache in one prefill."""
    eng = llm.engine
    seq = eng.make_sequence("probe", ids, SamplingParams())
    assert eng.block_manager.allocate(seq, len(ids))
    try:
        return eng.runner.execute([BatchEntry(seq, len(ids), len(ids))])
    finally:
        eng.block_manager.free(seq)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(checkpoint, arch):
    path = checkpoint(arch)
    ids = [3, 17, 42, 99, 5, 7, 150, 61, 23, 11, 200, 8, 9, 1, 77, 33, 12, 14, 190, 2]
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([ids])).logits[0]
    ours = engine_logits(LLM(path), ids)
    # fp32 on both sides; matmul blocking differs (fused qkv), so allow float rounding
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_cpu_projections_are_column_major(checkpoint, arch):
    """Without the native projections every weight is laid out for the BLAS's fast small-M path,
    except a lm_head tied to the embedding (qwen2's), which the row lookup needs row-major."""
    model = LLM(checkpoint(arch), cpu_linear="torch").engine.runner.model
    layer = model.model.layers[0]
    for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert lin.weight.stride() == (1, lin.weight.shape[0])
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == (arch == "qwen2")
    assert model.lm_head.weight.is_contiguous() == tied


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: biased q/k/v, a tied lm_head
def test_packed_projections_match_nn_linear(checkpoint, arch):
    """The native projections (`cpu_linear="native"`, the default where they build) give the
    logits of nn.Linear, and a tied lm_head stays the embedding itself."""
    if not native.load() or not torch.ops.pdserve.linear_packed_available():
        pytest.skip(f"native projections unavailable here: {native.error() or 'no AVX-512 or AVX2'}")
    path, ids = checkpoint(arch), list(range(3, 40))
    packed, plain = LLM(path, cpu_linear="native"), LLM(path, cpu_linear="torch")
    model = packed.engine.runner.model
    assert isinstance(model.model.layers[0].mlp.down_proj, PackedLinear)
    assert isinstance(model.lm_head, PackedLinear) == (arch != "qwen2")
    torch.testing.assert_close(engine_logits(packed, ids), engine_logits(plain, ids), rtol=1e-4, atol=1e-4)
    assert LLM(path).engine.native_linear  # the default where they build
    # a worker that packs pairs with one that does not: the identity is the checkpoint's
    assert engine_identity(packed.engine) == engine_identity(plain.engine)
    assert engine_identity(packed.engine) != engine_identity(LLM(checkpoint("mistral")).engine)


def test_a_bfloat16_checkpoint_keeps_its_projections_in_bfloat16_panels(checkpoint):
    """Computed in float32, a bfloat16 checkpoint's projections are packed in bfloat16: half the
    bytes, the same values. Its logits are transformers' float32 logits, its greedy tokens
    transformers' tokens; a float32 checkpoint's panels stay float32."""
    if not native.load() or not torch.ops.pdserve.linear_packed_available():
        pytest.skip(f"native projections unavailable here: {native.error() or 'no AVX-512 or AVX2'}")
    path, ids = checkpoint("llama", save_dtype="bfloat16"), list(range(3, 40))
    llm = LLM(path)
    model = llm.engine.runner.model
    assert llm.engine.dtype == torch.float32
    layer = model.model.layers[0]
    for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj,
                model.lm_head):
        assert lin.packed.dtype == torch.bfloat16
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(engine_logits(llm, ids), ref, rtol=1e-4, atol=1e-4)
    prompts = [ids[:9], ids[5:30]]
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts, GREEDY.max_tokens)
    assert LLM(checkpoint("llama")).engine.runner.model.lm_head.packed.dtype == torch.float32


def test_a_bfloat16_checkpoint_on_the_tile_path_still_gives_transformers_tokens(checkpoint):
    """On a CPU with AMX, bfloat16 panels times 7 rows and more run on the tile unit
    (`kernels/cpu/linear_amx.h`), summing in another order: a batch of 32 greedy requests (a
    prefill of them all, decode steps of 32 rows) still gives transformers' tokens, and the same
    tokens as the vector loops; draft speculation at k = 4 (verifications of 160 rows) gives
    plain decoding's."""
    if not native.load() or not torch.ops.pdserve.linear_tile_rows(32):
        pytest.skip("no tile path here (a CPU without AMX): bfloat16 panels take the vector loops")
    path = checkpoint("llama", save_dtype="bfloat16")
    prompts = [list(range(3 + i, 12 + 2 * i)) for i in range(32)]
    llm = LLM(path, max_num_seqs=32)
    outs = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert outs == hf_greedy(path, prompts, GREEDY.max_tokens)
    before = torch.ops.pdserve.linear_use_tiles(False)
    try:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == outs
    finally:
        torch.ops.pdserve.linear_use_tiles(before)
    spec = LLM(path, max_num_seqs=32, draft_model=path, num_speculative_tokens=4, spec_adaptive=False)
    assert [o.token_ids for o in spec.generate(prompts, GREEDY)] == outs


def test_half_precision_projections_stay_row_major(checkpoint):
    """The column-major layout is a float32 gain only (the half-precision CPU kernels lose ~5x)."""
    layer = LLM(checkpoint("llama"), dtype="bfloat16").engine.runner.model.model.layers[0]
    assert layer.mlp.down_proj.weight.is_contiguous()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_logits_close(checkpoint, dtype):
    path = checkpoint("llama")
    ids = list(range(10, 40))
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([ids])).logits[0]
    llm = LLM(path, dtype=dtype)
    assert llm.engine.runner.kv_caches[0][0].dtype == getattr(torch, dtype)
    ours = engine_logits(llm, ids)
    # bf16 keeps 8 mantissa bits (fp16 11): compare loosely, and the argmax should mostly agree
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8
    torch.testing.assert_close(ours, ref, rtol=0.1, atol=0.15)


def test_decode_through_paged_cache_matches_full_forward(checkpoint):
    """Logits of the token after a prompt: one-shot prefill vs prefill-then-decode steps."""
    path = checkpoint("llama")
    ids = list(range(5, 45))
    llm = LLM(path)
    full = engine_logits(llm, ids)[-1]
    eng = llm.engine
    seq = eng.make_sequence("probe", ids, SamplingParams())
    assert eng.block_manager.allocate(seq, len(ids))
    eng.runner.execute([BatchEntry(seq, len(ids) - 1, 0)])
    seq.num_computed_tokens = len(ids) - 1
    last = eng.runner.execute([BatchEntry(seq, 1, 1)])[0]
    eng.block_manager.free(seq)
    torch.testing.assert_close(last, full, rtol=1e-4, atol=1e-4)


PROMPTS = [
    [7],
    list(range(3, 40)),
    [11, 12, 13, 14, 15],
    [int(x) for x in torch.randint(0, 211, (150,), generator=torch.Generator().manual_seed(1))],
    list(range(100, 123)),
]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_batch_matches_transformers(checkpoint, arch):
    path = checkpoint(arch)
    ref = hf_greedy(path, PROMPTS, GREEDY.max_tokens)
    outs = LLM(path).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == ref
    assert all(o.finish_reason_str == "length" for o in outs)


def test_greedy_with_chunked_prefill(checkpoint):
    path = checkpoint("llama")
    ref = hf_greedy(path, PROMPTS, GREEDY.max_tokens)
    llm = LLM(path, max_num_batched_tokens=16)  # the 150-token prompt takes 10 steps
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == ref


def test_greedy_with_preemption(checkpoint):
    path = checkpoint("llama")
    ref = hf_greedy(path, PROMPTS, GREEDY.max_tokens)
    # 13 blocks of 16 tokens: the 150-token prompt alone takes 11, so the batch cannot all fit
    llm = LLM(path, num_kv_blocks=13, enable_prefix_caching=False)
    seqs = []
    orig = llm.engine.scheduler._preempt
    llm.engine.scheduler._preempt = lambda seq, out: (seqs.append(seq), orig(seq, out))
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == ref
    assert seqs, "the pool was meant to be too small: nothing was preempted"
    assert llm.engine.block_manager.num_free_blocks == 13


def test_seeded_sampling_survives_preemption(checkpoint):
    path = checkpoint("llama")
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=10, ignore_eos=True) for i in range(len(PROMPTS))]
    roomy = LLM(path).generate(PROMPTS, params)
    tight = LLM(path, num_kv_blocks=13, max_num_batched_tokens=32).generate(PROMPTS, params)
    assert [o.token_ids for o in roomy] == [o.token_ids for o in tight]


def test_prefix_cache_reuses_blocks_and_keeps_output(checkpoint):
    path = checkpoint("llama")
    llm = LLM(path)
    prompt = list(range(20, 90))  # 70 tokens: 4 full blocks reusable
    first = llm.generate([prompt], GREEDY)[0]
    second = llm.generate([prompt], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 64
    assert second.token_ids == first.token_ids
    assert llm.engine.block_manager.usage == 0.0
