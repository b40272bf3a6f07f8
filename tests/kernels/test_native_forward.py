"""A step's forward in one native call (`pdserve::decoder_forward`, `kernels/cpu/decoder.cpp`,
through `native_forward.NativeForward`) against the model's own forward: for steps of short chunks
(decode tokens beside verification chunks, sequences at different positions, crossing a block)
the same logits to float rounding and the same greedy picks, and the same K/V in the cache; the
same for a step of two fresh prompts, on one thread and two, and for a prompt long enough that its
attention runs in tiles; a chunk past a bound set on native plans is left to the model. Three architectures, as the draft's
native passes are tested. Malformed calls are refused with the reason. (Greedy decoding through
the whole engine, which now runs its decode steps this way with default options, is checked token
for token against transformers in tests/engine.)"""
from __future__ import annotations

import pytest
import torch

from pdserve.engine.native_forward import NativeForward
from pdserve.engine.model_runner import BatchEntry, ModelRunner
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence
from native_models import native_runner, require_avx2_fma

BLOCK_SIZE = 16
PROMPT_LENS = (37, 16, 5, 14)
NEW_TOKENS = (1, 3, 5, 4)  # a decode token beside verification chunks; 16 + 3 starts a block, 14 + 4 crosses one


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def runner(request, checkpoint):
    return native_runner(checkpoint, request.param, seed=7, num_blocks=24, block_size=BLOCK_SIZE)


def _sequences(runner: ModelRunner) -> list[Sequence]:
    gen = torch.Generator().manual_seed(3)
    seqs = []
    for i, (n, extra) in enumerate(zip(PROMPT_LENS, NEW_TOKENS)):
        ids = torch.randint(0, runner.cfg.vocab_size, (n + extra,), generator=gen).tolist()
        seqs.append(Sequence(f"s{i}", ids, SamplingParams(), seed=i, block_table=list(range(6 * i, 6 * i + 6))))
    return seqs


def _run(runner: ModelRunner, batch: list[BatchEntry], native_forward, caches, callback=None) -> torch.Tensor:
    runner.native_forward = native_forward
    for (k, v), (k0, v0) in zip(runner.kv_caches, caches):
        k.copy_(k0), v.copy_(v0)
    return runner.execute(batch, callback)


def _native_against_model(runner: ModelRunner, batch: list[BatchEntry], caches, callback=None):
    """The step from the same caches through the native forward (which must take it, once) and
    through the model: the native logits and cache, and the model's logits; the runner's caches
    are left holding the model's."""
    native_forward, calls = runner.native_forward, []
    counted = lambda step, cb=None: calls.append(step) or native_forward(step, cb)  # noqa: E731
    counted.covers = native_forward.covers
    try:
        mine = _run(runner, batch, counted, caches, callback)
        mine_cache = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
        theirs = _run(runner, batch, None, caches)
    finally:
        runner.native_forward = native_forward
    assert len(calls) == 1
    return mine, mine_cache, theirs


def _assert_the_models(runner: ModelRunner, mine, mine_cache, theirs) -> None:
    """The model's logits to float rounding, its greedy picks, and its K/V (the runner's caches)."""
    torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    assert mine.argmax(-1).tolist() == theirs.argmax(-1).tolist()
    for (k1, v1), (k2, v2) in zip(mine_cache, runner.kv_caches):
        torch.testing.assert_close(k1, k2, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v1, v2, rtol=1e-4, atol=1e-5)


def test_native_forward_gives_the_models_logits_and_cache(runner):
    native_forward = runner.native_forward
    assert isinstance(native_forward, NativeForward)
    seqs = _sequences(runner)
    try:  # the prompts (but each step's new tokens) in the cache, through the model
        runner.native_forward = None
        with torch.inference_mode():
            runner.execute([BatchEntry(s, n, 1, start=0) for s, n in zip(seqs, PROMPT_LENS)])
    finally:
        runner.native_forward = native_forward
    cache = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    batch = [BatchEntry(s, extra, extra, start=n) for s, n, extra in zip(seqs, PROMPT_LENS, NEW_TOKENS)]
    mine, mine_cache, theirs = _native_against_model(runner, batch, cache)
    assert mine.shape == (sum(NEW_TOKENS), runner.cfg.vocab_size)
    _assert_the_models(runner, mine, mine_cache, theirs)
    written = [(s.block_table[p // BLOCK_SIZE], p % BLOCK_SIZE)
               for s, n, extra in zip(seqs, PROMPT_LENS, NEW_TOKENS) for p in range(n, n + extra)]
    assert all(mine_cache[0][0][b, o].abs().sum() > 0 for b, o in written)  # every new token's K/V written


def test_the_avx2_build_gives_the_loaded_builds_hidden_states(runner, native_variant):
    """decoder.cpp built without AVX-512 (its norms, SwiGLU, projections and attention in AVX2
    lanes, which a CPU with AVX-512 never runs) against the loaded build, on a step of a decode
    token beside verification chunks: the same final-norm outputs to float rounding."""
    require_avx2_fma()
    ops = native_variant("pdserve_test_decoder_avx2")
    nf, seqs = runner.native_forward, _sequences(runner)
    with torch.inference_mode():
        runner.native_forward = None
        try:
            runner.execute([BatchEntry(s, n, 1, start=0) for s, n in zip(seqs, PROMPT_LENS)])
        finally:
            runner.native_forward = nf
    cache = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    step = runner.inputs.build([BatchEntry(s, extra, extra, start=n)
                                for s, n, extra in zip(seqs, PROMPT_LENS, NEW_TOKENS)])
    plan, (heads, kv_heads, eps, scale) = step.meta.plan, nf.shape

    def forward(op):
        for (k, v), (k0, v0) in zip(runner.kv_caches, cache):
            k.copy_(k0), v.copy_(v0)
        with torch.inference_mode():
            out = op(step.input_ids, step.positions, step.meta.slot_mapping, plan.block_ids, plan.context_lens,
                     plan.query_starts, nf.weights, nf.caches, nf.cos, nf.sin, heads, kv_heads, eps, scale)
        return out, [(k.clone(), v.clone()) for k, v in runner.kv_caches]

    (mine, mine_cache), (avx2, avx2_cache) = forward(torch.ops.pdserve.decoder_forward), forward(ops.decoder_forward)
    assert avx2.shape == mine.shape == (sum(NEW_TOKENS), runner.cfg.hidden_size)
    torch.testing.assert_close(avx2, mine, rtol=1e-4, atol=1e-4)
    for (k1, v1), (k2, v2) in zip(avx2_cache, mine_cache):
        torch.testing.assert_close(k1, k2, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v1, v2, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_prefill_step_gives_the_models_logits_and_cache(runner, threads):
    """Two fresh prompts of 70 and 40 tokens in one step (110 rows: with two threads the row
    loops split between them, as the projections and the attention do), each scoring its last
    row: the model's logits and K/V, through one native call."""
    gen = torch.Generator().manual_seed(11)
    seqs = [Sequence(f"p{i}", torch.randint(0, runner.cfg.vocab_size, (n,), generator=gen).tolist(), SamplingParams(),
                     seed=i, block_table=list(range(6 * i, 6 * i + 6))) for i, n in enumerate((70, 40))]
    batch = [BatchEntry(s, len(s.prompt_token_ids), 1, start=0) for s in seqs]
    empty = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in runner.kv_caches]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        mine, mine_cache, theirs = _native_against_model(runner, batch, empty)
    finally:
        torch.set_num_threads(before)
    assert mine.shape == (2, runner.cfg.vocab_size)
    _assert_the_models(runner, mine, mine_cache, theirs)


def test_a_long_prompt_whose_attention_runs_in_tiles_gives_the_models_logits_and_cache(checkpoint):
    """A fresh 500-token prompt on the tiny model (2 heads per KV head): its scores per KV head,
    2 x 500 x 500 floats, pass `paged_attention_cpu`'s tile (2^18), so its queries run in tiles,
    spread over two threads. Every row's logits (each tile's rows) and the K/V are the model's."""
    runner = native_runner(checkpoint, "llama", seed=7, num_blocks=32, block_size=BLOCK_SIZE)
    heads_per_kv = runner.cfg.num_heads // runner.cfg.num_kv_heads
    assert heads_per_kv * 500 * 500 > 1 << 18  # more than one tile of queries
    gen = torch.Generator().manual_seed(13)
    seq = Sequence("long", torch.randint(0, runner.cfg.vocab_size, (500,), generator=gen).tolist(), SamplingParams(),
                   seed=0, block_table=list(range(32)))
    empty = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in runner.kv_caches]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        mine, mine_cache, theirs = _native_against_model(runner, [BatchEntry(seq, 500, 500, start=0)], empty)
    finally:
        torch.set_num_threads(before)
    assert mine.shape == (500, runner.cfg.vocab_size)
    _assert_the_models(runner, mine, mine_cache, theirs)


def test_a_prefill_streamed_layer_by_layer_gives_each_layers_cache_before_the_next_starts(runner):
    """With a layer callback (a prefill worker's KV streaming) the native forward runs layer by
    layer (`pdserve::decoder_layer`): callback i finds layer i's K/V of every new token in the
    cache and layer i + 1's not yet written; the logits and the cache are the model's."""
    gen = torch.Generator().manual_seed(12)
    seq = Sequence("p", torch.randint(0, runner.cfg.vocab_size, (45,), generator=gen).tolist(), SamplingParams(),
                   seed=0, block_table=[0, 1, 2])
    batch = [BatchEntry(seq, 45, 1, start=0)]
    empty = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in runner.kv_caches]
    slots = torch.arange(45)  # blocks 0-2, in order
    seen = []

    def callback(layer: int) -> None:
        written = [bool((k.view(-1, *k.shape[2:])[slots].abs().sum((1, 2)) > 0).all()) for k, _ in runner.kv_caches]
        seen.append((layer, written))

    mine, mine_cache, theirs = _native_against_model(runner, batch, empty, callback)
    num_layers = runner.cfg.num_layers
    assert [layer for layer, _ in seen] == list(range(num_layers))
    assert all(written == [i <= layer for i in range(num_layers)] for layer, written in seen)
    _assert_the_models(runner, mine, mine_cache, theirs)


def test_a_chunk_past_the_native_attentions_scores_is_left_to_the_model(runner):
    """Where native plans are bounded (`max_native_scores`; by default they are not), a prefill
    chunk whose scores per KV head exceed the bound gets no native plan, and the step goes to the
    model (its own chunked attention); a short one is native."""
    seq = Sequence("long", list(range(3, 3 + 40)), SamplingParams(), seed=0, block_table=[0, 1, 2])
    short = Sequence("short", [5, 6, 7], SamplingParams(), seed=1, block_table=[3])
    limit = runner.inputs.max_native_scores
    runner.inputs.max_native_scores = runner.cfg.num_heads // runner.cfg.num_kv_heads * 40 * 40 - 1
    try:
        long_step = runner.inputs.build([BatchEntry(seq, 40, 1, start=0)])
        assert long_step.meta.plan is None and not runner.native_forward.covers(long_step)
        assert runner.native_forward.covers(runner.inputs.build([BatchEntry(short, 3, 1, start=0)]))
    finally:
        runner.inputs.max_native_scores = limit
    assert runner.native_forward.covers(runner.inputs.build([BatchEntry(seq, 40, 1, start=0)]))


def test_malformed_calls_are_refused_with_the_reason(runner):
    nf = runner.native_forward
    short = Sequence("short", [5, 6, 7], SamplingParams(), seed=1, block_table=[3])
    step = runner.inputs.build([BatchEntry(short, 3, 1, start=0)])
    plan, (heads, kv_heads, eps, scale) = step.meta.plan, nf.shape

    def call(input_ids=step.input_ids, positions=step.positions, weights=nf.weights):
        with torch.inference_mode():
            return torch.ops.pdserve.decoder_forward(input_ids, positions, step.meta.slot_mapping, plan.block_ids,
                                                     plan.context_lens, plan.query_starts, weights, nf.caches,
                                                     nf.cos, nf.sin, heads, kv_heads, eps, scale)

    assert call().shape == (3, runner.cfg.hidden_size)
    with pytest.raises(RuntimeError, match="token .* out of range"):
        call(input_ids=torch.tensor([5, runner.cfg.vocab_size, 7]))
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        call(positions=torch.tensor([0, 1, 1 << 30]))
    with pytest.raises(RuntimeError, match="one per row"):
        call(positions=step.positions[:2])
    with pytest.raises(RuntimeError, match="do not make a model"):
        call(weights=nf.weights[:-1])

    def layer(residual, index=0, workspace=None):
        workspace = torch.empty(len(residual) * nf.scratch_per_row) if workspace is None else workspace
        with torch.inference_mode():
            torch.ops.pdserve.decoder_layer(residual, workspace, step.positions, step.meta.slot_mapping, plan.block_ids,
                                            plan.context_lens, plan.query_starts, nf.weights, nf.caches, nf.cos,
                                            nf.sin, heads, kv_heads, eps, scale, index)

    hidden = runner.cfg.hidden_size
    layer(torch.zeros(3, hidden))
    with pytest.raises(RuntimeError, match=f"layer {runner.cfg.num_layers} of a model of {runner.cfg.num_layers}"):
        layer(torch.zeros(3, hidden), runner.cfg.num_layers)
    with pytest.raises(RuntimeError, match="residual must be a contiguous float32"):
        layer(torch.zeros(3, hidden + 1))
    with pytest.raises(RuntimeError, match="one per row"):
        layer(torch.zeros(2, hidden))
    with pytest.raises(RuntimeError, match="workspace must be a contiguous float32"):
        layer(torch.zeros(3, hidden), workspace=torch.empty(3 * nf.scratch_per_row - 1))
