"""Projections y = x @ W^T + b, and the MLP's down projection of silu(gate) * up.

Dispatch: a CUDA step of at most `SKINNY_MAX_ROWS` rows in bfloat16/float16 (a decode
step at small batch, where a projection only streams its weight) goes to the skinny
Triton kernel of kernels/linear_triton.py (imported on first use), which also folds the
SwiGLU into the down projection's operand load; everything else is `F.linear` (cuBLAS
on CUDA, oneDNN on the CPU), after `silu_mul` for the fused form.

The skinny kernel is off by default (SKINNY_MAX_ROWS = 0): on an H200 at the 8B shape
its current tiling streams weights at about a third of cuBLAS's speed (bs=1 decode
88 tok/s against 217 with cuBLAS in the same run), so cuBLAS serves every size until a
tuned tiling beats it (`tests/kernels/test_linear_triton.py` keeps it correct).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shunter.kernels.silu_mul import silu_mul

SKINNY_MAX_ROWS = 0  # rows up to which the skinny kernel runs (0: never; see above)
_SKINNY_DTYPES = (torch.bfloat16, torch.float16)


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """float32 reference rounded to x's dtype."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def silu_mul_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    from shunter.kernels.silu_mul import silu_mul_ref

    return linear_ref(silu_mul_ref(x), weight, bias)


def _skinny(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.is_cuda
        and x.dim() == 2
        and x.shape[0] <= SKINNY_MAX_ROWS
        and x.dtype in _SKINNY_DTYPES
        and weight.dtype == x.dtype
        and x.stride(1) == 1
        and weight.stride(1) == 1
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """x [T, K] @ weight [N, K]^T (+ bias [N]) -> [T, N] in x's dtype."""
    if _skinny(x, weight):
        from shunter.kernels.linear_triton import linear_skinny_triton

        return linear_skinny_triton(x, weight, bias)
    return F.linear(x, weight, bias)


def silu_mul_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """silu(gate) * up of x [T, 2K] (gate | up), @ weight [N, K]^T (+ bias) -> [T, N]."""
    if _skinny(x, weight):
        from shunter.kernels.linear_triton import linear_skinny_triton

        return linear_skinny_triton(x, weight, bias, silu_mul=True)
    return F.linear(silu_mul(x), weight, bias)
