"""The qkv projection of a one-row decode step with rope on its q and k heads and the
KV store of k and v, as one op returning the rotated q.

Dispatch: with `FUSE_QKV_ROPE_STORE` on, a CUDA row the GEMV would take
(kernels/linear.py's `_skinny`, no bias) goes to the Triton kernel of
kernels/qkv_rope_store_triton.py, which applies rope and the store in the GEMV's
epilogue: one launch and one dependent round trip through memory fewer per layer.
Everything else is `linear` then `rope_kv_store` (on the CPU the reference).
Off: a whole bs=1 step of Llama-3.1-8B on an H100 measured 1.004x with it (two runs
each) and 0.998x with it and the gate/up SwiGLU epilogue (three runs each), inside
the runs' spread (BENCHMARKS.md). Under PDL in a CUDA graph the launch and the round
trip it removes were already hidden behind the GEMVs' weight streams.
"""

from __future__ import annotations

import torch

from shunter.kernels import linear as linear_mod
from shunter.kernels.rope_kv_store import rope_kv_store, rope_kv_store_ref

FUSE_QKV_ROPE_STORE = False


def _split(qkv: torch.Tensor, num_q_heads: int, k_cache: torch.Tensor):
    t, (hkv, d) = qkv.shape[0], k_cache.shape[1:]
    qk_size = (num_q_heads + hkv) * d
    return qkv[:, :qk_size].view(t, -1, d), qkv[:, qk_size:].view(t, hkv, d)


def qkv_rope_store_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],  # rope_gather_torch's (cos, sin)
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    num_q_heads: int,
) -> torch.Tensor:
    qk, v = _split(linear_mod.linear_ref(x, weight), num_q_heads, k_cache)
    return rope_kv_store_ref(qk, v, rope, k_cache, v_cache, slots, num_q_heads)[:, :num_q_heads]


def fusable(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `qkv_rope_store` runs as the one fused kernel for these operands."""
    return (
        FUSE_QKV_ROPE_STORE and bias is None and x.shape[0] == 1 and linear_mod._skinny(x, weight)
    )


def qkv_rope_store(
    x: torch.Tensor,  # [T, hidden], the layer's normed input
    weight: torch.Tensor,  # [(H + 2 Hkv) D, hidden]: q | k | v rows
    bias: torch.Tensor | None,
    rope: tuple[torch.Tensor, torch.Tensor],  # rope_gather's operands
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [T] int64, distinct
    num_q_heads: int,
) -> torch.Tensor:
    """The rotated q [T, H, D]; rotated k and v stored at slots."""
    if fusable(x, weight, bias):
        from shunter.kernels.qkv_rope_store_triton import qkv_rope_store_triton

        positions, cos_sin_cache = rope
        return qkv_rope_store_triton(x, weight, positions, cos_sin_cache, k_cache, v_cache,
                                     slots, num_q_heads)  # fmt: skip
    qk, v = _split(linear_mod.linear(x, weight, bias), num_q_heads, k_cache)
    return rope_kv_store(qk, v, rope, k_cache, v_cache, slots, num_q_heads)[:, :num_q_heads]
