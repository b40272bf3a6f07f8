"""The KV transfer's checksums and checked copies (`engine.kv_copy`): the native
one-pass copy-and-CRC (`kernels/cpu/kv_copy.cpp`) and the numpy/google-crc32c fallback give
google-crc32c's CRC-32C and numpy's copy, for every length and alignment, and refuse pieces
outside either side before copying a byte."""
from __future__ import annotations

import warnings

import google_crc32c
import numpy as np
import pytest

from pdserve.kernels import native
from pdserve.engine import kv_copy

# lengths around the three-lane rounds (3 x 256 and 3 x 4096 bytes) and the streaming-store path
LENGTHS = [0, 1, 7, 8, 9, 767, 768, 769, 3 * 4096 - 1, 3 * 4096 + 31, 3 * 4096 + 32, 5 * 12288 + 77, 200_003]


@pytest.fixture(params=["native", "fallback"])
def path(request, monkeypatch):
    if request.param == "native":
        assert native.load(), native.error()
    else:
        monkeypatch.setattr(native, "loaded", lambda: False)
    return request.param


def _expected(*parts: np.ndarray, crc: int = 0) -> int:
    for p in parts:
        crc = google_crc32c.extend(crc, p.tobytes())
    return crc


@pytest.mark.parametrize("n", LENGTHS)
def test_crc32c_of_any_length_and_offset(path, n):
    rng = np.random.default_rng(n)
    buf = rng.integers(0, 256, n + 16, dtype=np.uint8)
    for offset in (0, 3, 8):
        part = buf[offset:offset + n]
        assert kv_copy.crc32c(part) == _expected(part)
        assert kv_copy.crc32c(part, 0x1234ABCD) == _expected(part, crc=0x1234ABCD)
        assert kv_copy.crc32c(part.tobytes()) == _expected(part)
        assert kv_copy.crc32c(memoryview(part.tobytes())) == _expected(part)


@pytest.mark.parametrize("row_bytes", [4, 96, 1024, 4100])
def test_copy_rows_copies_and_checksums_k_then_v(path, row_bytes):
    rng = np.random.default_rng(row_bytes)
    rows = 300
    src = tuple(rng.integers(0, 256, (rows, row_bytes), dtype=np.uint8) for _ in range(2))
    dst = tuple(np.zeros((rows + 40, row_bytes), dtype=np.uint8) for _ in range(2))
    before = tuple(d.copy() for d in dst)
    pieces = [(5, 100, 17), (0, 3, 1), (22, 200, 120), (150, 30, 0), (299, 0, 1)]
    crc = kv_copy.copy_rows(src, dst, pieces)
    for s, d, b in zip(src, dst, before):
        for i, j, n in pieces:
            b[j:j + n] = s[i:i + n]
        np.testing.assert_array_equal(d, b)  # the pieces, and nothing else
    assert crc == _expected(*[src[0][i:i + n] for i, _, n in pieces], *[src[1][i:i + n] for i, _, n in pieces])
    assert kv_copy.rows_crc32c(*src, [(i, n) for i, _, n in pieces]) == crc


def test_copy_rows_from_read_only_bytes_into_a_strided_cache_view(path):
    """The decode worker's cases: a received message's bytes (read-only) and a peer's segment,
    into one layer of a cache; no warning reaches the log."""
    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, (2, 64, 8, 16), dtype=np.int32).tobytes()
    kv = np.frombuffer(data, dtype=np.int32).reshape(2, 64, 8, 16)
    cache = np.zeros((4, 128, 8, 16), dtype=np.int32)  # [layer, slot, heads, dim]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        crc = kv_copy.copy_rows((kv[0], kv[1]), (cache[1], cache[2]), [(0, 64, 64)])
    assert crc == google_crc32c.value(data)
    np.testing.assert_array_equal(cache[1, 64:], kv[0])
    np.testing.assert_array_equal(cache[2, 64:], kv[1])
    assert not cache[0].any() and not cache[3].any() and not cache[1, :64].any()


@pytest.mark.parametrize("piece", [(0, 0, 11), (-1, 0, 1), (0, -1, 1), (0, 0, -1), (9, 0, 2), (0, 6, 1)])
def test_copy_rows_refuses_pieces_outside_either_side(path, piece):
    src = (np.ones((10, 8), np.uint8), np.ones((10, 8), np.uint8))
    dst = (np.zeros((6, 8), np.uint8), np.zeros((6, 8), np.uint8))
    ok = (0, 0, 2)
    with pytest.raises(ValueError, match="outside"):
        kv_copy.copy_rows(src, dst, [ok, piece])
    assert not dst[0].any() and not dst[1].any()  # checked before a byte moved


def test_rows_crc32c_refuses_runs_outside_the_rows(path):
    k = v = np.ones((10, 8), np.uint8)
    with pytest.raises(ValueError, match="outside"):
        kv_copy.rows_crc32c(k, v, [(8, 3)])


def test_native_copy_refuses_rows_of_different_sizes():
    assert native.load(), native.error()
    src = (np.ones((10, 8), np.uint8), np.ones((10, 8), np.uint8))
    dst = (np.zeros((10, 16), np.uint8), np.zeros((10, 16), np.uint8))
    with pytest.raises(ValueError, match="rows of 8 bytes"):
        kv_copy.copy_rows(src, dst, [(0, 0, 1)])


# lengths around the folds: under the 128 bytes a fold needs, the 16- and 64-byte steps, the
# 512 bytes of the four-chunk folds and their 256-byte rounds, and the streaming path (12 KiB + 32)
FOLD_LENGTHS = [0, 1, 15, 16, 127, 128, 129, 143, 144, 191, 192, 255, 256, 511, 512, 513, 575, 576, 767, 768,
                1023, 1024, 1040, 3 * 4096 + 31, 3 * 4096 + 32, 3 * 4096 + 95, 70_001]


def _check_ops(ops) -> None:
    """An op set (the loaded library's, or one built with other flags) against google-crc32c:
    checksums at every fold boundary and offset, and copies into misaligned destinations."""
    import torch

    rng = np.random.default_rng(5)
    buf = rng.integers(0, 256, max(FOLD_LENGTHS) + 128, dtype=np.uint8)
    for n in FOLD_LENGTHS:
        for offset in (0, 1, 8, 63):
            part = buf[offset:offset + n]
            t = torch.from_numpy(part.copy())
            assert ops.crc32c(t, 0) == _expected(part), (n, offset)
            assert ops.crc32c(t, 0x1234ABCD) == _expected(part, crc=0x1234ABCD), (n, offset)
            out = torch.zeros(n + 80, dtype=torch.uint8)
            dst = out[offset + 3:offset + 3 + n].view(n, 1) if n else out[:0].view(0, 1)
            src = t.view(n, 1)
            crc = ops.copy_rows_crc32c(src, src, dst, dst, torch.tensor([[0, 0, n]]), 0)
            assert crc == _expected(part, part), (n, offset)  # K then V: the same bytes twice
            assert torch.equal(dst.view(-1), t)


def test_native_folds_match_google_crc32c_at_every_boundary():
    """The native ops directly (the engine's wrappers send short buffers to google-crc32c)."""
    import torch

    assert native.load(), native.error()
    _check_ops(torch.ops.pdserve)


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["xmm-folds", "crc32-chains", "byte-table"])
def test_narrower_instruction_sets_match_google_crc32c(isa, native_variant):
    """The 16-byte folds (no VPCLMULQDQ), the three crc32 chains (no PCLMULQDQ) and the byte
    table (neither, nor SSE4.2): kv_copy.cpp built again with those flags (`native_variants.py`),
    under a namespace of its own."""
    _check_ops(native_variant(f"pdserve_test_kv_{isa.replace('-', '_')}"))
