"""The qkv projection of one decode row with rope and the KV store in its epilogue, as
one Triton kernel (the GPU path of kernels/qkv_rope_store.py).

Theory of operation: a bs=1 decode layer otherwise runs the qkv GEMV, then a rope +
KV store kernel that reads the GEMV's output back, then attention: two dependent
round trips through memory before attention may start. Here a program takes BLOCK_N
rotation pairs, weight rows (n, n + D/2) of one head, so it holds both halves a
rotation mixes once the K loop ends. The loop is the GEMV's (kernels/linear_triton.py's
`_two_row_sums`: weight tiles in flight before the PDL wait, one float32 accumulator per row in the
tile's layout, summed once at the end). Then each pair is rounded to the activation
dtype (as the GEMV stores it), rotated in float32 and rounded again (as the rope
kernels do) for q and k heads; q goes to the returned [1, H, D] tensor, k and v to
the slot's row of the pools (cast to the pool dtype). The results equal the GEMV
followed by kernels/rope_kv_store_triton.py bit for bit.

Invariants: one row (x [1, K]); W is [(H + 2 Hkv) D, K], q|k|v rows, contiguous K;
no bias; pools contiguous [num_slots, Hkv, D]; the slot is in range and the position
within the table (the runner checks both before the step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shunter.kernels import linear_triton as lt
from shunter.kernels.pdl import pdl_args, use_pdl
from shunter.kernels.rope_kv_store_triton import check_pools_and_table


@triton.jit
def _qkv_rope_store_kernel(x_ptr, w_ptr, q_ptr, pos_ptr, cs_ptr, kc_ptr, vc_ptr, slots_ptr,
                           K, w_row_stride, cs_row_stride, cache_slot_stride, num_q_heads,
                           num_kv_heads, half, head_dim, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
                           W_EVICT: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    pair = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    head = pair // half
    d = pair % half
    ok = head < num_q_heads + 2 * num_kv_heads
    rk = tl.arange(0, BLOCK_K)
    row1 = head * head_dim + d
    t1 = w_ptr + row1.to(tl.int64)[:, None] * w_row_stride + rk[None, :]
    t2 = t1 + half * w_row_stride
    s1, s2 = lt._two_row_sums(x_ptr, t1, t2, ok, K, BLOCK_N, BLOCK_K, USE_PDL, W_EVICT)
    dt = q_ptr.dtype.element_ty
    y1 = s1.to(dt)
    y2 = s2.to(dt)
    is_q = head < num_q_heads
    is_v = head >= num_q_heads + num_kv_heads
    is_k = ok & ~is_q & ~is_v
    pos = tl.load(pos_ptr).to(tl.int64)
    slot = tl.load(slots_ptr).to(tl.int64)
    rot = ok & ~is_v
    c = tl.load(cs_ptr + pos * cs_row_stride + d, mask=rot, other=0.0)
    s = tl.load(cs_ptr + pos * cs_row_stride + half + d, mask=rot, other=0.0)
    y1f, y2f = y1.to(tl.float32), y2.to(tl.float32)
    r1 = tl.where(is_v, y1, (y1f * c - y2f * s).to(dt))
    r2 = tl.where(is_v, y2, (y2f * c + y1f * s).to(dt))
    q_at = q_ptr + head * head_dim + d
    tl.store(q_at, r1, mask=ok & is_q)
    tl.store(q_at + half, r2, mask=ok & is_q)
    kv_head = tl.where(is_v, head - num_q_heads - num_kv_heads, head - num_q_heads)
    row = slot * cache_slot_stride + kv_head * head_dim + d
    tl.store(kc_ptr + row, r1.to(kc_ptr.dtype.element_ty), mask=is_k)
    tl.store(kc_ptr + row + half, r2.to(kc_ptr.dtype.element_ty), mask=is_k)
    tl.store(vc_ptr + row, r1.to(vc_ptr.dtype.element_ty), mask=ok & is_v)
    tl.store(vc_ptr + row + half, r2.to(vc_ptr.dtype.element_ty), mask=ok & is_v)


def qkv_rope_store_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    num_q_heads: int,
    *,
    config: tuple[int, int, int] | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """q [1, H, D], rotated, of x [1, K] @ weight^T; rotated k and v stored at slots [1]."""
    _, num_kv_heads, head_dim = k_cache.shape
    n, k = weight.shape
    if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] != k:
        raise ValueError(f"qkv_rope_store: x {tuple(x.shape)} must be one row of {k}")
    if head_dim % 2 or n != (num_q_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv_rope_store: weight {tuple(weight.shape)} is not q|k|v of "
                         f"{num_q_heads} + 2 x {num_kv_heads} heads of {head_dim}")  # fmt: skip
    q = torch.empty((1, num_q_heads, head_dim), dtype=x.dtype, device=x.device)
    assert positions.shape == (1,) and slots.shape == (1,)
    assert x.stride(1) == 1 and weight.stride(1) == 1
    check_pools_and_table(k_cache, v_cache, cos_sin_cache, head_dim)
    half = head_dim // 2
    block_n, block_k, warps = config or lt.gemv_config(n, k)
    pdl = use_pdl(x) if pdl is None else pdl
    grid = (triton.cdiv((num_q_heads + 2 * num_kv_heads) * half, block_n),)
    _qkv_rope_store_kernel[grid](
        x, weight, q, positions, cos_sin_cache, k_cache, v_cache, slots, k, weight.stride(0),
        cos_sin_cache.stride(0), k_cache.stride(0), num_q_heads, num_kv_heads, half, head_dim,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, W_EVICT=lt.WEIGHT_EVICTION,
        **pdl_args(pdl),
    )  # fmt: skip
    return q
