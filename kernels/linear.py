"""Projections y = x @ W^T + b, the MLP's down projection of silu(gate) * up, and a
projection of a layer's (add +) RMSNorm output.

Dispatch: a CUDA step of at most `SKINNY_MAX_ROWS` rows in bfloat16/float16 (a decode
step at small batch, where a projection only streams its weight) goes to the GEMV
Triton kernel of kernels/linear_triton.py (imported on first use); everything else is
`F.linear` (cuBLAS on CUDA, oneDNN on the CPU), after `silu_mul` / `fused_add_rmsnorm`
for the fused forms. On an H200 a bs=1 step of Llama-3.1-8B ran 1.02-1.04x faster
with the GEMV on qkv, o and down than with cuBLAS, and its one-weight-row tiles
(gemv_config) added 1.02-1.03x, and moving gate/up and the logits (28,672 and 128,256
rows) from cuBLAS onto it another 1.03x. The kernel can also fold the SwiGLU, or the
add + RMSNorm, into its operand load (`FUSE_SILU`, `FUSE_NORM`), saving those
launches, but every program then re-reads the activations and the step got slower
(BENCHMARKS.md), so both are off.
`gate_up_swiglu` with `FUSE_GATE_UP_SWIGLU` applies the SwiGLU in the gate/up GEMV's
store instead, where nothing is re-read; that measured no faster either, and is off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shunter.kernels.rmsnorm import fused_add_rmsnorm
from shunter.kernels.silu_mul import silu_mul

SKINNY_MAX_ROWS = 1  # rows up to which the GEMV kernel runs (0: never)
GEMV_MAX_N = 1 << 18  # widest weight (output rows) it takes
FUSE_NORM = False  # norm_linear folds the (add +) RMSNorm into the GEMV's load
FUSE_SILU = False  # silu_mul_linear folds the SwiGLU into the GEMV's load
# gate_up_swiglu: a one-row gate/up GEMV applies the SwiGLU as it stores (no re-reads;
# one launch a layer fewer); a whole bs=1 step on an H100 measured no faster (1.003x
# and, with the qkv epilogue, 0.998x: BENCHMARKS.md), so off.
FUSE_GATE_UP_SWIGLU = False
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


def norm_linear_ref(x, residual, norm_weight, eps, weight, bias=None):
    from shunter.kernels.rmsnorm import fused_add_rmsnorm_ref

    h, s = fused_add_rmsnorm_ref(x, residual, norm_weight, eps)
    return linear_ref(h, weight, bias), s


def _skinny(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.is_cuda
        and x.dim() == 2
        and x.shape[0] <= SKINNY_MAX_ROWS
        and x.dtype in _SKINNY_DTYPES
        and weight.dtype == x.dtype
        and x.stride(1) == 1
        and weight.stride(1) == 1
        and weight.shape[0] <= GEMV_MAX_N
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """x [T, K] @ weight [N, K]^T (+ bias [N]) -> [T, N] in x's dtype."""
    if _skinny(x, weight):
        from shunter.kernels.linear_triton import linear_gemv_triton

        return linear_gemv_triton(x, weight, bias)
    return F.linear(x, weight, bias)


def silu_mul_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """silu(gate) * up of x [T, 2K] (gate | up), @ weight [N, K]^T (+ bias) -> [T, N]."""
    if FUSE_SILU and _skinny(x, weight):
        from shunter.kernels.linear_triton import linear_gemv_triton

        return linear_gemv_triton(x, weight, bias, silu_mul=True)
    return linear(silu_mul(x), weight, bias)


def gate_up_swiglu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """silu_mul(x [T, K] @ weight [2N, K]^T (+ bias)) -> [T, N]: the MLP's gate|up
    projection and its SwiGLU."""
    if FUSE_GATE_UP_SWIGLU and bias is None and x.shape[0] == 1 and _skinny(x, weight):
        from shunter.kernels.linear_triton import gate_up_swiglu_gemv_triton

        return gate_up_swiglu_gemv_triton(x, weight)
    return silu_mul(linear(x, weight, bias))


def norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(s, norm_weight) @ weight^T (+ bias), s) with s = x + residual, or x when
    residual is None: a decoder layer's norm and the projection after it. s is the new
    residual stream; x may be overwritten with it."""
    if FUSE_NORM and _skinny(x, weight):
        from shunter.kernels.linear_triton import norm_linear_gemv_triton

        return norm_linear_gemv_triton(x, residual, norm_weight, eps, weight, bias)
    h, s = fused_add_rmsnorm(x, residual, norm_weight, eps)
    return linear(h, weight, bias), s
