"""CRC-32C (Castagnoli), the KV transfer's per-chunk checksum, and the copies that carry it: the
byte-level half of the engine's interface for disaggregated serving (`disagg.py` is the rest).

- `crc32c(buf, crc)`: the checksum of any contiguous buffer (bytes, numpy array, memoryview, mmap).
- `copy_rows(src, dst, pieces)`: K rows then V rows copied between two raw KV layers (a cache's
  slots, a received chunk's bytes, a peer's shared-memory segment), returning the CRC-32C of what
  was copied: the receiving side's write and check, and the sending side's gather.
- `rows_crc32c(k, v, runs)`: the checksum of K rows then V rows where they lie.

Where the native ops are loaded (`pdserve.kernels.native`; a worker with a CPU KV cache loads
them at start, `prepare`), these run in C++ at about the speed of a plain copy: each word is
copied and checksummed in one pass, the checksum folded by carry-less multiplies (or, on CPUs without
them, three interleaved crc32 chains; `kernels/cpu/kv_copy.cpp`). Otherwise
they fall back to numpy copies and google-crc32c's C library (`libcrc32c`, whose
`crc32c_extend(crc, ptr, n)` reads any address; its Python entry points take only `bytes`), and
to `google_crc32c.value(bytes(buf))` where that library cannot be found: the same results, slower.
"""
from __future__ import annotations

import ctypes
import glob
import os

import google_crc32c
import numpy as np
import torch

from pdserve.kernels import native

NATIVE_MIN_BYTES = 16 << 10  # under this the call's fixed cost outweighs the faster loop


def _load_library():
    here = os.path.dirname(google_crc32c.__file__)
    for path in sorted(glob.glob(os.path.join(here + ".libs", "libcrc32c*"))) + ["libcrc32c.so.1"]:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        lib.crc32c_extend.restype = ctypes.c_uint32
        lib.crc32c_extend.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        return lib
    return None


_LIB = _load_library()


def prepare(device: torch.device) -> bool:
    """At a worker's start: load the native ops when its KV cache is on the CPU (the first build on
    a machine takes 10-20 s, so not on a transfer's path). Whether they are in use."""
    return device.type == "cpu" and native.load()


def as_tensor(arr: np.ndarray | torch.Tensor) -> torch.Tensor:
    """What the ops take: a tensor over the array's memory (made once, for arrays used often)."""
    return arr if isinstance(arr, torch.Tensor) else _tensor(arr)


def pieces_tensor(pieces) -> torch.Tensor:
    """`copy_rows`' pieces as the ops take them (made once, for pieces used for several layers)."""
    return pieces if isinstance(pieces, torch.Tensor) else _pieces_tensor(pieces, 3)


def _tensor(arr: np.ndarray) -> torch.Tensor:
    """A tensor over the array's memory. Torch has no read-only tensors and warns when given a
    read-only array (a received message, a peer's segment), which the ops only read: such an
    array is first re-viewed, over the same address, as a writable one (the caller's array keeps
    the memory alive for the call)."""
    if not arr.flags.writeable and arr.flags.c_contiguous and arr.nbytes:
        raw = (ctypes.c_uint8 * arr.nbytes).from_address(arr.ctypes.data)
        arr = np.ctypeslib.as_array(raw).view(arr.dtype).reshape(arr.shape)
    return torch.from_numpy(arr)


def crc32c(buf, crc: int = 0) -> int:
    """CRC-32C of `buf` (bytes, or any C-contiguous buffer: numpy array, memoryview, mmap),
    continuing from `crc` (the checksum of the bytes before it)."""
    arr = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf
    assert arr.flags.c_contiguous, "crc32c needs a contiguous buffer"
    if arr.nbytes >= NATIVE_MIN_BYTES and native.loaded():
        return torch.ops.pdserve.crc32c(_tensor(arr.reshape(-1).view(np.uint8)), crc)
    if isinstance(buf, bytes):
        return google_crc32c.extend(crc, buf)
    if _LIB is None:
        return google_crc32c.extend(crc, arr.tobytes())
    return _LIB.crc32c_extend(crc, arr.ctypes.data, arr.nbytes)


def copy_rows(src: tuple[np.ndarray, np.ndarray], dst: tuple[np.ndarray, np.ndarray],
              pieces: list[tuple[int, int, int]]) -> int:
    """Copy K then V rows, each piece (source row, destination row, rows) from `src` to `dst`
    ((K, V) arrays whose first axis is the row, contiguous, rows of equal bytes), and return the
    CRC-32C of the copied bytes: K's pieces in order, then V's. ValueError for a piece outside
    either side (nothing is copied then). The arrays may be given as `as_tensor`'s tensors and
    the pieces as `pieces_tensor`'s, made once for many calls."""
    if native.loaded():
        try:
            return torch.ops.pdserve.copy_rows_crc32c(*map(as_tensor, (*src, *dst)), pieces_tensor(pieces), 0)
        except RuntimeError as e:
            raise ValueError(str(e).splitlines()[0]) from None
    src, dst = [tuple(a.numpy() if isinstance(a, torch.Tensor) else a for a in side) for side in (src, dst)]
    if isinstance(pieces, torch.Tensor):
        pieces = [tuple(x) for x in pieces.tolist()]
    _check_pieces(pieces, len(src[0]), len(dst[0]))
    crc = 0
    for s_arr, d_arr in zip(src, dst):
        for s, d, n in _hot_pieces(pieces, d_arr[0].nbytes if len(d_arr) else 1):
            d_arr[d:d + n] = s_arr[s:s + n]
            crc = crc32c(d_arr[d:d + n], crc)  # read back while it is still in the CPU's cache
    return crc


def rows_crc32c(k: np.ndarray, v: np.ndarray, runs: list[tuple[int, int]]) -> int:
    """CRC-32C of the runs' (first row, rows) K rows in order, then their V rows."""
    if native.loaded():
        try:
            return torch.ops.pdserve.rows_crc32c(_tensor(k), _tensor(v), _pieces_tensor(runs, 2), 0)
        except RuntimeError as e:
            raise ValueError(str(e).splitlines()[0]) from None
    crc = 0
    for arr in (k, v):
        for start, n in runs:
            if n < 0 or start < 0 or start + n > len(arr):
                raise ValueError(f"rows_crc32c: run ({start}, {n}) is outside the {len(arr)} rows")
            crc = crc32c(arr[start:start + n], crc)
    return crc


def _pieces_tensor(pieces, width: int) -> torch.Tensor:
    return torch.tensor(pieces, dtype=torch.int64).reshape(-1, width)


def _check_pieces(pieces, src_rows: int, dst_rows: int) -> None:
    for i, (s, d, n) in enumerate(pieces):
        if n < 0 or s < 0 or d < 0 or s + n > src_rows or d + n > dst_rows:
            raise ValueError(f"copy_rows: piece {i} (source row {s}, destination row {d}, {n} rows) is outside "
                             f"the {src_rows} source and {dst_rows} destination rows")


_HOT_BYTES = 256 << 10  # a piece small enough to re-read from the CPU's cache


def _hot_pieces(pieces, row_bytes: int):
    rows = max(1, _HOT_BYTES // max(1, row_bytes))
    return [(s + i, d + i, min(rows, n - i)) for s, d, n in pieces for i in range(0, n, rows)]
