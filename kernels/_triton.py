"""The one place that imports Triton, so every kernel module imports where Triton cannot run.

`HAS_TRITON` says whether the import worked. Without it, `triton.jit` is replaced by an identity
decorator so modules still define their kernels (they are never launched then).
"""
from __future__ import annotations

try:  # pragma: no cover - depends on the installation
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # ImportError, or a broken driver probe on exotic machines
    HAS_TRITON = False

    class _TritonStub:
        @staticmethod
        def jit(fn=None, **_kwargs):
            return fn if fn is not None else (lambda f: f)

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 << max(0, (n - 1).bit_length())

    triton = _TritonStub()  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]

__all__ = ["HAS_TRITON", "triton", "tl"]
