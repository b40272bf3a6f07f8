"""The native float32 projections (`kernels/cpu/linear.cpp`) against `F.linear`: every row count
the loops split differently (one row, one pass of up to six rows, passes made even), output widths that end mid-panel,
biases, threads, the AVX2 loops and the build with neither (built again with narrower flags),
torch.compile, and refusals of malformed calls. Weights that are bfloat16 values packed in
bfloat16 give the float32 panels' results bit for bit in every build, except for the row counts
that take the tile path (`cpu/linear_amx.h`, a CPU with AMX), which are tested against float64
sums and for rows that do not depend on the rows beside them."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import native
from native_models import require_avx2_fma

# (out_features, in_features): the demo target's shapes, and widths that end mid-panel and mid-vector
SHAPES = [(512, 256), (4096, 256), (256, 768), (100, 37), (65, 3), (1, 1), (130, 300)]
ROWS = [0, 1, 2, 5, 6, 7, 12, 13, 40]


@pytest.fixture
def vector():
    assert native.load(), native.error()
    if not torch.ops.pdserve.linear_packed_available():
        pytest.skip("this CPU has neither AVX-512 nor AVX2: the engine keeps nn.Linear (the fallback is tested below)")


def _check(op_pack, op_linear, shapes=SHAPES, rows=ROWS):
    gen = torch.Generator().manual_seed(0)
    for n, k in shapes:
        w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
        packed = op_pack(w)
        assert packed.shape == (-(-n // 64), k, 64)
        for m in rows:
            x = torch.randn(m, k, generator=gen)
            for bias in (None, b):
                torch.testing.assert_close(op_linear(x, packed, bias, n), F.linear(x, w, bias), rtol=1e-5, atol=1e-4)


def _check_bfloat16(op_pack, op_linear, shapes=SHAPES, rows=ROWS, tiles=lambda m: False):
    """bfloat16 panels of weights that are bfloat16 values: the float32 panels' outputs exactly
    (the widening is exact and the sums run in the same order), whatever the row count, except
    where `tiles(m)` (the tile path sums in another order: `test_tile_path_*`)."""
    gen = torch.Generator().manual_seed(1)
    for n, k in shapes:
        w, b = torch.randn(n, k, generator=gen).bfloat16(), torch.randn(n, generator=gen)
        half, full = op_pack(w), op_pack(w.float())
        assert half.dtype == torch.bfloat16 and half.shape == full.shape == (-(-n // 64), k, 64)
        for m in rows:
            x = torch.randn(m, k, generator=gen)
            for bias in (None, b):
                out = op_linear(x, half, bias, n)
                if not tiles(m):
                    assert torch.equal(out, op_linear(x, full, bias, n)), (n, k, m, bias is None)
                torch.testing.assert_close(out, F.linear(x, w.float(), bias), rtol=1e-5, atol=1e-4)


def test_packed_linear_matches_f_linear(vector):
    _check(torch.ops.pdserve.linear_pack, torch.ops.pdserve.linear_packed)


def test_bfloat16_panels_give_the_float32_panels_results_bit_for_bit(vector):
    rows = ROWS + [3, 4, 8, 18, 32, 64]
    _check_bfloat16(torch.ops.pdserve.linear_pack, torch.ops.pdserve.linear_packed, rows=rows,
                    tiles=torch.ops.pdserve.linear_tile_rows)
    before = torch.ops.pdserve.linear_use_tiles(False)  # the vector loops at every row count
    try:
        assert not any(torch.ops.pdserve.linear_tile_rows(m) for m in rows)
        _check_bfloat16(torch.ops.pdserve.linear_pack, torch.ops.pdserve.linear_packed, rows=rows)
    finally:
        torch.ops.pdserve.linear_use_tiles(before)


def _cpu_has_amx() -> bool:
    with open("/proc/cpuinfo") as f:
        return any(line.startswith("flags") and "amx_bf16" in line.split() for line in f)


@pytest.fixture
def tiles(vector):
    if not _cpu_has_amx():
        pytest.skip("this CPU has no AMX: bfloat16 panels take the vector loops at every row count")
    # a CPU with AMX and a Linux that lets a process use it (5.16 and later): the path must be on
    assert torch.ops.pdserve.linear_tile_rows(7) and torch.ops.pdserve.linear_tile_rows(160)
    assert not torch.ops.pdserve.linear_tile_rows(6)  # a batch-1 verification at k <= 5: the vector loops


def test_tile_path_sums_as_closely_as_the_vector_loops(tiles):
    """Each float32 x is split exactly into three bfloat16, so the tile path's error against
    float64 sums is float32 rounding's, as the vector loops' is: checked against both."""
    gen = torch.Generator().manual_seed(2)
    for n, k in SHAPES + [(768, 256), (33, 31)]:
        w, b = (torch.randn(n, k, generator=gen) * 0.05).bfloat16(), torch.randn(n, generator=gen)
        half, full = torch.ops.pdserve.linear_pack(w), torch.ops.pdserve.linear_pack(w.float())
        for m in (7, 8, 16, 32, 64, 100, 160):
            assert torch.ops.pdserve.linear_tile_rows(m), m
            x = torch.randn(m, k, generator=gen) * torch.logspace(-3, 3, k, dtype=torch.float32)  # every magnitude
            exact = F.linear(x.double(), w.double(), b.double())
            tile = torch.ops.pdserve.linear_packed(x, half, b, n).double()
            loops = torch.ops.pdserve.linear_packed(x, full, b, n).double()
            # what the sums' rounding scales with
            scale = F.linear(x.double().abs(), w.double().abs(), b.double().abs()).clamp_min(1e-30)
            tile_err, loop_err = ((tile - exact).abs() / scale).max().item(), ((loops - exact).abs() / scale).max().item()
            assert tile_err < 4 * (k + 1) * 2.0 ** -24, (n, k, m, tile_err)
            assert tile_err <= 4 * max(loop_err, 2.0 ** -24), (n, k, m, tile_err, loop_err)


def test_tile_path_rows_do_not_depend_on_the_rows_beside_them(tiles):
    """A row's output on the tile path is the same bits in a batch of 32, 64 or 160 rows (as on
    the vector loops at any count): what makes a speculative verification's rows match plain
    decoding's at the same batch."""
    gen = torch.Generator().manual_seed(3)
    n, k = 768, 256
    w = torch.randn(n, k, generator=gen).bfloat16()
    packed = torch.ops.pdserve.linear_pack(w)
    x = torch.randn(160, k, generator=gen)
    whole = torch.ops.pdserve.linear_packed(x, packed, None, n)
    for m in (32, 64):
        assert torch.equal(torch.ops.pdserve.linear_packed(x[-m:].contiguous(), packed, None, n), whole[-m:])


def test_tile_copy_gives_the_bits_of_panels_rewritten_per_call(tiles):
    """`linear_pack` keeps a bfloat16 weight's panels in the tile unit's order past the panels
    (`with_tiled_copy`); a copy of the packed tensor has the panels alone, and the tile path
    rewrites them on every call (from more rows: `tiles_pay`). Both multiply the same tiles in
    the same order: the same bits. Below the copy's threshold it takes the vector loops, as a
    float32 panel does."""
    gen = torch.Generator().manual_seed(4)
    for n, k in [(512, 256), (256, 768), (100, 37), (130, 300)]:
        w, b = torch.randn(n, k, generator=gen).bfloat16(), torch.randn(n, generator=gen)
        packed = torch.ops.pdserve.linear_pack(w)
        copied, full = packed.clone(), torch.ops.pdserve.linear_pack(w.float())
        assert torch.equal(copied, packed) and copied.untyped_storage().nbytes() < packed.untyped_storage().nbytes()
        for m in (7, 8, 16, 32, 64, 160):
            x = torch.randn(m, k, generator=gen)
            out, of_copy = (torch.ops.pdserve.linear_packed(x, p, b, n) for p in (packed, copied))
            if m >= 10 * -(-m // 16) + 6:  # the copy's tile path (`tiles_pay`): a rewrite per call pays
                assert torch.equal(out, of_copy), (n, k, m)
            else:
                assert torch.equal(of_copy, torch.ops.pdserve.linear_packed(x, full, b, n)), (n, k, m)
            torch.testing.assert_close(out, F.linear(x, w.float(), b), rtol=1e-5, atol=1e-4)


def test_packed_linear_takes_any_weight_layout_and_leading_dims(vector):
    w = torch.randn(96, 80).t().contiguous().t()  # column-major, as the loader lays nn.Linear out
    x = torch.randn(2, 3, 80)
    out = torch.ops.pdserve.linear_packed(x, torch.ops.pdserve.linear_pack(w), None, 96)
    assert out.shape == (2, 3, 96)
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-4)
    strided = torch.randn(7, 160)[:, ::2]  # a non-contiguous x
    torch.testing.assert_close(torch.ops.pdserve.linear_packed(strided, torch.ops.pdserve.linear_pack(w), None, 96),
                               F.linear(strided, w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype,rows", [(torch.float32, 9), (torch.bfloat16, 9), (torch.bfloat16, 64)])
def test_packed_linear_same_result_with_two_threads(vector, dtype, rows):
    """Threads split the panels; each output column is computed by one thread, the same way (64
    rows of bfloat16 panels: the tile path where the CPU has AMX, each thread configuring its own
    tiles)."""
    w, x = torch.randn(1000, 256).to(dtype), torch.randn(rows, 256)
    packed = torch.ops.pdserve.linear_pack(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.pdserve.linear_packed(x, packed, None, 1000)
        torch.set_num_threads(2)
        two = torch.ops.pdserve.linear_packed(x, packed, None, 1000)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    torch.testing.assert_close(one, F.linear(x, w.float()), rtol=1e-5, atol=1e-4)


def test_packed_linear_runs_under_torch_compile(vector):
    w, b = torch.randn(200, 64), torch.randn(200)
    packed = torch.ops.pdserve.linear_pack(w)
    fn = torch.compile(lambda x: torch.ops.pdserve.linear_packed(x, packed, b, 200).relu(), fullgraph=True)
    for m in (3, 1, 17):
        x = torch.randn(m, 64)
        torch._dynamo.decorators.mark_unbacked(x, 0)
        torch.testing.assert_close(fn(x), F.linear(x, w, b).relu(), rtol=1e-5, atol=1e-4)


def test_avx2_loops_match_f_linear(native_variant):
    """The AVX2 loops, which a CPU with AVX-512 never runs: one row over the whole panel, more
    rows over its two halves, three at a time, then the one or two left."""
    require_avx2_fma()
    ops = native_variant("pdserve_test_decoder_avx2")  # built with -mno-avx512f (the decoder's build holds linear.cpp)
    assert ops.linear_packed_available()
    _check(ops.linear_pack, ops.linear_packed, shapes=SHAPES + [(40, 8), (33, 5)], rows=ROWS + [3, 4, 8])
    _check_bfloat16(ops.linear_pack, ops.linear_packed, shapes=SHAPES + [(40, 8), (33, 5)], rows=ROWS + [3, 4, 8])


def test_build_without_vector_loops_falls_back_to_the_blas(native_variant):
    """Built with neither AVX-512 nor AVX2 the op says it is unavailable (the engine then keeps
    nn.Linear) and still answers right, one BLAS call per panel."""
    ops = native_variant("pdserve_test_linear_plain")  # -mno-avx512f -mno-avx2 -mno-fma
    assert not ops.linear_packed_available()
    _check(ops.linear_pack, ops.linear_packed, shapes=SHAPES[3:], rows=[0, 1, 7])
    _check_bfloat16(ops.linear_pack, ops.linear_packed, shapes=SHAPES[3:], rows=[0, 1, 7])


def test_packed_linear_refuses_malformed_calls(vector):
    w = torch.randn(100, 32)
    packed = torch.ops.pdserve.linear_pack(w)
    op = torch.ops.pdserve.linear_packed
    with pytest.raises(RuntimeError, match=r"x must be float32 \[\.\.\., 32\]"):
        op(torch.randn(3, 31), packed, None, 100)
    with pytest.raises(RuntimeError, match="x must be float32"):
        op(torch.randn(3, 32).double(), packed, None, 100)
    with pytest.raises(RuntimeError, match="do not fit"):
        op(torch.randn(3, 32), packed, None, 200)
    with pytest.raises(RuntimeError, match="bias"):
        op(torch.randn(3, 32), packed, torch.randn(99), 100)
    with pytest.raises(RuntimeError, match="from linear_pack"):
        op(torch.randn(3, 32), w, None, 100)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.pdserve.linear_pack(w.double())
    with pytest.raises(RuntimeError, match="from linear_pack"):  # panels of another type
        op(torch.randn(3, 32), packed.half(), None, 100)
