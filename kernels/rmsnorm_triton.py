"""RMSNorm and fused add+RMSNorm as Triton kernels (the GPU path of kernels/rmsnorm.py).

Theory of operation: one program per row; the row is loaded once, its mean square is
taken in float32, and the normalized row is rounded to x's dtype before it is
multiplied by the weight, exactly as `rmsnorm_ref` orders the roundings (the product
of two bf16 values is exact in float32, so the final rounding matches too). The fused
variant adds the residual in float32, rounds the sum to the model dtype, stores it
into x (the new residual stream, as the CPU path does with `x.add_`) and normalizes
that rounded sum, so no second pass over memory is needed. Under PDL the weight, which
no kernel writes, is requested before the wait on the kernel ahead (a bs=1 step of
Llama-3.1-8B on an H100 measured 1.007x, BENCHMARKS.md).

Invariants: the last axis is contiguous (stride 1); rows may have any stride; the
hidden size fits one block (BLOCK >= hidden, a power of two).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shunter.kernels.pdl import pdl_args, pdl_enter, use_pdl


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    x_row_stride,
    res_row_stride,
    out_row_stride,
    hidden,
    eps,
    FUSED_ADD: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    cols = tl.arange(0, BLOCK)
    m = cols < hidden
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)  # a weight: before the wait
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    x = tl.load(x_row + cols, mask=m, other=0.0)
    dtype = x.dtype
    xf = x.to(tl.float32)
    if FUSED_ADD:
        r = tl.load(res_ptr + row * res_row_stride + cols, mask=m, other=0.0)
        s = (xf + r.to(tl.float32)).to(dtype)
        tl.store(x_row + cols, s, mask=m)
        xf = s.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / hidden
    rstd = 1.0 / tl.sqrt(var + eps)
    normed = (xf * rstd).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, (normed * w).to(dtype), mask=m)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    hidden = x.shape[-1]
    assert x.stride(-1) == 1, "rmsnorm_triton needs a contiguous last axis"
    assert weight.shape == (hidden,) and weight.is_contiguous()
    x2 = x.view(-1, hidden)  # [rows, hidden]; fails loudly on a layout view() cannot express
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    r2 = x2
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(-1) == 1
        r2 = residual.view(-1, hidden)
    num_rows = x2.shape[0]
    if num_rows:
        block = triton.next_power_of_2(hidden)
        _rmsnorm_kernel[(num_rows,)](
            x2,
            r2,
            weight,
            out,
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            hidden,
            eps,
            FUSED_ADD=residual is not None,
            BLOCK=block,
            num_warps=min(max(block // 256, 1), 8),
            **pdl_args(use_pdl(x2)),
        )
    return out.view(x.shape)


def rmsnorm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[..., hidden] -> [..., hidden], same dtype as x (a new tensor)."""
    return _launch(x, None, weight, eps)


def fused_add_rmsnorm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rmsnorm(x + residual), x + residual); the sum is written into x."""
    out = _launch(x, residual, weight, eps)
    return out, x
