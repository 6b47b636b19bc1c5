"""Weight formats for the linear layers: keep the matmul weights smaller than the
model dtype to cut the bytes each decode step reads.

Theory of operation: decode on a CPU is bound by reading weights. `convert_linears`
swaps every projection (and the logits matrix) for a `PackedLinear` that holds:
  - "bf16": the weight in bfloat16; inputs are cast to bfloat16 for the matmul and the
    output back to the model dtype;
  - "int8": a per-output-channel symmetric int8 copy with bfloat16 scales, used for
    small batches (few rows: bandwidth-bound, int8 reads 4x fewer bytes than float32),
    plus the bfloat16 copy for larger ones (compute-bound, where the bf16 GEMM wins);
  - "int4": like int8 but 4-bit, asymmetric per group of 32 inputs (scale and zero in
    bfloat16), torch's packed CPU layout. A Q4_1 GGUF's weights are such groups
    already, so for it this is close to lossless while reading half int8's bytes.
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

WEIGHT_FORMATS = ("none", "bf16", "int8", "int4")
# at most this many input rows take the packed kernel (above, the bf16 GEMM is faster;
# measured with weights streamed from memory, one thread)
INT8_MAX_ROWS = 4
INT4_MAX_ROWS = 12
INT4_GROUP = 32


def int4_supported() -> bool:
    try:
        w = torch.full((16, 32), 9, dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w, 2)
        sz = torch.tensor([1.0, 0.0], dtype=torch.bfloat16).expand(1, 16, 2).contiguous()
        x = torch.ones(1, 32, dtype=torch.bfloat16)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, INT4_GROUP, sz)
        return float(out[0, 0]) == 32.0  # (9 - 8) * 1 + 0 per element
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def pack_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (packed int4 weight, [in / 32, out, 2] bf16 scale and zero);
    dequantized as (q - 8) * scale + zero with q in 0..15."""
    out_f, in_f = w.shape
    if in_f % INT4_GROUP or out_f % 16:
        raise ValueError(
            f"int4 weights need in_features % {INT4_GROUP} == 0 and out_features % 16 == 0, "
            f"got {out_f}x{in_f}"
        )
    wg = w.float().view(out_f, in_f // INT4_GROUP, INT4_GROUP)
    lo, hi = wg.amin(-1), wg.amax(-1)  # [out, groups]
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = ((wg - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32)
    zero = lo + 8 * scale
    sz = torch.stack([scale.t(), zero.t()], -1).to(torch.bfloat16).contiguous()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.view(out_f, in_f), 2)
    return packed, sz


def prepacked_bf16_supported() -> bool:
    """Whether oneDNN can hold a bf16 weight in its own blocked layout. F.linear reorders
    the weight into that layout on every call; packing once at load saves the reorder
    (same result, bit for bit)."""
    try:
        w = torch.ones(16, 32, dtype=torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        x = torch.ones(2, 32, dtype=torch.bfloat16)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return out.shape == (2, 16) and float(out[0, 0]) == 32.0
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


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
        if fmt not in ("bf16", "int8", "int4"):
            raise ValueError(f"unknown weight format {fmt!r}")
        self.fmt = fmt
        w = weight.detach()
        self.weight_bf16 = w.to(torch.bfloat16).contiguous()  # [out, in]
        self.bias = None if bias is None else bias.detach().to(torch.bfloat16)
        # the same weight in oneDNN's blocked layout (opaque), for the bf16 GEMM on a CPU
        self.weight_bf16_packed = None
        if w.device.type == "cpu" and prepacked_bf16_supported():
            self.weight_bf16_packed = torch.ops.mkldnn._reorder_linear_weight(
                self.weight_bf16, None
            )
        self.weight_int8 = self.scales = None
        self.weight_int4 = self.scale_zero = None
        if fmt == "int4":
            if w.device.type != "cpu":
                raise ValueError("int4 weights use torch's CPU packing; not on " + str(w.device))
            self.weight_int4, self.scale_zero = pack_int4(w)
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
        if self.weight_int4 is not None and x.shape[0] <= INT4_MAX_ROWS:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                xb, self.weight_int4, INT4_GROUP, self.scale_zero
            )
            if self.bias is not None:
                out = out + self.bias
        elif self.weight_int8 is not None and x.shape[0] <= INT8_MAX_ROWS:
            out = torch.ops.aten._weight_int8pack_mm(xb, self.weight_int8, self.scales)
            if self.bias is not None:
                out = out + self.bias
        elif self.weight_bf16_packed is not None:
            out = torch.ops.mkldnn._linear_pointwise(
                xb, self.weight_bf16_packed, self.bias, "none", [], ""
            )
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
    if fmt == "int4" and not int4_supported():
        raise ValueError(
            "int4 weights need torch's _weight_int4pack_mm_for_cpu, not available here"
        )
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                child_fmt = (
                    "int8" if fmt == "int4" and name == "" and child_name == "lm_head" else fmt
                )
                setattr(module, child_name, PackedLinear(child.weight, child.bias, child_fmt))
                del child
        del name
    if getattr(model, "lm_head", "absent") is None:  # tied: pack a copy of the embedding
        # the logits matrix stays at 8 bits under int4 (its errors reach every token's
        # score directly, and GGUF embeddings are usually 8-bit already)
        head_fmt = "int8" if fmt == "int4" and int8_supported() else fmt
        model.logits_head = PackedLinear(model.model.embed_tokens.weight, None, head_fmt)
    return model
