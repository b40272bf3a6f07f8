"""The native CPU attention (`kernels/cpu/paged_attention.cpp`) against dense causal attention,
its K/V write against the reference write, and its refusals of malformed steps."""
from __future__ import annotations

import pytest
import torch
from paged_kv_cases import assert_matches_dense, make_paged_kv

from pdserve.kernels import native
from pdserve.kernels.gathered_attention import gathered_attention, plan_gather
from pdserve.kernels.kv_write import write_kv_ref

BLOCK_SIZE = 16
CASES = {  # (context_lens, query_lens)
    "decode-one": ([33], [1]),
    "decode-ragged": ([1, 16, 17, 40], [1, 1, 1, 1]),
    "verify": ([20, 37, 9], [5, 5, 5]),
    "verify-ragged": ([20, 37, 9, 3], [5, 1, 3, 2]),  # adaptive depth: each sequence its own query count
    "long": ([700, 5], [2, 5]),  # many blocks; a context that is all queries
    # prefill chunks (step_inputs.MAX_NATIVE_SCORES): a fresh prompt, whose rows skip the keys the
    # causal mask hides, beside a later chunk of another prompt and a decode token
    "prefill": ([100, 83, 40], [100, 37, 1]),
    # chunks whose scores per KV head pass the op's tile (2^18 floats at 2 or more heads per KV
    # head): their queries run in tiles, a fresh prompt's and a later chunk's
    "tiled": ([420, 900, 7], [420, 300, 1]),
}


def test_native_attention_builds():
    """Where torch.compile works (a C++ compiler), this builds too: a failure here is a real one."""
    assert native.load(), native.error()


def _step(context_lens, query_lens, num_heads, num_kv_heads, head_dim, dtype, seed=0, block_size=BLOCK_SIZE):
    """A step's new K/V (the last query_lens positions of each context) not yet in the cache,
    the cache holding the rest, and the slots the new rows go to."""
    k_dense, v_dense, k_cache, v_cache, tables = make_paged_kv(context_lens, num_kv_heads, head_dim, block_size,
                                                               dtype, "cpu", seed)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    k_new = torch.cat([k[len(k) - n:] for k, n in zip(k_dense, query_lens)])
    v_new = torch.cat([v[len(v) - n:] for v, n in zip(v_dense, query_lens)])
    slots = torch.tensor([int(tables[s, p // block_size]) * block_size + p % block_size
                          for s, (c, n) in enumerate(zip(context_lens, query_lens)) for p in range(c - n, c)])
    for cache in (k_cache, v_cache):  # the new rows are not in the cache yet
        cache.view(-1, num_kv_heads, head_dim)[slots] = 7.0
    return q, k_new, v_new, k_dense, v_dense, k_cache, v_cache, tables, slots


def _native(q, k, v, k_cache, v_cache, tables, slots, context_lens, query_lens, scale=0.2, block_size=BLOCK_SIZE):
    plan = plan_gather(tables, context_lens, query_lens, block_size, native=True)
    return torch.ops.pdserve.paged_attention_cpu(q, k, v, k_cache, v_cache, slots, plan.block_ids,
                                                  plan.context_lens, plan.query_starts, scale)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(2, 2, 32), (8, 2, 64), (6, 3, 24)])
def test_native_matches_dense_attention(case, num_heads, num_kv_heads, head_dim):
    context_lens, query_lens = CASES[case]
    q, k, v, k_dense, v_dense, k_cache, v_cache, tables, slots = _step(context_lens, query_lens, num_heads,
                                                                        num_kv_heads, head_dim, torch.float32)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    write_kv_ref(k, v, expected_k, expected_v, slots)
    out = _native(q, k, v, k_cache, v_cache, tables, slots, context_lens, query_lens)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    assert_matches_dense(out, q, k_dense, v_dense, query_lens, 0.2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_gives_the_same_bits_on_any_number_of_threads(dtype):
    """A prefill chunk is split into work items by KV head (a long one by tiles of queries too)
    and the items spread over torch's threads (the library is built with OpenMP: without it
    at::parallel_for ran everything on the calling thread); each output is computed by one item
    in one order, so the bits do not depend on the thread count."""
    assert native.load(), native.error()
    assert b"GOMP_parallel" in native.library_path().read_bytes()  # built with OpenMP
    context_lens, query_lens = [600, 83, 40, 17], [600, 37, 1, 17]  # the 600-token prompt in tiles too
    q, k, v, k_dense, v_dense, k_cache, v_cache, tables, slots = _step(context_lens, query_lens, 8, 4, 32, dtype,
                                                                        seed=5)
    outs = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(_native(q, k, v, k_cache.clone(), v_cache.clone(), tables, slots, context_lens, query_lens))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    # bfloat16: q, K and V are bfloat16 values (the dense reference takes them as they are), the
    # output is rounded to bfloat16
    assert_matches_dense(outs[0].float(), q.float(), [k.float() for k in k_dense], [v.float() for v in v_dense],
                         query_lens, 0.2, tol=1e-5 if dtype == torch.float32 else 1e-2)


def _rounded_cache_step(case, num_heads, num_kv_heads, head_dim, cache_dtype, seed=0):
    """A float32 step over a 16-bit cache (`EngineConfig.kv_cache_dtype`), and its float32 twin:
    the same step over float32 caches that hold the 16-bit values, the new K/V rounded as the
    16-bit cache will hold them."""
    context_lens, query_lens = CASES[case]
    q, k, v, _, _, k_cache, v_cache, tables, slots = _step(context_lens, query_lens, num_heads, num_kv_heads,
                                                           head_dim, torch.float32, seed=seed)
    narrow = (k_cache.to(cache_dtype), v_cache.to(cache_dtype))
    twin = (narrow[0].float(), narrow[1].float())
    rounded = (k.to(cache_dtype).float(), v.to(cache_dtype).float())
    return context_lens, query_lens, q, (k, v), rounded, narrow, twin, tables, slots


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(8, 4, 32), (4, 1, 64), (6, 3, 24)])
def test_a_16_bit_cache_under_float32_rows_is_the_float32_op_on_rounded_values(cache_dtype, num_heads, num_kv_heads,
                                                                                 head_dim):
    """K and V are rounded once, when written (to nearest even, as torch's `.to()`: the torch
    path's caches hold the same bits), and read back widened: the output is the float32 op's on
    a float32 cache holding those values, bit for bit, decode, verification, prefill and tiles
    alike (the vector loops widen whole blocks for decode items, one head's rows for a prefill's)."""
    for case in CASES:
        context_lens, query_lens, q, (k, v), rounded, narrow, twin, tables, slots = _rounded_cache_step(
            case, num_heads, num_kv_heads, head_dim, cache_dtype)
        expected_k, expected_v = narrow[0].clone(), narrow[1].clone()
        write_kv_ref(k, v, expected_k, expected_v, slots)
        out = _native(q, k, v, *narrow, tables, slots, context_lens, query_lens)
        assert out.dtype == torch.float32
        assert torch.equal(narrow[0], expected_k) and torch.equal(narrow[1], expected_v), case
        assert torch.equal(out, _native(q, *rounded, *twin, tables, slots, context_lens, query_lens)), case


def test_a_float16_cache_saturates_what_it_cannot_hold_on_both_paths():
    """K or V beyond float16's range are written as its largest finite value, by the native op
    and the torch write alike: an infinity would outlive its request in the block, and padded
    rows of later requests read stale slots (0 x inf is NaN)."""
    context_lens, query_lens, q, (k, v), _, narrow, _, tables, slots = _rounded_cache_step(
        "verify", 8, 4, 32, torch.float16)
    k, v = k.clone(), v.clone()
    k[0, 0, :4] = torch.tensor([1e6, -1e6, 70000.0, float("inf")])
    v[1, 1, :2] = torch.tensor([-3e5, 65520.0])  # 65520 rounds to infinity in a plain cast
    expected_k, expected_v = narrow[0].clone(), narrow[1].clone()
    write_kv_ref(k, v, expected_k, expected_v, slots)
    out = _native(q, k, v, *narrow, tables, slots, context_lens, query_lens)
    assert torch.equal(narrow[0], expected_k) and torch.equal(narrow[1], expected_v)
    assert torch.isfinite(narrow[0]).all() and torch.isfinite(narrow[1]).all()
    row = narrow[0].view(-1, 4, 32)[slots[0], 0, :4].tolist()
    assert row == [65504.0, -65504.0, 65504.0, 65504.0]
    assert narrow[1].view(-1, 4, 32)[slots[1], 1, :2].tolist() == [-65504.0, 65504.0]
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("block_size", [8, 32, 48])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(8, 4, 32), (4, 1, 64)])
def test_native_matches_dense_attention_other_block_sizes(block_size, num_heads, num_kv_heads, head_dim):
    """Blocks shorter than the vector loops' sixteen keys, and blocks of several sixteens and a rest."""
    for case in ("verify-ragged", "long", "prefill"):
        context_lens, query_lens = CASES[case]
        q, k, v, k_dense, v_dense, k_cache, v_cache, tables, slots = _step(
            context_lens, query_lens, num_heads, num_kv_heads, head_dim, torch.float32, block_size=block_size)
        out = _native(q, k, v, k_cache, v_cache, tables, slots, context_lens, query_lens, block_size=block_size)
        assert_matches_dense(out, q, k_dense, v_dense, query_lens, 0.2)


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx2", "plain"])
def test_narrower_instruction_sets_match_dense_attention(isa, native_variant):
    """The AVX2 and plain loops, which a CPU with AVX-512 never runs: the same source built
    again without those instructions (`native_variants.py`), under a namespace of its own
    beside the loaded library."""
    op = native_variant({"avx2": "pdserve_test_decoder_avx2", "plain": "pdserve_test_plain"}[isa]).paged_attention_cpu
    for case in CASES:
        for num_heads, num_kv_heads, head_dim in [(8, 4, 32), (4, 1, 64), (6, 3, 24)]:
            context_lens, query_lens = CASES[case]
            q, k, v, k_dense, v_dense, k_cache, v_cache, tables, slots = _step(
                context_lens, query_lens, num_heads, num_kv_heads, head_dim, torch.float32)
            plan = plan_gather(tables, context_lens, query_lens, BLOCK_SIZE, native=True)
            out = op(q, k, v, k_cache, v_cache, slots, plan.block_ids, plan.context_lens, plan.query_starts, 0.2)
            assert_matches_dense(out, q, k_dense, v_dense, query_lens, 0.2)
    for case in CASES:  # a bfloat16 cache, widened by the plain loop
        context_lens, query_lens, q, (k, v), rounded, narrow, twin, tables, slots = _rounded_cache_step(
            case, 8, 4, 32, torch.bfloat16)
        plan = plan_gather(tables, context_lens, query_lens, BLOCK_SIZE, native=True)
        expected = _native(q, *rounded, *twin, tables, slots, context_lens, query_lens)
        out = op(q, k, v, *narrow, slots, plan.block_ids, plan.context_lens, plan.query_starts, 0.2)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_matches_gathered_attention(dtype):
    """Strided q/k/v (slices of one fused projection, as the model passes them), both dtypes."""
    context_lens, query_lens = CASES["verify-ragged"]
    q, k, v, _, _, k_cache, v_cache, tables, slots = _step(context_lens, query_lens, 8, 2, 32, dtype, seed=3)
    qkv = torch.cat([q, k, v], dim=1)  # [tokens, 8 + 2 + 2, 32]
    q_s, k_s, v_s = qkv[:, :8], qkv[:, 8:10], qkv[:, 10:]
    assert not q_s.is_contiguous()
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    write_kv_ref(k, v, ref_k, ref_v, slots)
    expected = gathered_attention(q, ref_k, ref_v, plan_gather(tables, context_lens, query_lens, BLOCK_SIZE), 0.2)
    out = _native(q_s, k_s, v_s, k_cache, v_cache, tables, slots, context_lens, query_lens)
    assert out.dtype == dtype
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out, expected, **tol)


def test_native_runs_under_torch_compile():
    """One graph for every step: sizes marked unbacked, the op opaque to the tracer."""
    context_lens, query_lens = CASES["verify-ragged"]
    q, k, v, _, _, k_cache, v_cache, tables, slots = _step(context_lens, query_lens, 4, 2, 32, torch.float32)
    plan = plan_gather(tables, context_lens, query_lens, BLOCK_SIZE, native=True)
    fn = torch.compile(lambda *a: torch.ops.pdserve.paged_attention_cpu(*a, 0.2) * 2, fullgraph=True)
    args = (q, k, v, k_cache.clone(), v_cache.clone(), slots, plan.block_ids, plan.context_lens, plan.query_starts)
    for t, dim in ((q, 0), (k, 0), (v, 0), (slots, 0), (plan.block_ids, 0), (plan.context_lens, 0),
                   (plan.query_starts, 0)):
        torch._dynamo.decorators.mark_unbacked(t, dim)
    torch.testing.assert_close(fn(*args), 2 * _native(q, k, v, k_cache, v_cache, tables, slots, context_lens,
                                                      query_lens))


def test_native_refuses_malformed_steps():
    context_lens, query_lens = CASES["verify"]
    q, k, v, _, _, k_cache, v_cache, tables, slots = _step(context_lens, query_lens, 2, 2, 32, torch.float32)
    plan = plan_gather(tables, context_lens, query_lens, BLOCK_SIZE, native=True)
    op = torch.ops.pdserve.paged_attention_cpu
    base = [q, k, v, k_cache, v_cache, slots, plan.block_ids, plan.context_lens, plan.query_starts, 0.2]

    def call(i, value):
        args = list(base)
        args[i] = value
        return op(*args)

    with pytest.raises(RuntimeError, match="slot"):
        call(5, slots + 10 ** 6)
    with pytest.raises(RuntimeError, match="block"):
        call(6, plan.block_ids + 10 ** 6)
    with pytest.raises(RuntimeError, match="does not fit"):
        call(7, plan.context_lens + 10 ** 4)  # more context than the block table holds
    with pytest.raises(RuntimeError, match="query_starts"):
        call(8, plan.query_starts - 1)
    with pytest.raises(RuntimeError, match="query_starts"):  # rows before the first would be read
        call(8, torch.cat([plan.query_starts[:1] - 5, plan.query_starts[1:]]))
    with pytest.raises(RuntimeError, match="does not fit"):  # a sequence with fewer than no queries
        call(8, plan.query_starts[[0, 2, 1, 3]])
    with pytest.raises(RuntimeError, match="head counts"):  # fewer K heads than the cache rows hold
        call(1, k[:, :1])
    with pytest.raises(RuntimeError, match="differ in shape"):
        call(4, v_cache[:-1])
    with pytest.raises(RuntimeError, match="dtype"):
        call(0, q.double())
    with pytest.raises(RuntimeError, match="dtype"):  # a cache wider than the rows
        op(q.bfloat16(), k.bfloat16(), v.bfloat16(), *base[3:])
    with pytest.raises(RuntimeError, match="dtype"):  # K and V caches of two dtypes
        call(3, k_cache.bfloat16())
    with pytest.raises(RuntimeError, match="int64"):
        call(5, slots.int())


def test_native_noise_hash_is_the_torch_hash_bit_for_bit():
    """`hash_uniforms` in C++ (`cpu/noise.cpp`) against `engine.rng.hash_uniforms`: every bit, over
    random keys (both halves' signs) and vocabulary sizes that do and do not fill a vector; and the
    sampler uses it where the native ops are loaded."""
    from pdserve.engine import rng
    from pdserve.engine.sampler import Sampler
    from pdserve.kernels import TORCH_OPS, native

    assert native.load(), native.error()
    gen = torch.Generator().manual_seed(3)
    for rows, vocab in ((1, 1), (3, 17), (40, 4096), (5, 32003)):
        keys = torch.randint(-2**31, 2**31, (rows, 2), dtype=torch.int64, generator=gen).to(torch.int32)
        codes = rng._vocab_codes(vocab, "cpu")
        want = rng.hash_uniforms(keys, codes)
        got = torch.ops.pdserve.hash_uniforms(keys, codes)
        assert got.dtype == torch.float32 and got.shape == (rows, vocab)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    sampler = Sampler(TORCH_OPS, torch.device("cpu"))
    assert isinstance(sampler.hash_fn, rng.NativeHash)
    seeds, positions = [7, 8, 9], [100, 5, 77]
    assert torch.equal(rng.exponentials(seeds, positions, 4096, hash_fn=sampler.hash_fn),
                       rng.exponentials(seeds, positions, 4096))


def test_native_row_keys_are_rng_row_keys_bit_for_bit():
    """`hash_rows` makes each row's key natively (`cpu/noise.cpp`), as `rng.row_key` does in
    Python: seeds negative, past 2^63 and past 2^64 (Python's masked arithmetic), every stream,
    positions up to 2^40; the sampler's exponentials through it are the torch path's bit for
    bit, an empty batch included; and a negative position is refused, not hashed."""
    from pdserve.engine import rng
    from pdserve.kernels import native

    assert native.load(), native.error()
    native_hash = rng.NativeHash()
    seeds = [0, 1, -1, -5, 2**63 - 1, 2**63, 2**64 - 1, 2**70 + 3, 123456789]
    positions = [0, 1, 7, 2**40, 99, 5, 4095, 17, 100]
    streams = [rng.SAMPLE_STREAM, rng.ACCEPT_STREAM, rng.RESIDUAL_STREAM, rng.DRAFT_STREAM, 0, 1, 2, 3, 0]
    for vocab in (1, 17, 4096):
        got = rng.exponentials(seeds, positions, vocab, streams, hash_fn=native_hash)
        want = rng.exponentials(seeds, positions, vocab, streams)
        assert got.shape == (len(seeds), vocab)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert rng.exponentials([], [], 8, hash_fn=native_hash).shape == (0, 8)
    with pytest.raises(RuntimeError, match="negative position"):
        native_hash.rows(torch.tensor([[1, -1, 0]]), rng._vocab_codes(8, "cpu"))
