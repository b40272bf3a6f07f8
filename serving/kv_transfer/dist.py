"""`DistTransport`: the KV push with each data chunk's bytes sent over a two-rank
torch.distributed group, device to device between CUDA caches (NCCL), or host to host (gloo),
while gRPC carries the header, the numbered chunks' descriptions with their checksums, the
trailer and the ack as on every other path.

The sender (a prefill worker, rank 0) runs a TCP store. A push's header names the store and a
group: a prefix in the store of 32 random hex digits, which only that header carries (it travels
over the cluster's authenticated gRPC stream, and the decode worker reads it only after checking
the push's ticket). The decode worker (rank 1) joins on the first header naming a group it does
not have; both keep the group for the pair's later pushes, one push at a time per group (NCCL
pairs sends with receives by their order alone), at most MAX_GROUPS_PER_PEER at once per decode
worker. Each data chunk's bytes, [2, tokens, kv heads, head dim] (K then V) in the header's
dtype, are one send tagged with the chunk's seq, and its description carries their checksum,
computed where they lie and checked where they land (`checksum`): their CRC-32C between host
caches, as on every other path; between CUDA caches their `sum64`, computed on the device (a CRC
there would mean copying the bytes to the host, and `sum64` on a host is 70 times slower than
the CRC: 6 ms against 0.09 for 2 MiB, one thread, Intel Xeon). Any failure, or a push that
ends early, drops the group on both sides (a send or receive left unmatched would cross into
the next push); the next push makes another.

A decode worker that does not take the sender's backend (`WorkerInfo.kv_dist_backends`, asked
once per address) gets the bytes over gRPC, each chunk read out of the cache and checksummed
(CRC-32C) here.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import AsyncIterator, Callable

import torch
import torch.distributed as dist

from pdserve.engine.disagg import KVCache, gather_kv
from pdserve.engine.kv_copy import crc32c
from pdserve.serving.kv_transfer import (KVAck, KVData, KVDist, KVHeader, KVMessage, KVTargetReady, TransferError,
                                         TransferFailure)
from pdserve.serving.kv_transfer.grpc_transport import GrpcTransport
from pdserve.serving.kv_transfer.shm import parse_runs

log = logging.getLogger("pdserve.kv_dist")

BACKENDS = {"cpu": "gloo", "cuda": "nccl"}  # a cache's device type -> the backend its bytes go over
THREADS = 8  # each side's waits (a group's rendezvous, sends, receives) block a thread of its own pool
_MODULUS = 32749  # `sum64`'s weights repeat with this period: the largest prime under 2^15 (each product fits an int32)


def is_available() -> bool:
    return dist.is_available()


def backend_for(device: torch.device) -> str | None:
    """The torch.distributed backend that moves a cache's bytes on `device`, or None."""
    backend = BACKENDS.get(device.type)
    if backend == "gloo" and not dist.is_gloo_available() or backend == "nccl" and not dist.is_nccl_available():
        return None
    return backend


def sum64(t: torch.Tensor) -> int:
    """A contiguous tensor's bytes as little-endian 16-bit words w_i: the sum of
    w_i * ((i mod 32749) + 1), computed on the tensor's device (each product in an int32, their sum
    in an int64: exact for chunks under 2^32 words). Position-weighted, so swapped or shifted
    words change it; it reads the bytes once, where a CRC would mean copying a device's bytes to
    the host."""
    words = t.reshape(-1).view(torch.int16).to(torch.int32).bitwise_and_(0xFFFF)
    weights = torch.arange(words.numel(), dtype=torch.int32, device=t.device).remainder_(_MODULUS).add_(1)
    return int(words.mul_(weights).sum(dtype=torch.int64))


def checksum(buf: torch.Tensor, backend: str) -> tuple[int, int]:
    """(crc32c, sum64) of a chunk's bytes as its description carries them: the CRC-32C of a
    host chunk (gloo), the sum64 of a device one (NCCL), the other 0."""
    if backend == "gloo":
        return crc32c(buf.reshape(-1).view(torch.uint8).numpy()), 0
    return 0, sum64(buf)


def make_group(store: dist.Store, name: str, rank: int, backend: str, timeout_s: float):
    """Rank `rank` of the two-rank group `name` in `store`; blocks until both ranks are in (or
    raises after timeout_s), and each later send or receive fails after timeout_s."""
    prefixed, timeout = dist.PrefixStore(name, store), timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, 2, timeout)
    if backend == "nccl":  # not run here (no GPU in CI): written to torch's documented constructor
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, 2, options)
    raise ValueError(f"no torch.distributed backend {backend!r}; expected one of {sorted(set(BACKENDS.values()))}")


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def _drain(works: list, pair: _Pair) -> None:
    """A dropped group's sends, waited for until they end or time out (a worker thread)."""
    for work in works:
        try:
            work.wait()
        except RuntimeError:
            pass
    works.clear()
    pair.group = None


@dataclasses.dataclass(slots=True)
class _Pair:
    """One group with one decode worker, as the sender keeps it."""

    name: str
    group: object | None = None  # the process group, once both ranks joined


class DistTransport:
    """The prefill worker's side (rank 0). Its KV sender's chunks name slots of the cache
    (`KVSender.send_refs`): this transport reads them, on the cache's device, as it pushes."""

    takes_slots = True
    MAX_GROUPS_PER_PEER = 4

    def __init__(self, grpc_transport: GrpcTransport, caches: Callable[[int], KVCache], host: Callable[[], str],
                 probe_timeout_s: float = 5.0):
        """caches(group) -> that KV cache of ours (per layer (K, V)). host(): where decode workers
        reach this worker (the store's address)."""
        self.grpc, self.caches, self.host = grpc_transport, caches, host
        self.probe_timeout_s = probe_timeout_s
        self._store: dist.TCPStore | None = None  # made at the first push, on a free port
        self._backend: str | None = None
        self._takes: dict[str, bool] = {}  # decode address -> whether it takes our backend
        self._probes: dict[str, asyncio.Future] = {}  # decode address -> its GetInfo, while it runs
        self._idle: dict[str, list[_Pair]] = {}
        self._limits: dict[str, asyncio.Semaphore] = {}
        self.pool = ThreadPoolExecutor(THREADS, thread_name_prefix="kv-dist-send")
        self.num_dist_pushes = 0

    @property
    def backend(self) -> str | None:
        if self._backend is None:
            self._backend = backend_for(self.caches(0)[0][0].device) or ""
        return self._backend or None

    async def push(self, address: str, messages: AsyncIterator[KVMessage], timeout_s: float) -> KVAck:
        if not await self.takes_dist(address):
            return await self.grpc.push(address, self._by_value(messages), timeout_s)
        if self._store is None:
            self._store = dist.TCPStore("0.0.0.0", 0, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)
        async with self._limits.setdefault(address, asyncio.Semaphore(self.MAX_GROUPS_PER_PEER)):
            idle = self._idle.setdefault(address, [])
            pair = idle.pop() if idle else _Pair(secrets.token_hex(16))
            stream = _Stream(self, pair, timeout_s)
            try:
                ack = await self.grpc.push(address, stream.messages(messages), timeout_s)
                if not stream.complete and stream.target_ready:
                    # the decode worker decodes on the target's K/V and gave up the draft's (a
                    # failed draft pass here, a bad chunk there): the request is served, and the
                    # group goes, as sends may be left unmatched
                    self._let_go(stream, pair)
                    return ack
                if not stream.complete:
                    raise TransferError(TransferFailure.CORRUPT, "the decode worker acked a push before its trailer")
            except BaseException as e:
                self._let_go(stream, pair)
                if not isinstance(e, TransferError):
                    raise
                self._takes.pop(address, None)  # ask again next time: it may have restarted
                raise (stream.error or e) from None
            idle.append(pair)  # every send matched: the group can take the next push
            self.num_dist_pushes += 1
            return ack

    def _let_go(self, stream: _Stream, pair: _Pair) -> None:
        """The pair's group goes: its sends still out are waited for (or time out) off the loop,
        which then lets the group go (its destructor may wait for them too)."""
        asyncio.get_running_loop().run_in_executor(self.pool, _drain, stream.sends, pair)

    async def takes_dist(self, address: str) -> bool:
        """Whether the decode worker at `address` takes our backend: asked once (pushes that
        come meanwhile wait for the one answer)."""
        if address not in self._takes:
            if address not in self._probes:
                self._probes[address] = asyncio.ensure_future(self._probe(address))
            try:
                takes = await asyncio.shield(self._probes[address])
            finally:
                if self._probes.get(address) is not None and self._probes[address].done():
                    del self._probes[address]
            if takes is None:
                return False
            self._takes[address] = takes
        return self._takes[address]

    async def _probe(self, address: str) -> bool | None:
        info = await self.grpc.decode_info(address, self.probe_timeout_s, "torch.distributed")
        if info is None:
            return None  # asked again next time
        takes = self.backend is not None and self.backend in info.kv_dist_backends
        log.info("KV to %s goes over %s", address, f"torch.distributed ({self.backend})" if takes else "gRPC")
        return takes

    def gather(self, d: KVData) -> torch.Tensor:
        """A slot-naming chunk's K then V, [2, num_tokens, num_kv_heads, head_dim], contiguous,
        on the cache's device."""
        cache = self.caches(d.group)
        k = cache[d.layer][0]
        runs = parse_runs(d.src_runs, k.shape[0] * k.shape[1], d.num_tokens)
        return gather_kv(cache, d.layer, torch.cat([torch.arange(s, s + n) for s, n in runs]))

    async def _by_value(self, messages: AsyncIterator[KVMessage]):
        async for msg in messages:
            if isinstance(msg, KVData) and msg.src_runs:
                data = self.gather(msg).cpu().contiguous().view(torch.uint8).numpy().tobytes()
                msg = dataclasses.replace(msg, data=data, crc32c=crc32c(data), src_runs=())
            yield msg

    async def close(self) -> None:
        await self.grpc.close()
        self.pool.shutdown(wait=False, cancel_futures=True)  # a send still waiting ends at its timeout


class _Stream:
    """One push's messages over a group: the header names it (joining it, the first time, while
    the decode worker does), each chunk's bytes are sent as its description goes, and the trailer
    waits until every send is done."""

    def __init__(self, transport: DistTransport, pair: _Pair, timeout_s: float):
        self.t, self.pair, self.timeout_s = transport, pair, timeout_s
        self.error: TransferError | None = None  # what failed here, rather than what gRPC makes of it
        self.complete = False
        self.target_ready = False  # a KVTargetReady went: the decode worker may ack before the trailer
        self.sends: list = []  # the sends' works, in order

    async def messages(self, messages: AsyncIterator[KVMessage]):
        t, pair, joining, sends = self.t, self.pair, None, self.sends
        try:
            async for msg in messages:
                if isinstance(msg, KVHeader):
                    if pair.group is None:
                        joining = asyncio.get_running_loop().run_in_executor(
                            t.pool, make_group, t._store, pair.name, 0, t.backend, self.timeout_s)
                    yield dataclasses.replace(msg, dist=KVDist(t.host(), t._store.port, pair.name, t.backend))
                elif isinstance(msg, KVData):
                    buf = t.gather(msg)
                    crc, total = checksum(buf, t.backend)
                    yield dataclasses.replace(msg, src_runs=(), crc32c=crc, sum64=total)
                    if joining is not None:
                        pair.group, joining = await self._joined(joining), None
                    sends.append(pair.group.send([buf], 1, msg.seq))
                elif isinstance(msg, KVTargetReady):  # the decode side has received every chunk before it
                    self.target_ready = True
                    yield msg
                else:
                    if not msg.abandoned:
                        if joining is not None:
                            pair.group, joining = await self._joined(joining), None
                        await self._sent(sends)
                        self.complete = True
                    yield msg
        finally:
            if joining is not None:
                joining.cancel()

    async def _joined(self, joining) -> object:
        try:
            return await joining
        except RuntimeError as e:
            raise self._fail(TransferFailure.TIMEOUT, f"the decode worker did not join the torch.distributed "
                             f"group: {e}")

    async def _sent(self, sends: list) -> None:
        try:
            await asyncio.get_running_loop().run_in_executor(self.t.pool, _wait, sends)
        except RuntimeError as e:
            raise self._fail(TransferFailure.UNREACHABLE, f"a K/V send over torch.distributed failed: {e}")

    def _fail(self, failure: TransferFailure, message: str) -> TransferError:
        self.error = TransferError(failure, message)
        return self.error


class DistGroups:
    """The decode worker's side (rank 1): the groups it joined, by name, at most MAX_GROUPS
    (the least recently used dropped first), and the stores it reached them through. A group
    dropped here (that, or a failed push) is never joined again under its name: its store still
    holds the first rendezvous, which a second would read. A push naming it fails at once, and
    its sender then makes another."""

    MAX_GROUPS = 64
    MAX_RETIRED = 4096

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._groups: OrderedDict[str, object] = OrderedDict()
        self._retired: OrderedDict[str, None] = OrderedDict()
        self._stores: dict[tuple[str, int], dist.TCPStore] = {}
        self.pool = ThreadPoolExecutor(THREADS, thread_name_prefix="kv-dist-recv")

    async def join(self, d: KVDist, backend: str | None):
        if d.backend != backend:
            raise TransferError(TransferFailure.MISMATCH, f"K/V over torch.distributed backend {d.backend!r}; this "
                                f"decode worker takes {backend!r}")
        if len(d.name) != 32 or any(c not in "0123456789abcdef" for c in d.name):
            raise TransferError(TransferFailure.CORRUPT, "the header's torch.distributed group name is not 32 hex "
                                "digits")
        if d.name in self._groups:
            self._groups.move_to_end(d.name)
            return self._groups[d.name]
        if d.name in self._retired:
            raise TransferError(TransferFailure.UNKNOWN, "the header names a torch.distributed group this decode "
                                "worker dropped")
        self._retired[d.name] = None  # joined once at most, whatever happens
        while len(self._retired) > self.MAX_RETIRED:
            self._retired.popitem(last=False)
        try:
            group = await asyncio.get_running_loop().run_in_executor(self.pool, self._join, d)
        except (RuntimeError, ValueError) as e:
            raise TransferError(TransferFailure.UNREACHABLE, f"joining the sender's torch.distributed group at "
                                f"{d.host}:{d.port} failed: {e}") from None
        self._groups[d.name] = group
        while len(self._groups) > self.MAX_GROUPS:
            self._groups.popitem(last=False)
        return group

    def _join(self, d: KVDist):
        key = (d.host, d.port)
        if key not in self._stores:
            self._stores[key] = dist.TCPStore(d.host, d.port, None, False, timedelta(seconds=self.timeout_s))
        return make_group(self._stores[key], d.name, 1, d.backend, self.timeout_s)

    def drop(self, name: str) -> None:
        self._groups.pop(name, None)

    async def receive(self, group, d: KVData, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                      backend: str) -> torch.Tensor:
        """A chunk's bytes, received and checked against its checksum (`checksum`)."""
        buf = torch.empty(shape, dtype=dtype, device=device)
        try:
            await asyncio.get_running_loop().run_in_executor(self.pool, group.recv([buf], 0, d.seq).wait)
        except RuntimeError as e:
            raise TransferError(TransferFailure.TIMEOUT, f"chunk {d.seq} over torch.distributed: {e}") from None
        if checksum(buf, backend) != (d.crc32c, d.sum64):
            kind = "CRC-32C" if backend == "gloo" else "sum64"
            raise TransferError(TransferFailure.CORRUPT, f"chunk {d.seq} failed its {kind} checksum")
        return buf
