"""The Triton implementation of every op, for `select_ops("triton" | "auto" on CUDA)`.

Imported only when that backend is chosen; each launcher has its reference's signature.

Sampling is the exception: this backend samples and filters with torch's references
(`sample_ref`, `filter_probs_ref`). On the H200 the Triton `sample` kernel (one program per
row) took 0.13-0.80x the reference's speed in all nine cases `benchmarks/gpu_check.py` timed
(1, 32 and 128 rows of a 128k vocabulary, no filter, top-p, top-k + top-p + min-p;
`BENCHMARKS.md`, GPU), with the same tokens: 444 against 239 us for one row at temperature
only, 4.4 ms against 0.57 ms with all three filters. The kernel stays, tested against the
reference, for the work that would make it pay (several programs per row). `filter_probs` is the same kernel without the race (the same searches over
each row in one program), so it goes to its reference too; that one was not timed on its own.
"""
from __future__ import annotations

from pdserve.kernels import KernelOps
from pdserve.kernels.extend_attention import extend_attention
from pdserve.kernels.kv_write import write_kv
from pdserve.kernels.paged_attention import paged_decode_attention
from pdserve.kernels.rmsnorm import fused_add_rms_norm, rms_norm
from pdserve.kernels.rotary import apply_rotary
from pdserve.kernels.sampling import filter_probs_ref, sample_ref

TRITON_OPS = KernelOps(
    name="triton",
    rms_norm=rms_norm,
    fused_add_rms_norm=fused_add_rms_norm,
    apply_rotary=apply_rotary,
    write_kv=write_kv,
    paged_decode_attention=paged_decode_attention,
    extend_attention=extend_attention,
    filter_probs=filter_probs_ref,  # the same kernel's searches: see above
    sample=sample_ref,  # faster than the kernel on the H200: see above
)
