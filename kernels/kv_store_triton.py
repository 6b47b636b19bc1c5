"""Write new tokens' K and V into the paged pool as one Triton kernel (the GPU path of
kernels/kv_store.py).

Theory of operation: one program per new token and block of its Hkv*D values; it reads
the token's slot and copies that block of K and of V to the slot's row. k and v may be
strided views into the fused qkv projection (token stride != Hkv*D), so the source
is addressed by (token, head, dim) strides; the pool rows are contiguous.

Invariants: slots are distinct within a call (two tokens writing one slot race);
every slot is < num_slots (checked by the runner before the step, not here, to keep
the launch free of host syncs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shunter.kernels.kv_store import check_kv_store_shapes


@triton.jit
def _kv_store_kernel(
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    k_ptr,
    v_ptr,
    k_tok_stride,
    k_head_stride,
    v_tok_stride,
    v_head_stride,
    cache_slot_stride,
    head_dim,
    row_size,
    BLOCK: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < row_size
    head = offs // head_dim
    dim = offs % head_dim
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    kv = tl.load(k_ptr + tok * k_tok_stride + head * k_head_stride + dim, mask=m)
    vv = tl.load(v_ptr + tok * v_tok_stride + head * v_head_stride + dim, mask=m)
    dst = slot * cache_slot_stride + offs
    tl.store(k_cache_ptr + dst, kv.to(k_cache_ptr.dtype.element_ty), mask=m)
    tl.store(v_cache_ptr + dst, vv.to(v_cache_ptr.dtype.element_ty), mask=m)


def kv_store_triton(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """k_cache, v_cache: [num_slots, Hkv, D]; slots: [T] int64; k, v: [T, Hkv, D]."""
    check_kv_store_shapes(k_cache, slots, k, v)
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.stride() == v_cache.stride()
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "kv_store_triton needs a contiguous dim axis"
    num_tokens, num_kv_heads, head_dim = k.shape
    row_size = num_kv_heads * head_dim
    if num_tokens == 0:
        return
    block = min(triton.next_power_of_2(row_size), 1024)
    grid = (num_tokens, triton.cdiv(row_size, block))
    _kv_store_kernel[grid](
        k_cache,
        v_cache,
        slots,
        k,
        v,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        head_dim,
        row_size,
        BLOCK=block,
    )
