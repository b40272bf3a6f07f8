"""Driving a `SpeculationGate` by hand in tests (no wall clock): steps in the modes it allows,
each measured at given seconds and tokens, as the engine would measure them."""
from __future__ import annotations

from pdserve.engine.spec_decode.gate import SpeculationGate as Gate


def runs_of(decisions: list[bool], mode: bool) -> list[tuple[int, int]]:
    """(start index, length) of each run of `mode` in decisions."""
    runs, start = [], None
    for i, d in enumerate(decisions + [not mode]):
        if d == mode and start is None:
            start = i
        elif d != mode and start is not None:
            runs.append((start, i - start))
            start = None
    return runs


def measured(batch_size: int, spec: tuple[float, int], plain: tuple[float, int]) -> Gate:
    """A gate whose opening bursts at `batch_size`, temperature 1, measured each speculative step
    at spec and each plain one at plain (seconds, tokens emitted)."""
    gate = Gate()
    assert drive(gate, batch_size, Gate.OPENING, spec, plain) == [True] * Gate.BURST + [False] * (Gate.OPENING - Gate.BURST)
    return gate


def drive(gate: Gate, batch_size: int, steps: int, spec: tuple[float, int], plain: tuple[float, int],
           sampled: bool = True) -> list[bool]:
    """`steps` steps at `batch_size`, each in the mode the gate allows and measured as the engine
    would: at spec or plain (seconds, tokens emitted). The modes, in order."""
    modes = []
    for _ in range(steps):
        mode = gate.allow(batch_size, sampled)
        gate.observe(batch_size, mode, *(spec if mode else plain), sampled=sampled)
        modes.append(mode)
    return modes
