"""SwiGLU silu(gate) * up as a Triton kernel (the GPU path of kernels/silu_mul.py).

Theory of operation: a 2-D grid (row, column block); each program reads a block of
the gate half and the matching block of the up half of one row and writes one block
of the output. silu is taken in float32 and rounded to the input dtype before the
product, as `F.silu(gate) * up` rounds on the CPU path.

Launched with programmatic dependent launch on Hopper (kernels/pdl.py).

Invariants: the last axis is contiguous and even; rows may have any stride.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shunter.kernels.pdl import pdl_args, pdl_enter, use_pdl


@triton.jit
def _silu_mul_kernel(
    x_ptr, out_ptr, x_row_stride, out_row_stride, inter,
    BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < inter
    x_row = x_ptr + row * x_row_stride
    gate = tl.load(x_row + cols, mask=m, other=0.0)
    up = tl.load(x_row + inter + cols, mask=m, other=0.0)
    gf = gate.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(gate.dtype).to(tl.float32)
    tl.store(
        out_ptr + row * out_row_stride + cols, (act * up.to(tl.float32)).to(gate.dtype), mask=m
    )


def silu_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 * inter] -> [..., inter]."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_mul needs an even last axis, got {x.shape[-1]}")
    assert x.stride(-1) == 1, "silu_mul_triton needs a contiguous last axis"
    inter = x.shape[-1] // 2
    x2 = x.view(-1, x.shape[-1])  # [rows, 2 * inter]
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    if x2.shape[0] and inter:
        block = min(triton.next_power_of_2(inter), 1024)
        grid = (x2.shape[0], triton.cdiv(inter, block))
        _silu_mul_kernel[grid](x2, out, x2.stride(0), out.stride(0), inter, BLOCK=block,
                               **pdl_args(use_pdl(x2)))  # fmt: skip
    return out.view(*x.shape[:-1], inter)
