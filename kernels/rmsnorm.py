"""RMSNorm, plain and fused with the residual add.

`rmsnorm(x, w, eps)`: y = x / sqrt(mean(x^2) + eps) * w, the statistics in float32 and
the product taken in x's dtype, as HF Llama does (so float32 matches it exactly).
`fused_add_rmsnorm(x, residual, w, eps)`: residual' = x + residual, y = rmsnorm(residual');
returns (y, residual') so a decoder layer keeps one running residual stream. At the
first layer (residual None) residual' is x itself.

Dispatch: CUDA tensors go to the Triton kernels of kernels/rmsnorm_triton.py (imported
on first use, so installs without Triton keep the CPU path); everything else takes
the torch path (`*_torch`), which uses torch's fused `rms_norm` where it exists.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [..., hidden]; weight: [hidden]
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(var + eps)).to(x.dtype)


def fused_add_rmsnorm_ref(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    residual = x if residual is None else x + residual
    return rmsnorm_ref(residual, weight, eps), residual


def rmsnorm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch path of `rmsnorm` (any device)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return rmsnorm_ref(x, weight, eps)


def fused_add_rmsnorm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path of `fused_add_rmsnorm` (any device)."""
    residual = x.add_(residual) if not x.requires_grad else x + residual
    return rmsnorm_torch(residual, weight, eps), residual


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[..., hidden] -> [..., hidden], same dtype as x."""
    if x.is_cuda:
        from shunter.kernels.rmsnorm_triton import rmsnorm_triton

        # per-head norms get [T, H, D] views of the fused projection, whose rows the
        # kernel's [rows, hidden] view cannot express: those are copied first
        x2 = x.reshape(-1, x.shape[-1])  # [rows, hidden]
        return rmsnorm_triton(x2, weight, eps).view(x.shape)
    return rmsnorm_torch(x, weight, eps)


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rmsnorm(x + residual), x + residual); the sum is written into x unless
    x requires grad. With residual None: (rmsnorm(x), x)."""
    if residual is None:
        return rmsnorm(x, weight, eps), x
    if x.is_cuda and not x.requires_grad:
        from shunter.kernels.rmsnorm_triton import fused_add_rmsnorm_triton

        return fused_add_rmsnorm_triton(x, residual, weight, eps)
    return fused_add_rmsnorm_torch(x, residual, weight, eps)
