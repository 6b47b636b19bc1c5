"""SwiGLU activation: silu(gate) * up over a fused [.., 2*inter] gate_up projection.

The first half of the last axis is the gate, the second half the up projection (the
order in which the model fuses gate_proj and up_proj). CUDA tensors go to the Triton
kernel of kernels/silu_mul_triton.py (imported on first use); others take the torch path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    # x: [..., 2 * inter] -> [..., inter]
    d = x.shape[-1] // 2
    gate, up = x[..., :d], x[..., d:]
    return gate * torch.sigmoid(gate) * up


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 * inter] -> [..., inter]."""
    if x.is_cuda:
        from shunter.kernels.silu_mul_triton import silu_mul_triton

        return silu_mul_triton(x)
    return silu_mul_torch(x)


def silu_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """The torch path of `silu_mul` (any device)."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_mul needs an even last axis, got {x.shape[-1]}")
    d = x.shape[-1] // 2
    out = F.silu(x[..., :d])
    return out.mul_(x[..., d:])
