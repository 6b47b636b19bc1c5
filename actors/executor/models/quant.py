"""Weight formats for the linear layers: keep the matmul weights smaller than the
model dtype to cut the bytes each decode step reads.

Theory of operation: decode on a CPU is bound by reading weights. `convert_linears`
swaps every projection (and the logits matrix) for a `PackedLinear` that holds:
  - "bf16": the weight in bfloat16; inputs are cast to bfloat16 for the matmul and the
    output back to the model dtype;
  - "int8": a per-output-channel symmetric int8 copy with bfloat16 scales, used for
    small batches (few rows: bandwidth-bound, int8 reads 4x fewer bytes than float32),
    plus the bfloat16 copy for larger ones (compute-bound, where the bf16 GEMM wins).
The model dtype, the residual stream, norms, rope, attention and the KV pool are
unchanged. Greedy parity with float32 is not promised in these formats (they round
the weights); "none" keeps the plain layers.

Invariants: a PackedLinear computes x @ W^T + b for the rounded W; its output dtype
is its input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

WEIGHT_FORMATS = ("none", "bf16", "int8")
INT8_MAX_ROWS = 4  # at most this many input rows use the int8 kernel


def int8_supported() -> bool:
    try:
        x = torch.ones(1, 32, dtype=torch.bfloat16)
        w = torch.ones(8, 32, dtype=torch.int8)
        out = torch.ops.aten._weight_int8pack_mm(x, w, torch.ones(8, dtype=torch.bfloat16))
        return float(out[0, 0]) == 32.0
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


class PackedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, fmt: str) -> None:
        super().__init__()
        if fmt not in ("bf16", "int8"):
            raise ValueError(f"unknown weight format {fmt!r}")
        self.fmt = fmt
        w = weight.detach()
        self.weight_bf16 = w.to(torch.bfloat16).contiguous()  # [out, in]
        self.bias = None if bias is None else bias.detach().to(torch.bfloat16)
        self.weight_int8 = self.scales = None
        if fmt == "int8":
            wf = w.float()
            scales = wf.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # [out]
            self.weight_int8 = (wf / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
            self.scales = scales.to(torch.bfloat16)

    @property
    def out_features(self) -> int:
        return self.weight_bf16.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, out], x's dtype
        xb = x.to(torch.bfloat16)
        if self.weight_int8 is not None and x.shape[0] <= INT8_MAX_ROWS:
            out = torch.ops.aten._weight_int8pack_mm(xb, self.weight_int8, self.scales)
            if self.bias is not None:
                out = out + self.bias
        else:
            out = F.linear(xb, self.weight_bf16, self.bias)
        return out.to(x.dtype)


def convert_linears(model: nn.Module, fmt: str) -> nn.Module:
    """Replace the model's nn.Linear layers (and its logits matrix) in place."""
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {fmt!r} (one of {WEIGHT_FORMATS})")
    if fmt == "none":
        return model
    if fmt == "int8" and not int8_supported():
        raise ValueError("int8 weights need torch's _weight_int8pack_mm, not available here")
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, PackedLinear(child.weight, child.bias, fmt))
                del child
        del name
    if getattr(model, "lm_head", "absent") is None:  # tied: pack a copy of the embedding
        model.logits_head = PackedLinear(model.model.embed_tokens.weight, None, fmt)
    return model
