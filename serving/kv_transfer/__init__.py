"""The KV transfer interface: how a prefill worker's K/V reach the decode worker that reserved
blocks for them, whatever carries the bytes.

One transfer is a stream of messages, produced on the prefill side by a `KVSender` and consumed
on the decode side by the decode worker's `KVEndpoint`:

    KVHeader ─► KVData 0 ─► KVData 1 ─► … ─► KVTrailer(num_chunks, first_token_id)   ⇒  KVAck

With a draft model, to a decode worker that takes it, the target's K/V go first and a
`KVTargetReady` follows them, before the draft's: the decode worker starts decoding on it, and
the draft's K/V land meanwhile (the draft drafts for that request once they have).

    KVHeader ─► target's KVData … ─► KVTargetReady(n, first_token_id) ─► draft's KVData … ─► KVTrailer

A `KVTransport` carries a stream to the endpoint at an address and returns its acknowledgement,
or raises `TransferError` saying why the transfer failed (the decode side's verdict, a timeout,
an unreachable peer). Backends:

- `InProcessTransport` (here): endpoints registered by address in one process; no copies, no
  serialization. For in-process tests of the router and both workers together.
- `GrpcTransport` (`grpc_transport.py`): the `DecodeWorker.PushKV` client stream.
- `ShmTransport` (`shm_transport.py`): the same stream, but for a decode worker on the same node
  (it can open that worker's probe, `shm.py`) the data chunks name slots of the prefill
  worker's KV cache in shared memory instead of carrying bytes; for any other peer it fills in
  the bytes and the stream goes as plain gRPC. Chosen per pair, once.
- `DistTransport` (`dist.py`): the same stream, the bulk bytes of each chunk sent over a
  two-rank torch.distributed group (NCCL between CUDA caches, device to device; gloo between
  host caches) while gRPC carries the rest; for a decode worker that does not take the
  backend, bytes over gRPC. Chosen per pair, once.

Every data chunk carries a CRC-32C (`engine/kv_copy.py`) of its bytes, verified on arrival (over shared
memory: after the decode side's copy into its cache); over a torch.distributed group between
CUDA caches, a sum computed on the device where the bytes lie (`dist.sum64`) instead, verified on
the receiving device.

Messages are plain values; protobuf exists only inside the gRPC backend.
"""
from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol

from pdserve.engine.disagg import KVGroupLayout


@dataclass(frozen=True, slots=True)
class KVShm:
    """The sender's KV cache in shared memory (`shm.KVArena`): one segment per group."""

    segments: tuple[str, ...]
    num_slots: int  # the sender's num_blocks * block_size


@dataclass(frozen=True, slots=True)
class KVDist:
    """The torch.distributed pair group the data chunks' bytes go over (`dist.py`)."""

    host: str  # the sender's TCP store
    port: int
    name: str  # the group's prefix in the store (32 random hex digits)
    backend: str  # "gloo" or "nccl"


@dataclass(frozen=True, slots=True)
class KVHeader:
    ticket: str  # the reservation's transfer ticket (serving/tickets.py)
    num_tokens: int  # the prompt's tokens, all of which the data chunks cover but the cached ones
    dtype: str  # "float32", "bfloat16", "float16"
    groups: tuple[KVGroupLayout, ...]  # every KV cache of the sender, in order (target, draft)
    shm: KVShm | None = None  # set when the data chunks name slots in shared memory
    dist: KVDist | None = None  # set when the data chunks' bytes go over a torch.distributed group
    num_cached_tokens: int = 0  # the leading tokens the decode side holds already (the ticket's): not sent


@dataclass(frozen=True, slots=True)
class KVData:
    """K then V of tokens [token_start, token_start + num_tokens) of one layer, each laid out
    [num_tokens, num_kv_heads, head_dim] row-major in the header's dtype: in `data`, or, over
    shared memory, in the sender's slots that `src_runs` names (then `data` is empty)."""

    seq: int  # 0, 1, 2, … in stream order: a gap means a lost chunk
    group: int  # index into KVHeader.groups
    layer: int
    token_start: int
    num_tokens: int
    data: bytes | memoryview
    crc32c: int  # CRC-32C of the chunk's bytes (K of every token, then V)
    src_runs: tuple[int, ...] = ()  # shared memory: (first slot, number of slots) pairs in token order
    sum64: int = 0  # over a torch.distributed group with NCCL: `dist.sum64` of the bytes (which come apart), not a CRC
    # the chunk already framed as its gRPC message (`grpc_transport.data_chunk_in_place`), `data`
    # a view of its data field: the sender then makes no copy of its own
    wire: bytes | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True, slots=True)
class KVTrailer:
    num_chunks: int  # data chunks sent
    first_token_id: int
    # (token id, logprob) of the first token, then its top alternatives; when the request asked
    first_token_logprobs: tuple[tuple[int, float], ...] | None = None
    abandoned: bool = False  # the sender gave the transfer up on purpose (its request ended)


@dataclass(frozen=True, slots=True)
class KVTargetReady:
    """The target's K/V are complete (data chunks 0 to num_chunks - 1) and the first token is
    sampled; the draft's K/V follow, then the trailer."""

    num_chunks: int  # data chunks sent so far: the target's
    first_token_id: int
    first_token_logprobs: tuple[tuple[int, float], ...] | None = None


KVMessage = KVHeader | KVData | KVTargetReady | KVTrailer


@dataclass(frozen=True, slots=True)
class KVAck:
    num_chunks: int
    num_bytes: int


class TransferFailure(enum.Enum):
    CORRUPT = "corrupt"  # checksum, gap, truncation, wrong sizes
    MISMATCH = "mismatch"  # the header does not describe the decode worker's KV
    UNKNOWN = "unknown"  # no such reservation
    TIMEOUT = "timeout"
    ABORTED = "aborted"  # cancelled by either side
    UNREACHABLE = "unreachable"  # the decode worker could not be reached, or went away
    FORBIDDEN = "forbidden"  # the ticket is forged, expired, or for another request or worker


class TransferError(Exception):
    def __init__(self, failure: TransferFailure, message: str):
        super().__init__(message)
        self.failure = failure


class KVEndpoint(Protocol):
    """The decode worker's receiving side."""

    async def receive_kv(self, messages: AsyncIterator[KVMessage]) -> KVAck:
        """Verify a stream into the reservation its header names and activate the request;
        TransferError (after freeing the reservation) when the stream is not a good transfer."""


class KVTransport(Protocol):
    """The prefill worker's sending side."""

    async def push(self, address: str, messages: AsyncIterator[KVMessage], timeout_s: float) -> KVAck:
        """Carry one stream to the endpoint at `address`; TransferError on any failure."""

    async def close(self) -> None: ...


class InProcessTransport:
    """Endpoints in this process, by the address their worker would have."""

    def __init__(self) -> None:
        self.endpoints: dict[str, KVEndpoint] = {}

    def register(self, address: str, endpoint: KVEndpoint) -> None:
        self.endpoints[address] = endpoint

    async def push(self, address: str, messages: AsyncIterator[KVMessage], timeout_s: float) -> KVAck:
        endpoint = self.endpoints.get(address)
        if endpoint is None:
            raise TransferError(TransferFailure.UNREACHABLE, f"no decode worker at {address}")
        try:
            return await asyncio.wait_for(endpoint.receive_kv(messages), timeout_s)
        except asyncio.TimeoutError:
            raise TransferError(TransferFailure.TIMEOUT, f"KV push to {address} took over {timeout_s:g} s") from None

    async def close(self) -> None:
        pass
