"""How a paged decode attention launch is shaped on a GPU (`paged_attention.py`'s kernels):
split-K or one pass (`choose_partition_size`), tokens per K/V tile (`choose_block_n`), and
whether one pass prefetches its next tile (`choose_prefetch`), from the batch, the KV heads, the
context bound and the device's multiprocessors, each rule with what it was measured on.
"""
from __future__ import annotations

import functools

import torch

SHORT_CONTEXT = 512  # contexts up to this long always run in one pass
PROGRAMS_PER_SM = 3  # split-K until the grid has about this many programs per multiprocessor
PROGRAMS_PER_SM_WIDE = 1  # the same above head_dim 64, where each program has twice the bytes


@functools.cache
def _num_sms(device: torch.device) -> int:
    """Read once per device: the launcher asks on every call."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # an H100/H200's count; only the split heuristic reads it


def _grid_batch(num_seqs: int) -> int:
    """The batch as the launch heuristics count it: its next power of two, which an eager step
    of n sequences shares with its CUDA graph's bucket (n <= bucket <= that power,
    `engine/cuda_graphs.py`), so the two launch alike and compute the same bits."""
    return 1 << max(0, num_seqs - 1).bit_length()


def choose_partition_size(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device,
                          head_dim: int = 64) -> int:
    """0 (one pass) when the (sequence, KV head) programs already number PROGRAMS_PER_SM per
    multiprocessor or the context is short; otherwise split-K with partitions of a power of two
    (at least one tile) that cut each sequence into enough parts to get there.

    Measured on an H200 (132 multiprocessors; `benchmarks/gpu_check.py`, CUDA-graph replays, a
    cold L2, head_dim 64, 128-token tiles, 16-bit dots, the fused reduce), TB/s by partition size,
    and the default launcher's (`benchmarks/results/gpu_h200_2`):

        batch 1, context 4096 (8 programs)    best 256: 0.62 (128: 0.55, one pass 0.12); default 0.53
        batch 8, context 4096 (64)            best 512: 2.71 (256: 2.23, 1024: 2.22);    default 2.70
        batch 32, context 2048 (256)          best 1024: 3.44 (512: 3.17, one pass 2.78); default 3.43
        batch 64, context 2048 (512)          best one pass: 3.96 (1024: 3.67);          default 3.82
        batch 128, context 1024 (1024)        best one pass: 3.72 (512: 3.39);           default 3.62
        batch 32, context 512 (256)           one pass 2.16, 256: 2.21;                  default 2.27

    The rule picks the best or next to it in each row (at batch 1, 4 MB in all, 128 where 256 was
    best): about four programs per multiprocessor keep enough loads in flight (splits come in
    powers of two, so three asked for is usually about four), and past that a split only adds
    its partial outputs and their merge. Above head_dim 64 each program has twice the bytes and
    one program per multiprocessor is enough: batch 32 at head_dim 128 ran in one pass (with the
    prefetch) in 67.8 us, 3.97 TB/s, against 68.9 split in two.

    `max_context` is an upper bound from block_tables' width, so choosing costs no host sync;
    the batch counts as `_grid_batch`.
    """
    programs = _grid_batch(num_seqs) * num_kv_heads
    target = (PROGRAMS_PER_SM if head_dim <= 64 else PROGRAMS_PER_SM_WIDE) * _num_sms(device)
    if max_context <= SHORT_CONTEXT or programs >= target:
        return 0
    parts = -(-target // programs)
    size = max(choose_block_n(head_dim), 1 << max(0, (max_context // parts).bit_length() - 1))
    return size if size < max_context else 0


def choose_prefetch(num_seqs: int, num_kv_heads: int, partition_size: int, device: torch.device) -> bool:
    """Prefetch the next tile in one pass over fewer than PROGRAMS_PER_SM programs per
    multiprocessor, where each program's loads in flight are what the memory waits on; not in
    split-K or with more programs, where the prefetch's registers (about twice the tiles) keep
    programs from running side by side. On the H200 (`benchmarks/gpu_check.py`): head_dim 128,
    batch 32 (256 programs) 67 us with, 82 without; head_dim 64, batch 64 (512 programs) 3.29 TB/s
    with, 3.98 without."""
    return partition_size == 0 and _grid_batch(num_seqs) * num_kv_heads < PROGRAMS_PER_SM * _num_sms(device)


def choose_block_n(head_dim: int) -> int:
    """Tokens per K/V tile: 16 KB tiles of 16-bit values, 128 tokens at head_dim <= 64 and 64
    above. On the H200 (`benchmarks/gpu_check.py`, batch 32, context 2048): at head_dim 64 one
    pass took 48 us with 128-token tiles, 60 with 64; at head_dim 128 (prefetching) 68 us with 64,
    83 with 32."""
    return 128 if head_dim <= 64 else 64
