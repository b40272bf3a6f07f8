"""What the adaptive depth's tests share: a sequence to plan for, and the row blocks of the demo
target's projections on a CPU with AMX."""
from __future__ import annotations

from pdserve.engine import SamplingParams
from pdserve.engine.sequence import Sequence


def seq_(req_id: str = "r") -> Sequence:
    return Sequence(req_id, [1, 2, 3], SamplingParams(), seed=0)


def tile_blocks(n: int) -> int:
    """16-row blocks from 7 rows (`kernels/cpu/linear.cpp`), none below."""
    return -(-n // 16) if n >= 7 else 0
