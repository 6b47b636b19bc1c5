"""RMSNorm, plain and fused with the residual add.

`rmsnorm(x, w, eps)`: y = x / sqrt(mean(x^2) + eps) * w, the statistics in float32 and
the product taken in x's dtype, as HF Llama does (so float32 matches it exactly).
`fused_add_rmsnorm(x, residual, w, eps)`: residual' = x + residual, y = rmsnorm(residual');
returns (y, residual') so a decoder layer keeps one running residual stream.

The CPU path uses torch's fused `rms_norm` where it exists; the signatures carry no
device assumptions so a GPU kernel can take the same arguments.
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
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    residual = x + residual
    return rmsnorm_ref(residual, weight, eps), residual


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[..., hidden] -> [..., hidden], same dtype as x."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return rmsnorm_ref(x, weight, eps)


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rmsnorm(x + residual), x + residual)."""
    residual = x.add_(residual) if not x.requires_grad else x + residual
    return rmsnorm(residual, weight, eps), residual
