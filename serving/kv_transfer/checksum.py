"""CRC-32C (Castagnoli), the KV transfer's per-chunk checksum, over any contiguous buffer.

CRC-32C replaced zlib's CRC-32 because x86 (SSE4.2) and ARMv8 compute it in hardware: on this
project's CPUs google-crc32c runs several times faster than `zlib.crc32`. Its Python entry
points accept only `bytes`, though, so a checksum of a numpy array, an mmap (the shared-memory
backend) or a received message's memoryview would first need a copy. The wheel ships the C
library itself (`libcrc32c`), whose `crc32c_extend(crc, ptr, n)` reads any address: we call it
through ctypes (which drops the GIL during the call). Where that library cannot be found we fall
back to `google_crc32c.value(bytes(buf))`: the same result, one copy slower.
"""
from __future__ import annotations

import ctypes
import glob
import os

import google_crc32c
import numpy as np


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


def crc32c(buf, crc: int = 0) -> int:
    """CRC-32C of `buf` (bytes, or any C-contiguous buffer: numpy array, memoryview, mmap),
    continuing from `crc` (the checksum of the bytes before it)."""
    if isinstance(buf, bytes):
        return google_crc32c.extend(crc, buf)
    arr = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf
    assert arr.flags.c_contiguous, "crc32c needs a contiguous buffer"
    if _LIB is None:
        return google_crc32c.extend(crc, arr.tobytes())
    return _LIB.crc32c_extend(crc, arr.ctypes.data, arr.nbytes)
