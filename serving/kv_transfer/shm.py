"""Shared memory for same-node KV transfers: the segments, the probe that proves two workers
share a /dev/shm, and the clean-up of segments whose owner died.

A prefill worker with the option on allocates its KV cache in named segments (`KVArena`, one
per KV group), so a transfer to a decode worker on the same node names slots of that cache
instead of carrying their bytes; the decode worker maps the segment once (`PeerSegments`) and
copies the slots straight into its own cache, then checks the chunk's CRC-32C on the copy.

    /dev/shm/pdserve-kv-<rand>-<group>   one KV group of a prefill worker:
        ┌ layer 0 K ┬ layer 0 V ┬ layer 1 K ┬ … ┬ layer L-1 V ┐
        each [num_slots, num_kv_heads, head_dim] in the cache's dtype (num_slots = blocks × block size)
    /dev/shm/pdserve-probe-<rand>        a decode worker's probe: a random nonce, advertised in WorkerInfo

Same node is decided by what matters, not by host names or boot ids (two pods on one node share
a boot id but not a /dev/shm): the prefill side uses shared memory with a decode worker only if
it can open that worker's probe and read the advertised nonce.

Life time: the owner holds a shared `flock` on each of its segments while it lives and unlinks
them when it stops (normal exit, SIGTERM: `close`, with `atexit` as a backstop). After a
kill -9 the files stay in /dev/shm; every worker removes, at start, the `pdserve-*` segments no
live process holds a lock on (`clean_stale_segments`). A decode worker that mapped a segment
keeps reading valid memory even after it is unlinked (the pages live until the last mapping
goes), and verifies every chunk's checksum after its copy, so a prefill side that dies or reuses
the slots mid-transfer fails that request with DATA_LOSS, never a bad cache.
"""
from __future__ import annotations

import atexit
import fcntl
import logging
import mmap
import os
import re
import secrets
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.kv_copy import as_tensor, copy_rows

log = logging.getLogger("pdserve.kv_shm")

KV_PREFIX = "pdserve-kv-"
PROBE_PREFIX = "pdserve-probe-"
_NAME = re.compile(r"^pdserve-(kv|probe)-[A-Za-z0-9_-]{1,64}$")


def shm_dir() -> str:
    """/dev/shm, or $PDSERVE_SHM_DIR (tests give each worker a folder of its own, as separate
    containers would have)."""
    return os.environ.get("PDSERVE_SHM_DIR", "/dev/shm")


def is_available() -> bool:
    return os.path.isdir(shm_dir()) and os.access(shm_dir(), os.W_OK)


def _path(name: str) -> str:
    if not _NAME.match(name):
        raise ValueError(f"{name!r} is not a pdserve shared-memory segment name")
    return os.path.join(shm_dir(), name)


class Segment:
    """A named segment this process created and owns: locked while it lives, unlinked on close."""

    def __init__(self, name: str, size: int):
        self.name, self.size = name, size
        # made under a name no clean-up looks at, locked ("alive"), and only then given its name:
        # `clean_stale_segments` never sees one of ours unlocked
        tmp = os.path.join(shm_dir(), f".creating-{secrets.token_hex(8)}")
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.ftruncate(fd, max(size, 1))  # zero-filled, as the KV cache must start
            # the pages reserved now: where /dev/shm has no room for them this fails (ENOSPC),
            # not a write into the cache later, which a full tmpfs answers with SIGBUS, killing
            # the process mid-request; and mapped now (MAP_POPULATE), so that the first requests'
            # K/V writes do not fault them in one by one
            os.posix_fallocate(fd, 0, max(size, 1))
            self.mmap = mmap.mmap(fd, max(size, 1), flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            os.rename(tmp, _path(name))
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        self._fd = fd
        atexit.register(self.close)

    def close(self) -> None:
        """Unlink the name (mappings elsewhere stay valid) and drop the lock. Idempotent; the
        mmap itself stays until the tensors over it are gone."""
        if self._fd < 0:
            return
        try:
            os.unlink(_path(self.name))
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = -1


def clean_stale_segments() -> list[str]:
    """Remove the pdserve segments of processes that died without unlinking them (kill -9);
    the names removed."""
    if not os.path.isdir(shm_dir()):
        return []
    removed = []
    for name in os.listdir(shm_dir()):
        if not _NAME.match(name):
            continue
        path = os.path.join(shm_dir(), name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # only when no owner holds it
            os.unlink(path)
            removed.append(name)
        except OSError:
            pass
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d stale shared-memory segments: %s", len(removed), ", ".join(removed))
    return removed


# ---- the decode worker's probe -------------------------------------------------------------
class Probe:
    """A decode worker's proof of place: a segment holding a random nonce."""

    def __init__(self):
        self.nonce = secrets.token_hex(16)
        self.segment = Segment(PROBE_PREFIX + secrets.token_hex(8), len(self.nonce))
        self.segment.mmap[:] = self.nonce.encode()

    @property
    def name(self) -> str:
        return self.segment.name

    def close(self) -> None:
        self.segment.close()


def can_open_probe(name: str, nonce: str) -> bool:
    """Whether this process shares the /dev/shm where a decode worker made its probe."""
    if not name or not nonce:
        return False
    try:
        with open(_path(name), "rb") as f:
            return f.read(len(nonce) + 1) == nonce.encode()
    except (OSError, ValueError):
        return False


# ---- the prefill worker's KV cache in shared memory -------------------------------------------
class KVArena:
    """Allocates a prefill worker's KV caches in segments, one per KV group (the engine's
    `kv_allocator`). Only a CPU cache can live here; for another device, or where /dev/shm has
    no room for the target's cache, it declines (with a warning for the latter) and the engine
    allocates as usual: the transfers then go over gRPC. Where the target's cache fit but the
    draft's does not, RuntimeError: the groups cannot be split between the two."""

    def __init__(self):
        self.tag = secrets.token_hex(8)
        self.segments: list[Segment] = []
        self.num_slots = 0
        self.declined = False  # a group's cache did not fit: the later ones stay out too

    def __call__(self, num_layers: int, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        if device.type != "cpu" or not is_available() or self.declined:
            return None
        per_tensor = int(np.prod(shape)) * dtype.itemsize
        size = 2 * num_layers * per_tensor
        try:
            seg = Segment(f"{KV_PREFIX}{self.tag}-{len(self.segments)}", size)
        except OSError as e:
            stat = os.statvfs(shm_dir())
            room = (f"{shm_dir()} has no room for the {'draft' if self.segments else 'target'}'s KV cache "
                    f"({size / 2**20:.0f} MiB; {stat.f_bavail * stat.f_frsize / 2**20:.0f} MiB free: {e.strerror})")
            advice = "give it more (docker run --shm-size, a Memory emptyDir at /dev/shm) or turn kv_shm off (--no-kv-shm)"
            if self.segments:
                raise RuntimeError(f"{room} beside the target's: {advice}") from e
            self.declined = True
            log.warning("%s: it stays in ordinary memory and K/V go over gRPC; %s", room, advice)
            return None
        self.segments.append(seg)
        self.num_slots = shape[0] * shape[1]
        flat = torch.frombuffer(seg.mmap, dtype=torch.uint8)
        return [tuple(flat[(2 * i + j) * per_tensor:(2 * i + j + 1) * per_tensor].view(dtype).view(shape)
                      for j in (0, 1)) for i in range(num_layers)]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.segments)

    def close(self) -> None:
        for s in self.segments:
            s.close()


# ---- the decode worker's view of its peers' segments ------------------------------------------
@dataclass(slots=True)
class PeerGroup:
    """One KV group of a peer's cache, mapped read-only: per layer, K and V as raw
    [num_slots, num_kv_heads, head_dim] arrays."""

    mapping: mmap.mmap
    layers: list[tuple[np.ndarray, np.ndarray]]
    tensors: list[tuple[torch.Tensor, torch.Tensor]]  # the same, as the copy op takes them (`as_tensor`)


class PeerSegments:
    """Read-only mappings of prefill workers' segments, opened once and kept (at most
    `max_mapped`; a name whose file is gone is dropped at the next open)."""

    def __init__(self, max_mapped: int = 16):
        self.max_mapped = max_mapped
        self._mapped: dict[tuple, PeerGroup] = {}

    def open(self, name: str, num_layers: int, num_slots: int, row_shape: tuple[int, int],
             raw_dtype: np.dtype) -> PeerGroup:
        """The group's arrays; OSError or ValueError when the segment cannot be opened or its
        size does not match."""
        key = (name, num_layers, num_slots, row_shape, np.dtype(raw_dtype).str)
        if key in self._mapped:
            return self._mapped[key]
        self._forget_gone()
        per_tensor = num_slots * row_shape[0] * row_shape[1] * np.dtype(raw_dtype).itemsize
        with open(_path(name), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != 2 * num_layers * per_tensor:
                raise ValueError(f"segment {name} holds {size} bytes; {num_layers} layers of {num_slots} slots "
                                 f"take {2 * num_layers * per_tensor}")
            mapping = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
        flat = np.frombuffer(mapping, dtype=np.uint8)
        layers = [tuple(flat[(2 * i + j) * per_tensor:(2 * i + j + 1) * per_tensor].view(raw_dtype)
                        .reshape(num_slots, *row_shape) for j in (0, 1)) for i in range(num_layers)]
        group = PeerGroup(mapping, layers, [(as_tensor(k), as_tensor(v)) for k, v in layers])
        self._mapped[key] = group
        while len(self._mapped) > self.max_mapped:
            self._mapped.pop(next(iter(self._mapped)))
        return group

    def _forget_gone(self) -> None:
        for key in [k for k in self._mapped if not os.path.exists(os.path.join(shm_dir(), k[0]))]:
            del self._mapped[key]  # the arrays of a transfer in flight keep the mapping alive


# ---- slots as runs ---------------------------------------------------------------------------
def slot_runs(slots: np.ndarray) -> list[tuple[int, int]]:
    """Consecutive slots as (first slot, number of slots) runs, in order."""
    slots = np.asarray(slots, dtype=np.int64)
    if len(slots) == 0:
        return []
    breaks = np.flatnonzero(np.diff(slots) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(slots)]))
    return [(int(slots[s]), int(e - s)) for s, e in zip(starts, ends)]


def split_runs(runs: list[tuple[int, int]], size: int) -> list[list[tuple[int, int]]]:
    """Runs cut into consecutive parts of `size` slots each (the last one shorter), a run split
    where a part ends."""
    parts, part, room = [], [], size
    for start, n in runs:
        while n:
            take = min(n, room)
            part.append((start, take))
            start, n, room = start + take, n - take, room - take
            if not room:
                parts.append(part)
                part, room = [], size
    if part:
        parts.append(part)
    return parts


def parse_runs(flat: tuple[int, ...] | list[int], num_slots: int, num_tokens: int) -> list[tuple[int, int]]:
    """`KVData.src_runs` back into runs; ValueError unless they cover `num_tokens` slots of a
    `num_slots`-slot cache."""
    if len(flat) % 2:
        raise ValueError("src_runs holds an odd number of values")
    runs = list(zip(flat[0::2], flat[1::2]))
    if any(n < 1 or s + n > num_slots for s, n in runs):
        raise ValueError(f"src_runs name slots outside the sender's {num_slots}")
    if sum(n for _, n in runs) != num_tokens:
        raise ValueError(f"src_runs cover {sum(n for _, n in runs)} slots for {num_tokens} tokens")
    return runs


def copy_runs(src_runs, dst_slots: np.ndarray, src: tuple[np.ndarray, np.ndarray],
              dst: tuple[np.ndarray, np.ndarray]) -> int:
    """Copy K then V of the tokens from the sender's slots (`src_runs`) into ours (`dst_slots`),
    piece by piece where both are consecutive, and return the CRC-32C of what landed in our
    cache: one pass over the bytes (`engine.kv_copy.copy_rows`)."""
    return copy_rows(src, dst, copy_pieces(src_runs, dst_slots))


def copy_pieces(src_runs, dst_slots: np.ndarray) -> list[tuple[int, int, int]]:
    """(src slot, dst slot, n): the token ranges consecutive on both sides."""
    dst_runs = slot_runs(dst_slots)
    out, i, j, si, dj = [], 0, 0, 0, 0  # si/dj: tokens already used of src run i / dst run j
    while i < len(src_runs) and j < len(dst_runs):
        (s, sn), (d, dn) = src_runs[i], dst_runs[j]
        n = min(sn - si, dn - dj)
        out.append((s + si, d + dj, n))
        si, dj = si + n, dj + n
        if si == sn:
            i, si = i + 1, 0
        if dj == dn:
            j, dj = j + 1, 0
    return out
