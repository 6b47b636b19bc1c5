"""Rope on q and k, in place, and the KV store of rotated k and v, as one Triton kernel
(the GPU path of kernels/rope_kv_store.py).

Theory of operation: one program per token. It reads the token's position and slot,
loads the cos | sin row of the float32 table, rotates every q head in place (as
kernels/rope_triton.py does), rotates every k head and writes it both back in place
(the extend attention reads the step's own k) and to the slot's row of the k pool,
and copies the v heads to the slot's row of the v pool. Rounding is that of the
separate kernels: rotation in float32, rounded to the activation dtype, then cast to
the pool dtype.

Invariants: qk and v have a contiguous last axis (views into the fused qkv output);
pools are contiguous [num_slots, Hkv, D]; slots are distinct and in range (the runner
checks them before the step); positions are within the table.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shunter.kernels.kv_store import check_kv_store_shapes
from shunter.kernels.pdl import pdl_args, pdl_enter, use_pdl
from shunter.kernels.rope_triton import _rotate_heads


@triton.jit
def _rope_kv_store_kernel(
    qk_ptr,
    v_ptr,
    pos_ptr,
    cs_ptr,
    kc_ptr,
    vc_ptr,
    slots_ptr,
    qk_tok_stride,
    qk_head_stride,
    v_tok_stride,
    v_head_stride,
    cs_row_stride,
    cache_slot_stride,
    num_q_heads,
    num_kv_heads,
    half,
    head_dim,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)[None, :]
    dm = dims < half
    c = tl.load(cs_ptr + pos * cs_row_stride + dims, mask=dm, other=0.0)
    s = tl.load(cs_ptr + pos * cs_row_stride + half + dims, mask=dm, other=0.0)
    _rotate_heads(
        qk_ptr, tok, qk_tok_stride, qk_head_stride, num_q_heads, c, s, half, BLOCK_HQ, BLOCK_D
    )
    heads = tl.arange(0, BLOCK_HK)[:, None]
    m = (heads < num_kv_heads) & dm
    k1p = qk_ptr + tok * qk_tok_stride + (num_q_heads + heads) * qk_head_stride + dims
    x1 = tl.load(k1p, mask=m, other=0.0)
    x2 = tl.load(k1p + half, mask=m, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    r1 = (x1f * c - x2f * s).to(x1.dtype)
    r2 = (x2f * c + x1f * s).to(x1.dtype)
    tl.store(k1p, r1, mask=m)
    tl.store(k1p + half, r2, mask=m)
    row = slot * cache_slot_stride + heads * head_dim + dims
    tl.store(kc_ptr + row, r1.to(kc_ptr.dtype.element_ty), mask=m)
    tl.store(kc_ptr + row + half, r2.to(kc_ptr.dtype.element_ty), mask=m)
    v1p = v_ptr + tok * v_tok_stride + heads * v_head_stride + dims
    v1 = tl.load(v1p, mask=m, other=0.0)
    v2 = tl.load(v1p + half, mask=m, other=0.0)
    tl.store(vc_ptr + row, v1.to(vc_ptr.dtype.element_ty), mask=m)
    tl.store(vc_ptr + row + half, v2.to(vc_ptr.dtype.element_ty), mask=m)


def check_pools_and_table(k_cache: torch.Tensor, v_cache: torch.Tensor,
                          cos_sin_cache: torch.Tensor, head_dim: int) -> None:  # fmt: skip
    """The layouts the kernels that store rotated k into the pools assume: contiguous
    pools of one layout, a float32 cos | sin table of head_dim columns."""
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.stride() == v_cache.stride()
    assert cos_sin_cache.shape[-1] == head_dim and cos_sin_cache.stride(-1) == 1
    assert cos_sin_cache.dtype == torch.float32


def rope_kv_store_triton(
    qk: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    num_q_heads: int,
) -> None:
    """Rotate qk [T, H + Hkv, D] in place at positions [T]; store its k heads and v
    [T, Hkv, D] into the pools at slots [T]."""
    num_tokens, num_heads, head_dim = qk.shape
    num_kv_heads = num_heads - num_q_heads
    check_kv_store_shapes(k_cache, slots, qk[:, num_q_heads:], v)
    assert positions.shape == (num_tokens,)
    assert qk.stride(-1) == 1 and v.stride(-1) == 1, "rope_kv_store needs a contiguous dim axis"
    check_pools_and_table(k_cache, v_cache, cos_sin_cache, head_dim)
    if head_dim % 2:
        raise ValueError(f"rope needs an even head_dim, got {head_dim}")
    if num_tokens == 0:
        return
    half = head_dim // 2
    _rope_kv_store_kernel[(num_tokens,)](
        qk,
        v,
        positions,
        cos_sin_cache,
        k_cache,
        v_cache,
        slots,
        qk.stride(0),
        qk.stride(1),
        v.stride(0),
        v.stride(1),
        cos_sin_cache.stride(0),
        k_cache.stride(0),
        num_q_heads,
        num_kv_heads,
        half,
        head_dim,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(half),
        **pdl_args(use_pdl(qk)),
    )
