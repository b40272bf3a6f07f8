"""The Triton implementation of every op, for `select_ops("triton" | "auto" on CUDA)`.

Imported only when that backend is chosen; each launcher has its reference's signature.
"""
from __future__ import annotations

from pdserve.kernels import KernelOps
from pdserve.kernels.extend_attention import extend_attention
from pdserve.kernels.kv_write import write_kv
from pdserve.kernels.paged_attention import paged_decode_attention
from pdserve.kernels.rmsnorm import fused_add_rms_norm, rms_norm
from pdserve.kernels.rotary import apply_rotary
from pdserve.kernels.sampling import filter_probs, sample

TRITON_OPS = KernelOps(
    name="triton",
    rms_norm=rms_norm,
    fused_add_rms_norm=fused_add_rms_norm,
    apply_rotary=apply_rotary,
    write_kv=write_kv,
    paged_decode_attention=paged_decode_attention,
    extend_attention=extend_attention,
    filter_probs=filter_probs,
    sample=sample,
)
