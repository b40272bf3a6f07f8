"""`KVReceiver`: checks one pushed K/V stream and writes it into a reserved sequence's blocks.

A stream is a header, data chunks, then a trailer (`pdserve.serving.kv_transfer`). Each chunk
must carry the next sequence number and a matching CRC-32C; the header must describe this
worker's KV groups and the reservation's prompt; the trailer's chunk count must equal what
arrived, and every token of every layer of every group must have been written. Anything else
is a `TransferError`; the caller then fails the request, which frees its blocks. Runs on the
asyncio loop only; it writes only into the slots of a HELD sequence, which no step reads, or,
after a `KVTargetReady` (`target_ready`: the target's K/V verified, the sequence decoding), into
the draft's cache in blocks the engine keeps pinned for it (`PinnedBlocks`), which no draft pass
reads until they are verified.

A chunk carries its bytes, or (a same-node pair, the header naming the sender's shared-memory
segments) names the sender's slots: those are copied straight into the reserved slots and the
checksum is computed on the copy, so bytes the sender changed or freed meanwhile fail the
transfer instead of entering the cache. Or (the header naming a torch.distributed group,
`serving/kv_transfer/dist.py`) its bytes arrive over that group, on the cache's device, and are
checked against the chunk's checksum there before they go into the reserved slots (`fetch_dist`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pdserve.engine import kv_copy
from pdserve.engine.disagg import DTYPE_NAMES, KVCache, KVGroupLayout, place_kv, raw_layer, slot_ids, write_kv
from pdserve.engine.sequence import Sequence
from pdserve.serving.kv_transfer import KVData, KVHeader, KVTargetReady, KVTrailer, TransferError, TransferFailure
from pdserve.serving.kv_transfer.dist import DistGroups, backend_for
from pdserve.serving.kv_transfer.shm import PeerGroup, PeerSegments, copy_pieces, copy_runs, parse_runs


@dataclass(slots=True)
class TransferProgress:
    """What has arrived of one transfer."""

    num_chunks: int = 0
    num_bytes: int = 0
    covered: np.ndarray | None = None  # [layers over all groups, num_tokens] bool; None before the header
    layer_offsets: list[int] = field(default_factory=list)  # first row of each group in `covered`
    shm: list[PeerGroup] | None = None  # the sender's segments, per group, when it sends over shared memory
    shm_num_slots: int = 0
    dist: object | None = None  # the torch.distributed group the bytes come over, when the header names one
    dist_name: str = ""
    # the latest chunk's token range: ((token_start, num_tokens, src_runs), our slots, copy pieces
    # or None); the layers of one range share it
    plan: tuple | None = None
    target_ready: bool = False  # `KVTargetReady` came: the target's cache is the running sequence's now
    num_cached_tokens: int = 0  # the prompt's leading tokens in blocks adopted from the prefix cache: not sent


@dataclass(frozen=True, slots=True)
class PinnedBlocks:
    """What a transfer writes into once its sequence decodes (`KVTargetReady`): the blocks it
    reserved, pinned by the engine, as they were (the sequence's own table changes as it runs)."""

    block_table: list[int]


class KVReceiver:
    def __init__(self, groups: list[tuple[KVGroupLayout, KVCache]], dtype: torch.dtype, block_size: int,
                 vocab_size: int, dist_groups: DistGroups | None = None):
        """dtype: the KV caches' (`engine.kv_dtype`); dist_groups: set to take K/V over torch.distributed
        (the backend its cache's device has)."""
        self.groups = groups
        self.dtype = dtype
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.peers = PeerSegments()
        self.device = groups[0][1][0][0].device
        self.dist_groups = dist_groups
        self.dist_backend = backend_for(self.device) if dist_groups is not None else None
        self.accepts_shm = all(cache[0][0].device.type == "cpu" for _, cache in groups)  # a host cache
        kv_copy.prepare(groups[0][1][0][0].device)
        # per group and layer, (K, V) of a host cache as raw views and as the copy op's tensors
        self._views = [[raw_layer(cache, i) for i in range(len(cache))] for _, cache in groups] \
            if self.accepts_shm else []
        self._tensors = [[tuple(map(kv_copy.as_tensor, kv)) for kv in views] for views in self._views]

    def open(self, p: TransferProgress, seq: Sequence, header: KVHeader) -> None:
        if p.covered is not None:
            raise TransferError(TransferFailure.CORRUPT, "the stream has a second header")
        if header.num_tokens != seq.num_prompt_tokens:
            raise TransferError(TransferFailure.MISMATCH, f"header says {header.num_tokens} tokens; the reservation "
                                f"holds a {seq.num_prompt_tokens}-token prompt")
        if header.dtype != DTYPE_NAMES[self.dtype]:
            raise TransferError(TransferFailure.MISMATCH, f"KV dtype {header.dtype} differs from this worker's "
                                f"{DTYPE_NAMES[self.dtype]}")
        mine = tuple(g for g, _ in self.groups)
        if header.groups != mine:
            raise TransferError(TransferFailure.MISMATCH, f"KV groups {list(header.groups)} differ from this "
                                f"worker's {list(mine)}")
        if header.num_cached_tokens != seq.num_cached_tokens:
            raise TransferError(TransferFailure.MISMATCH, f"the header says this worker holds the prompt's first "
                                f"{header.num_cached_tokens} tokens; its reservation holds {seq.num_cached_tokens} (the "
                                "ticket's count: a sender that ignores it is older than this worker)")
        if header.shm is not None and header.dist is not None:
            raise TransferError(TransferFailure.CORRUPT, "the header names both shared memory and a torch.distributed group")
        if header.shm is not None:
            self._open_shm(p, header)
        if header.dist is not None and self.dist_backend is None:
            raise TransferError(TransferFailure.MISMATCH, "this decode worker takes no K/V over torch.distributed")
        p.layer_offsets = list(np.cumsum([0] + [g.num_layers for g in mine]))
        p.covered = np.zeros((p.layer_offsets[-1], header.num_tokens), dtype=bool)
        p.covered[:, :seq.num_cached_tokens] = True  # in blocks adopted from the prefix cache: never written
        p.num_cached_tokens = seq.num_cached_tokens

    def _open_shm(self, p: TransferProgress, header: KVHeader) -> None:
        if not self.accepts_shm:
            raise TransferError(TransferFailure.MISMATCH, "this decode worker's KV cache is not in host memory; "
                                "it takes K/V over shared memory only into a CPU cache")
        if len(header.shm.segments) != len(self.groups):
            raise TransferError(TransferFailure.MISMATCH, f"the header names {len(header.shm.segments)} shared-memory "
                                f"segments for {len(self.groups)} KV groups")
        p.shm, p.shm_num_slots = [], header.shm.num_slots
        for name, (layout, cache) in zip(header.shm.segments, self.groups):
            k = raw_layer(cache, 0)[0]
            try:
                p.shm.append(self.peers.open(name, layout.num_layers, header.shm.num_slots, k.shape[1:], k.dtype))
            except (OSError, ValueError) as e:
                raise TransferError(TransferFailure.MISMATCH, f"cannot map the sender's KV segment {name}: {e}") from None

    async def join_dist(self, p: TransferProgress, header: KVHeader) -> None:
        """After `open`, for a header naming a torch.distributed group: join it (or find it joined)."""
        p.dist = await self.dist_groups.join(header.dist, self.dist_backend)
        p.dist_name = header.dist.name

    def drop_dist(self, p: TransferProgress) -> None:
        """A transfer over a group failed or ended early: the group goes (a send or a receive left
        unmatched would cross into its next push)."""
        if p.dist_name:
            self.dist_groups.drop(p.dist_name)

    async def fetch_dist(self, p: TransferProgress, d: KVData) -> tuple[torch.Tensor, int]:
        """A chunk whose bytes come over the header's torch.distributed group: received on the
        cache's device and checked against its checksum (the bytes, and their count). The caller
        checks the reservation is still live before `place_dist` writes them: the receive awaits."""
        if p.dist is None:
            raise TransferError(TransferFailure.CORRUPT, f"data chunk {d.seq} before the header")
        expected = self._check(p, d)
        if len(d.data) or d.src_runs:
            raise TransferError(TransferFailure.CORRUPT, f"chunk {d.seq} carries bytes or slots, but the header "
                                "named a torch.distributed group for them")
        layout, cache = self.groups[d.group]
        buf = await self.dist_groups.receive(p.dist, d, (2, d.num_tokens, layout.num_kv_heads, layout.head_dim),
                                             cache[d.layer][0].dtype, self.device, self.dist_backend)
        return buf, expected

    def place_dist(self, p: TransferProgress, seq: Sequence, d: KVData, buf: torch.Tensor, num_bytes: int) -> None:
        """`fetch_dist`'s bytes into the reserved slots."""
        _, slots, _ = self._plan(p, seq, d)
        place_kv(self.groups[d.group][1], d.layer, slots, buf)
        self._covered(p, d, num_bytes)

    def _check(self, p: TransferProgress, d: KVData) -> int:
        """A data chunk's place in the stream and in the prompt; its K and V bytes."""
        if p.covered is None:
            raise TransferError(TransferFailure.CORRUPT, f"data chunk {d.seq} before the header")
        if d.seq != p.num_chunks:
            raise TransferError(TransferFailure.CORRUPT, f"chunk {d.seq} arrived where chunk {p.num_chunks} "
                                "was expected (a chunk was lost or reordered)")
        if not 0 <= d.group < len(self.groups) or not 0 <= d.layer < self.groups[d.group][0].num_layers:
            raise TransferError(TransferFailure.CORRUPT, f"chunk {d.seq} names group {d.group} layer {d.layer}, "
                                "which does not exist")
        if d.group == 0 and p.target_ready:
            raise TransferError(TransferFailure.CORRUPT, f"chunk {d.seq} is the target's, after KVTargetReady")
        if d.num_tokens < 1 or d.token_start + d.num_tokens > p.covered.shape[1]:
            raise TransferError(TransferFailure.CORRUPT, f"chunk {d.seq} covers tokens [{d.token_start}, "
                                f"{d.token_start + d.num_tokens}) outside the prompt's {p.covered.shape[1]}")
        if d.token_start < p.num_cached_tokens:  # their blocks are shared with other sequences
            raise TransferError(TransferFailure.CORRUPT, f"chunk {d.seq} covers tokens from {d.token_start}, but this "
                                f"worker holds the first {p.num_cached_tokens} already")
        layout = self.groups[d.group][0]
        return 2 * d.num_tokens * layout.num_kv_heads * layout.head_dim * self.dtype.itemsize

    def _covered(self, p: TransferProgress, d: KVData, num_bytes: int) -> None:
        p.covered[p.layer_offsets[d.group] + d.layer, d.token_start:d.token_start + d.num_tokens] = True
        p.num_chunks += 1
        p.num_bytes += num_bytes

    def receive(self, p: TransferProgress, seq: Sequence, d: KVData) -> None:
        if p.dist is not None:
            raise TransferError(TransferFailure.CORRUPT, f"chunk {d.seq} of a torch.distributed transfer taken as bytes")
        expected = self._check(p, d)
        layout, cache = self.groups[d.group]
        _, slots, pieces = self._plan(p, seq, d)
        if d.src_runs:
            self._copy_shm(p, d, pieces)
        else:
            if len(d.data) != expected:
                raise TransferError(TransferFailure.CORRUPT, f"chunk {d.seq} has {len(d.data)} bytes; {d.num_tokens} "
                                    f"tokens of K and V take {expected}")
            if self.accepts_shm:  # one pass: copied into our slots and checked (as from shared memory)
                self._copy_bytes(d, slots)
            else:
                if kv_copy.crc32c(d.data) != d.crc32c:
                    raise TransferError(TransferFailure.CORRUPT, f"chunk {d.seq} failed its CRC-32C checksum")
                write_kv(cache, d.layer, slots, d.data)
        self._covered(p, d, expected)

    def _plan(self, p: TransferProgress, seq: Sequence, d: KVData) -> tuple:
        """The chunk's slots here and, from shared memory, its copy pieces: made for the first
        layer of a token range and reused by the others."""
        key = (d.token_start, d.num_tokens, d.src_runs)
        if p.plan is None or p.plan[0] != key:
            slots = slot_ids(seq, self.block_size, d.token_start, d.num_tokens)
            pieces = None
            if d.src_runs:
                if p.shm is None:
                    raise TransferError(TransferFailure.CORRUPT, f"chunk {d.seq} names shared-memory slots, but the "
                                        "header named no segments")
                try:
                    runs = parse_runs(d.src_runs, p.shm_num_slots, d.num_tokens)
                except ValueError as e:
                    raise TransferError(TransferFailure.CORRUPT, f"chunk {d.seq}: {e}") from None
                pieces = kv_copy.pieces_tensor(copy_pieces(runs, slots.numpy()))
            p.plan = (key, slots, pieces)
        return p.plan

    def _copy_bytes(self, d: KVData, slots) -> None:
        """A bytes chunk into our host cache, checked on the copy: a bad chunk lands only in the
        slots of this reservation, which then is freed."""
        dst = self._views[d.group][d.layer]
        kv = np.frombuffer(d.data, dtype=dst[0].dtype).reshape(2, d.num_tokens, *dst[0].shape[1:])
        if copy_runs([(0, d.num_tokens)], slots.numpy(), (kv[0], kv[1]), self._tensors[d.group][d.layer]) != d.crc32c:
            raise TransferError(TransferFailure.CORRUPT, f"chunk {d.seq} failed its CRC-32C checksum")

    def _copy_shm(self, p: TransferProgress, d: KVData, pieces) -> None:
        """The chunk's tokens from the sender's segment into our slots, checked after the copy
        (a bad copy lands only in the slots of this reservation, which then is freed)."""
        try:
            crc = kv_copy.copy_rows(p.shm[d.group].tensors[d.layer], self._tensors[d.group][d.layer], pieces)
        except ValueError as e:
            raise TransferError(TransferFailure.CORRUPT, f"chunk {d.seq}: {e}") from None
        if crc != d.crc32c:
            raise TransferError(TransferFailure.CORRUPT, f"chunk {d.seq} failed its CRC-32C checksum after the "
                                "copy from shared memory")

    def target_ready(self, p: TransferProgress, t: KVTargetReady) -> None:
        """Mid-stream: the chunks so far cover every layer of the target (group 0) for the whole
        prompt, and the first token is a token; else a `TransferError`."""
        if p.covered is None:
            raise TransferError(TransferFailure.CORRUPT, "KVTargetReady before the header")
        if len(self.groups) < 2:
            raise TransferError(TransferFailure.CORRUPT, "KVTargetReady, but this worker's KV cache has no draft "
                                "group to follow")
        if t.num_chunks != p.num_chunks:
            raise TransferError(TransferFailure.CORRUPT, f"KVTargetReady counts {t.num_chunks} chunks but "
                                f"{p.num_chunks} arrived")
        if not p.covered[:p.layer_offsets[1]].all():
            row = int(np.argmin(p.covered[:p.layer_offsets[1]].all(axis=1)))
            raise TransferError(TransferFailure.CORRUPT, f"KVTargetReady, but the target's layer {row} lacks tokens")
        if not 0 <= t.first_token_id < self.vocab_size:
            raise TransferError(TransferFailure.CORRUPT, f"first token {t.first_token_id} is outside the vocabulary")
        p.target_ready = True

    def finish(self, p: TransferProgress, t: KVTrailer) -> None:
        if p.covered is None:
            raise TransferError(TransferFailure.CORRUPT, "trailer before the header")
        if t.num_chunks != p.num_chunks:
            raise TransferError(TransferFailure.CORRUPT, f"transfer truncated: the trailer counts {t.num_chunks} "
                                f"chunks but {p.num_chunks} arrived")
        if not p.covered.all():
            row = int(np.argmin(p.covered.all(axis=1)))
            raise TransferError(TransferFailure.CORRUPT, f"transfer incomplete: layer row {row} lacks tokens")
        if not 0 <= t.first_token_id < self.vocab_size:
            raise TransferError(TransferFailure.CORRUPT, f"first token {t.first_token_id} is outside the vocabulary")
