"""A draft's passes in one native call (`pdserve::draft_passes`, `kernels/cpu/draft_passes.cpp`,
through `native_forward.NativePasses`) against the model's own passes (`DraftPasses`, eager): the same
picks, greedy and sampled, with and without the catch-up pass, over sequences at different
positions, and the same K/V in the cache to float rounding. Three architectures: Llama 3 (GQA,
llama3 rope scaling), Qwen2 (q/k/v biases, an lm_head tied to the embedding) and Mistral (q's
width apart from the hidden size). Malformed calls are refused with the reason."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine import rng
from pdserve.engine.draft_passes import DraftPasses
from pdserve.engine.native_forward import NativePasses
from pdserve.engine.model.config import load_model_config
from pdserve.engine.model_runner import BatchEntry, ModelRunner
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence
from pdserve.kernels import TORCH_OPS, native
from native_models import native_runner, require_avx2_fma

BLOCK_SIZE = 16
PROMPT_LENS = (37, 16, 5)  # a sequence's next position: mid-block, at a block's start, early


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def runner(request, checkpoint):
    return native_runner(checkpoint, request.param, seed=5, num_blocks=16, block_size=BLOCK_SIZE)


def _prefilled(runner: ModelRunner) -> tuple[list[Sequence], list]:
    """Sequences whose prompts but the last token are in the cache (as after a verification
    that accepted everything: the last two tokens new to the draft), and a copy of the cache."""
    gen = torch.Generator().manual_seed(1)
    seqs = []
    for i, n in enumerate(PROMPT_LENS):
        ids = torch.randint(0, runner.cfg.vocab_size, (n,), generator=gen).tolist()
        seqs.append(Sequence(f"s{i}", ids, SamplingParams(), seed=i, block_table=list(range(5 * i, 5 * i + 5))))
    with torch.inference_mode():
        runner.execute([BatchEntry(s, len(s.token_ids) - 2, 1, start=0) for s in seqs])
    return seqs, [(k.clone(), v.clone()) for k, v in runner.kv_caches]


def _state(seqs: list[Sequence], catch_up: bool) -> torch.Tensor:
    head = (lambda s: [*s.token_ids[-2:], len(s.token_ids) - 1]) if catch_up else \
        (lambda s: [s.token_ids[-2], len(s.token_ids) - 2])
    return torch.tensor([head(s) + s.block_table for s in seqs])


@pytest.mark.parametrize("catch_up", [True, False], ids=["catch-up", "plain"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_native_passes_pick_what_the_model_picks(runner, catch_up, sampled):
    seqs, cache = _prefilled(runner)
    native_passes = DraftPasses(runner.model, [(k.clone(), v.clone()) for k, v in cache], BLOCK_SIZE,
                                compiled=False, native=True)
    reference = DraftPasses(runner.model, [(k.clone(), v.clone()) for k, v in cache], BLOCK_SIZE,
                            compiled=False, native=False)
    assert isinstance(native_passes.native, NativePasses) and reference.native is None
    state, num_passes = _state(seqs, catch_up), 5
    sampling = ()
    if sampled:  # a greedy row among sampled ones, at different temperatures
        noise = torch.empty(num_passes, len(seqs), runner.cfg.vocab_size).exponential_(
            generator=torch.Generator().manual_seed(2))
        sampling = (torch.tensor([1.0, 0.0, 0.7]), noise)
    with torch.inference_mode():
        mine, theirs = native_passes(state, num_passes, *sampling, catch_up=catch_up), \
            reference(state, num_passes, *sampling, catch_up=catch_up)
    assert mine.shape == (num_passes, len(seqs)) and mine.dtype == torch.int64
    assert mine.tolist() == theirs.tolist()
    for (k1, v1), (k2, v2) in zip(native_passes.kv_caches, reference.kv_caches):
        torch.testing.assert_close(k1, k2, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v1, v2, rtol=1e-4, atol=1e-5)
    written = [(s.block_table[p // BLOCK_SIZE], p % BLOCK_SIZE)
               for s in seqs for p in range(len(s.token_ids) - 2, len(s.token_ids) - 2 + num_passes)]
    assert all(native_passes.kv_caches[0][0][b, o].abs().sum() > 0 for b, o in written)  # every pass wrote its K/V


def test_native_passes_refuse_malformed_calls(runner):
    seqs, cache = _prefilled(runner)
    passes = NativePasses.of(runner.model, cache)
    state = _state(seqs, catch_up=False)
    with pytest.raises(RuntimeError, match="num_passes must be at least 1"):
        passes(state, 0)
    with pytest.raises(RuntimeError, match=r"state must be int64 \[seqs, 3 \+ block ids\]"):
        passes(state[:, :3], 1, catch_up=True)
    far = state.clone()
    far[0, 1] = 5 * BLOCK_SIZE  # past the sequence's five blocks
    with pytest.raises(RuntimeError, match="outside its blocks"):
        passes(far, 1)
    bad = state.clone()
    bad[1, 0] = runner.cfg.vocab_size
    with pytest.raises(RuntimeError, match="token .* out of range"):
        passes(bad, 1)
    with pytest.raises(RuntimeError, match="temperature and noise come together"):
        passes(state, 1, torch.ones(len(seqs)))
    with pytest.raises(RuntimeError, match="noise float32 \\[passes, seqs, vocab\\]"):
        passes(state, 2, torch.ones(len(seqs)), torch.ones(1, len(seqs), runner.cfg.vocab_size))


def test_native_passes_need_packed_float32_projections(checkpoint):
    """Without packed projections (`cpu_linear="torch"`) the draft's passes stay graphs."""
    assert native.load(), native.error()
    path = checkpoint("llama", seed=5)
    runner = ModelRunner(load_model_config(path), path, TORCH_OPS, torch.float32, torch.device("cpu"), num_blocks=4,
                         block_size=BLOCK_SIZE, native_attention=True, native_linear=False)
    assert runner.passes is not None and runner.passes.native is None


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_the_avx2_build_picks_what_the_loaded_build_picks(runner, native_variant, sampled):
    """draft_passes.cpp built without AVX-512 (AVX2 lanes for the norms, SwiGLU, projections, attention
    and the race's softmax; a scalar first argmax), which a CPU with AVX-512 never runs: the same
    picks as the loaded build over a catch-up and four more passes, and the same K/V."""
    require_avx2_fma()
    ops = native_variant("pdserve_test_decoder_avx2")
    seqs, cache = _prefilled(runner)
    draft = DraftPasses(runner.model, [(k.clone(), v.clone()) for k, v in cache], BLOCK_SIZE, compiled=False,
                        native=True)
    nat, state, num_passes = draft.native, _state(seqs, catch_up=True), 5
    heads, kv_heads, eps, scale = nat.shape
    sampling = (None, None)
    if sampled:
        noise = torch.empty(num_passes, len(seqs), runner.cfg.vocab_size).exponential_(
            generator=torch.Generator().manual_seed(4))
        sampling = (torch.tensor([1.0, 0.0, 0.7]), noise)

    def picks(op):
        for (k, v), (k0, v0) in zip(draft.kv_caches, cache):
            k.copy_(k0), v.copy_(v0)
        with torch.inference_mode():
            out = op(state, num_passes, True, nat.weights, nat.caches, nat.cos, nat.sin, heads, kv_heads, eps, scale,
                     *sampling)
        return out.tolist(), [(k.clone(), v.clone()) for k, v in draft.kv_caches]

    (mine, mine_cache), (avx2, avx2_cache) = picks(torch.ops.pdserve.draft_passes), picks(ops.draft_passes)
    assert avx2 == mine and len(mine) == num_passes
    for (k1, v1), (k2, v2) in zip(avx2_cache, mine_cache):
        torch.testing.assert_close(k1, k2, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v1, v2, rtol=1e-4, atol=1e-5)


def test_the_avx2_build_of_the_rejection_rule_gives_the_loaded_builds_tokens(native_variant):
    """rejection.cpp built without AVX-512 (the AVX2 softmax, a scalar first argmax): its
    distributions within float rounding of the loaded build's, and on the same distributions the
    same accepted counts and last tokens, greedy and sampled rows."""
    require_avx2_fma()
    ops = native_variant("pdserve_test_decoder_avx2")
    gen = torch.Generator().manual_seed(6)
    ks = torch.tensor([3, 1, 4, 2])
    temps = torch.tensor([1.0, 0.0, 0.7, 1.3])
    logits = torch.randn(int(2 * ks.sum() + len(ks)), 300, generator=gen) * 3
    rows = torch.cat([torch.full((2 * k + 1,), float(t)) for k, t in zip(ks.tolist(), temps.tolist())])
    mine, avx2 = torch.ops.pdserve.temperature_probs(logits, rows), ops.temperature_probs(logits, rows)
    torch.testing.assert_close(avx2, mine, rtol=1e-5, atol=1e-7)
    p, q, drafts, start = [], [], [], 0
    for k in ks.tolist():  # per sequence: k + 1 target rows, then k draft rows and a draft from each
        p.append(mine[start:start + k + 1])
        q.append(mine[start + k + 1:start + 2 * k + 1])
        drafts.append(torch.multinomial(q[-1], 1, generator=gen).view(-1))
        start += 2 * k + 1
    args = (torch.cat(p), torch.cat(q), torch.cat(drafts), ks, rng.seed_words([5, 6, 7, 2**63 + 1]),
            torch.tensor([10, 200, 3, 4000]), temps, rng.vocab_codes(300))
    accepted, last = torch.ops.pdserve.rejection_rows(*args)
    avx2_accepted, avx2_last = ops.rejection_rows(*args)
    assert accepted.tolist() == avx2_accepted.tolist() and last.tolist() == avx2_last.tolist()
