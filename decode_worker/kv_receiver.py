"""`KVReceiver`: checks one pushed KV stream and writes it into a reserved sequence's blocks.

A stream is a header, data chunks, then a trailer (see worker.proto). Each chunk must carry the
next sequence number and a matching crc32; the header must describe this worker's KV groups;
the trailer's chunk count must equal what arrived, and every token of every layer of every
group must have been written. Anything else fails the transfer with a `TransferError`, which the
server turns into a status; the caller then frees the blocks. Runs on the asyncio loop only.
"""
from __future__ import annotations

import enum
import warnings
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch

from pdserve.engine.disagg import DTYPE_NAMES, KVCache, KVGroupLayout, slot_ids, write_kv
from pdserve.engine.sequence import Sequence

# The received bytes are only read (copied into the cache), never written through.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


class TransferFailure(enum.Enum):
    CORRUPT = "corrupt"  # checksum, gap, truncation, wrong sizes
    MISMATCH = "mismatch"  # header does not describe this worker's KV
    UNKNOWN = "unknown"  # no such reservation
    TIMEOUT = "timeout"
    ABORTED = "aborted"


class TransferError(Exception):
    def __init__(self, failure: TransferFailure, message: str):
        super().__init__(message)
        self.failure = failure


class TransferState(enum.Enum):
    RESERVED = "reserved"  # blocks held, nothing received yet
    RECEIVING = "receiving"
    VERIFIED = "verified"  # all K/V written; activation pending or done
    FAILED = "failed"


@dataclass(slots=True)
class Transfer:
    transfer_id: str
    seq: Sequence
    state: TransferState = TransferState.RESERVED
    num_chunks: int = 0
    num_bytes: int = 0
    covered: np.ndarray | None = None  # [total layers over groups, num_tokens] bool
    error: TransferError | None = None
    layer_offsets: list[int] = field(default_factory=list)


class KVReceiver:
    def __init__(self, groups: list[tuple[KVGroupLayout, KVCache]], dtype: torch.dtype, block_size: int,
                 vocab_size: int):
        self.groups = groups
        self.dtype = dtype
        self.block_size = block_size
        self.vocab_size = vocab_size

    def open(self, t: Transfer, num_tokens: int, dtype: str, layouts: list[KVGroupLayout]) -> None:
        if t.state is not TransferState.RESERVED:
            raise TransferError(TransferFailure.CORRUPT, f"transfer {t.transfer_id} got a second header")
        if num_tokens != t.seq.num_prompt_tokens:
            raise TransferError(TransferFailure.MISMATCH, f"header says {num_tokens} tokens; the reservation "
                                f"holds a {t.seq.num_prompt_tokens}-token prompt")
        if dtype != DTYPE_NAMES[self.dtype]:
            raise TransferError(TransferFailure.MISMATCH, f"KV dtype {dtype} differs from this worker's "
                                f"{DTYPE_NAMES[self.dtype]}")
        mine = [g for g, _ in self.groups]
        if layouts != mine:
            raise TransferError(TransferFailure.MISMATCH, f"KV groups {layouts} differ from this worker's {mine}")
        t.layer_offsets = list(np.cumsum([0] + [g.num_layers for g in mine]))
        t.covered = np.zeros((t.layer_offsets[-1], num_tokens), dtype=bool)
        t.state = TransferState.RECEIVING

    def receive(self, t: Transfer, seq_no: int, group: int, layer: int, token_start: int, num_tokens: int,
                data: bytes, crc32: int) -> None:
        if t.state is not TransferState.RECEIVING:
            raise TransferError(TransferFailure.CORRUPT, f"data chunk {seq_no} outside header..trailer")
        if seq_no != t.num_chunks:
            raise TransferError(TransferFailure.CORRUPT, f"chunk {seq_no} arrived where chunk {t.num_chunks} "
                                "was expected (a chunk was lost or reordered)")
        if zlib.crc32(data) != crc32:
            raise TransferError(TransferFailure.CORRUPT, f"chunk {seq_no} failed its crc32 checksum")
        if not 0 <= group < len(self.groups) or not 0 <= layer < self.groups[group][0].num_layers:
            raise TransferError(TransferFailure.CORRUPT, f"chunk {seq_no} names group {group} layer {layer}, "
                                "which does not exist")
        if num_tokens < 1 or token_start + num_tokens > t.covered.shape[1]:
            raise TransferError(TransferFailure.CORRUPT, f"chunk {seq_no} covers tokens [{token_start}, "
                                f"{token_start + num_tokens}) outside the prompt's {t.covered.shape[1]}")
        layout, cache = self.groups[group]
        per_token = layout.num_kv_heads * layout.head_dim
        if len(data) != 2 * num_tokens * per_token * self.dtype.itemsize:
            raise TransferError(TransferFailure.CORRUPT, f"chunk {seq_no} has {len(data)} bytes; {num_tokens} "
                                f"tokens of K and V take {2 * num_tokens * per_token * self.dtype.itemsize}")
        kv = torch.frombuffer(data, dtype=self.dtype).view(2, num_tokens, layout.num_kv_heads, layout.head_dim)
        write_kv(cache, layer, slot_ids(t.seq, self.block_size, token_start, num_tokens), kv[0], kv[1])
        t.covered[t.layer_offsets[group] + layer, token_start:token_start + num_tokens] = True
        t.num_chunks += 1
        t.num_bytes += len(data)

    def finish(self, t: Transfer, num_chunks: int, first_token: int) -> None:
        if t.state is not TransferState.RECEIVING:
            raise TransferError(TransferFailure.CORRUPT, "trailer before header")
        if num_chunks != t.num_chunks:
            raise TransferError(TransferFailure.CORRUPT, f"transfer truncated: the trailer counts {num_chunks} "
                                f"chunks but {t.num_chunks} arrived")
        if not t.covered.all():
            row = int(np.argmin(t.covered.all(axis=1)))
            raise TransferError(TransferFailure.CORRUPT, f"transfer incomplete: layer row {row} lacks tokens")
        if not 0 <= first_token < self.vocab_size:
            raise TransferError(TransferFailure.CORRUPT, f"first token {first_token} is outside the vocabulary")
        t.state = TransferState.VERIFIED
