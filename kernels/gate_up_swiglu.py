"""The MLP's gate/up projection followed by its SwiGLU: silu(x @ W_gate^T) * (x @ W_up^T)
with W the fused [2 * inter, K] gate_up weight (gate rows first, as the model stacks
gate_proj and up_proj).

Dispatch: a CUDA step of at least `MIN_ROWS` rows (a prefill, where the projection
is a compute-bound GEMM and the [rows, 2 * inter] intermediate costs a write and a
read of its own) in bfloat16/float16 goes to the one-kernel GEMM of
kernels/gate_up_swiglu_triton.py (imported on first use); everything else is
`F.linear` then `silu_mul`, two launches, the gate_up output rounded in between.
`MIN_ROWS` 0 means never.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shunter.kernels.silu_mul import silu_mul

MIN_ROWS = 0  # rows from which the fused GEMM runs (0: never)
_DTYPES = (torch.bfloat16, torch.float16)


def gate_up_swiglu_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float32 reference, rounded once to x's dtype (as the fused kernel rounds)."""
    inter = weight.shape[0] // 2
    gu = x.float() @ weight.float().t()
    gate, up = gu[:, :inter], gu[:, inter:]
    return (gate * torch.sigmoid(gate) * up).to(x.dtype)


def tma_ready(t: torch.Tensor) -> bool:
    """A 2-D operand TMA can read: contiguous last axis, 16-byte aligned start and rows."""
    size = t.element_size()
    return (
        t.dim() == 2
        and t.stride(1) == 1
        and (t.stride(0) * size) % 16 == 0
        and (t.shape[1] * size) % 16 == 0
        and t.data_ptr() % 16 == 0
    )


def fused_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `gate_up_swiglu` takes the one-kernel GEMM for these operands."""
    return x.is_cuda and fused_shapes(x, weight)


def fused_shapes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the operands' rows, dtypes and alignment suit the one-kernel GEMM (when
    switched on: MIN_ROWS > 0), wherever they are."""
    return (
        MIN_ROWS > 0
        and x.dim() == 2
        and x.shape[0] >= MIN_ROWS
        and x.dtype in _DTYPES
        and weight.dtype == x.dtype
        and tma_ready(x)
        and tma_ready(weight)
        and (weight.shape[0] // 2 * x.element_size()) % 16 == 0  # the output's rows
    )


def gate_up_swiglu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, K], weight [2 * inter, K] -> [T, inter]."""
    if fused_applies(x, weight):
        from shunter.kernels.gate_up_swiglu_triton import gate_up_swiglu_triton

        return gate_up_swiglu_triton(x, weight)
    return silu_mul(F.linear(x, weight))
