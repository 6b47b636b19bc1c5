"""Rotary position embedding, in place, as one Triton kernel (the GPU path of
kernels/rope.py, half-rotated "neox" layout).

Theory of operation: one program per token; it reads the token's position, loads the
row cos | sin of the float32 table built by `rope_cos_sin_cache` (Llama 3.1 or linear
scaling is already folded into that table) and rotates every q head and every k head
of the token: x1' = x1*c - x2*s, x2' = x2*c + x1*s in float32, rounded to the input
dtype. q and k are rotated where they lie, so views into the fused qkv projection
need no copy.

Invariants: the last axis of q and k is contiguous; head_dim is even; every position
is < the table's length (the model grows its table before the step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    x_ptr,
    tok,
    tok_stride,
    head_stride,
    num_heads,
    c,
    s,
    half,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    m = (heads < num_heads) & (dims < half)
    p1 = x_ptr + tok * tok_stride + heads * head_stride + dims
    p2 = p1 + half
    x1 = tl.load(p1, mask=m, other=0.0)
    x2 = tl.load(p2, mask=m, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(p1, (x1f * c - x2f * s).to(x1.dtype), mask=m)
    tl.store(p2, (x2f * c + x1f * s).to(x1.dtype), mask=m)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    cs_ptr,
    q_tok_stride,
    q_head_stride,
    k_tok_stride,
    k_head_stride,
    cs_row_stride,
    num_q_heads,
    num_k_heads,
    half,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)[None, :]
    dm = dims < half
    c = tl.load(cs_ptr + pos * cs_row_stride + dims, mask=dm, other=0.0)
    s = tl.load(cs_ptr + pos * cs_row_stride + half + dims, mask=dm, other=0.0)
    _rotate_heads(
        q_ptr, tok, q_tok_stride, q_head_stride, num_q_heads, c, s, half, BLOCK_HQ, BLOCK_D
    )
    _rotate_heads(
        k_ptr, tok, k_tok_stride, k_head_stride, num_k_heads, c, s, half, BLOCK_HK, BLOCK_D
    )


def apply_rope_triton(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, H, D] and k [T, Hkv, D] at positions [T] int64 IN PLACE; returns
    (q, k). cos_sin_cache: [max_pos, D] float32 from `rope_cos_sin_cache`, on q's device."""
    num_tokens, num_q_heads, head_dim = q.shape
    assert k.shape[0] == num_tokens and k.shape[2] == head_dim
    assert positions.shape == (num_tokens,)
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "apply_rope_triton needs a contiguous dim axis"
    assert cos_sin_cache.shape[-1] == head_dim and cos_sin_cache.stride(-1) == 1
    assert cos_sin_cache.dtype == torch.float32
    if head_dim % 2:
        raise ValueError(f"rope needs an even head_dim, got {head_dim}")
    if num_tokens == 0:
        return q, k
    half = head_dim // 2
    _rope_kernel[(num_tokens,)](
        q,
        k,
        positions,
        cos_sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        num_q_heads,
        k.shape[1],
        half,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HK=max(triton.next_power_of_2(k.shape[1]), 1),
        BLOCK_D=triton.next_power_of_2(half),
    )
    return q, k


def rope_rotate_triton(
    x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> torch.Tensor:
    """Rotate every head of x [T, H, D] IN PLACE (e.g. the q and k heads of the fused
    projection seen as one [T, H + Hkv, D] view); returns x."""
    apply_rope_triton(x, x[:, :0], positions, cos_sin_cache)
    return x
