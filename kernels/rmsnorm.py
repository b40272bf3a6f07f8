"""RMSNorm, plain and fused with the residual add (Llama/Qwen2/Mistral `*RMSNorm`)."""
from __future__ import annotations

import torch

from pdserve.kernels._triton import tl, triton


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [num_tokens, hidden]; weight: [hidden]. Math in float32, as transformers does.
    (torch's own `rms_norm` gives the same bits but costs twice as much on a CPU row: it
    runs more ops inside.)"""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); the sum is the next layer's residual."""
    summed = x + residual
    return rms_norm_ref(summed, weight, eps), summed


@triton.jit
def rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, summed_ptr,
    hidden, x_row_stride, residual_row_stride, out_row_stride, summed_row_stride,
    eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    # One program per token; the whole row fits one tile (hidden <= 16k).
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * x_row_stride + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * residual_row_stride + offs, mask=mask, other=0.0)
        # round the sum to the stream dtype first, as the reference's `x + residual` does
        x = (x.to(tl.float32) + r.to(tl.float32)).to(summed_ptr.dtype.element_ty)
        tl.store(summed_ptr + row * summed_row_stride + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    # the reference rounds the normed row to x's dtype before the weight multiply
    normed = (xf * inv_rms).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _check_rows(name: str, t: torch.Tensor, hidden: int) -> None:
    assert t.dim() == 2 and t.shape[1] == hidden, f"{name} must be [num_tokens, {hidden}], got {tuple(t.shape)}"
    assert t.stride(1) == 1, f"{name} rows must be contiguous, got strides {t.stride()}"


def _launch_rms_norm(x, residual, weight, eps):
    hidden = weight.shape[0]
    assert weight.dim() == 1 and weight.is_contiguous(), f"weight must be contiguous [hidden], got {tuple(weight.shape)}"
    _check_rows("x", x, hidden)
    block = triton.next_power_of_2(hidden)
    assert block <= 16384, f"hidden {hidden} is larger than one tile (16384)"
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    if residual is not None:
        _check_rows("residual", residual, hidden)
        assert residual.shape == x.shape, f"residual {tuple(residual.shape)} != x {tuple(x.shape)}"
        x_dtype = torch.promote_types(x.dtype, residual.dtype)
        summed = torch.empty(x.shape, dtype=x_dtype, device=x.device)
        out_dtype = torch.promote_types(weight.dtype, x_dtype)
    else:
        summed = None
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if x.shape[0] > 0:
        rms_norm_kernel[(x.shape[0],)](
            x, residual if residual is not None else x, weight, out, summed if summed is not None else out,
            hidden, x.stride(0), residual.stride(0) if residual is not None else 0,
            out.stride(0), summed.stride(0) if summed is not None else 0,
            eps, HAS_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=4 if block <= 4096 else 8,
        )
    return out, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton `rms_norm_ref`. x: [num_tokens, hidden]; weight: [hidden]."""
    return _launch_rms_norm(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `fused_add_rms_norm_ref`: (rms_norm(x + residual), x + residual) in one pass."""
    return _launch_rms_norm(x, residual, weight, eps)
