"""Kernels: each op as a Triton kernel beside its plain-torch reference.

`select_ops(backend, device)` picks one implementation of every op, once, for an engine to
hold. The torch references are the CPU path and the test oracle.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from pdserve.kernels._triton import HAS_TRITON
from pdserve.kernels.extend_attention import extend_attention_ref
from pdserve.kernels.kv_write import write_kv_ref
from pdserve.kernels.paged_attention import paged_decode_attention_ref
from pdserve.kernels.rmsnorm import fused_add_rms_norm_ref, rms_norm_ref
from pdserve.kernels.rotary import apply_rotary_ref, build_rope_cache
from pdserve.kernels.sampling import argmax_rows, filter_probs_ref, race_ref, sample_from_probs_ref, sample_ref

BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True, slots=True)
class KernelOps:
    """One implementation of every op; signatures are those of the `*_ref` functions."""

    name: str
    rms_norm: Callable
    fused_add_rms_norm: Callable
    apply_rotary: Callable
    write_kv: Callable
    paged_decode_attention: Callable
    extend_attention: Callable
    filter_probs: Callable
    sample: Callable


TORCH_OPS = KernelOps(
    name="torch",
    rms_norm=rms_norm_ref,
    fused_add_rms_norm=fused_add_rms_norm_ref,
    apply_rotary=apply_rotary_ref,
    write_kv=write_kv_ref,
    paged_decode_attention=paged_decode_attention_ref,
    extend_attention=extend_attention_ref,
    filter_probs=filter_probs_ref,
    sample=sample_ref,
)


def _triton_ops() -> KernelOps:
    from pdserve.kernels.triton_ops import TRITON_OPS  # imported lazily: only this backend needs it

    return TRITON_OPS


def select_ops(backend: str, device: torch.device) -> KernelOps:
    """"auto": Triton on CUDA, torch elsewhere; "triton" and "torch" force one."""
    if backend not in BACKENDS:
        raise ValueError(f"kernel_backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return TORCH_OPS
    if not HAS_TRITON:
        raise ValueError("kernel_backend='triton' needs the triton package, which is not importable")
    return _triton_ops()


__all__ = [
    "BACKENDS", "KernelOps", "TORCH_OPS", "select_ops", "build_rope_cache", "sample_from_probs_ref",
    "filter_probs_ref", "race_ref", "argmax_rows",
]
