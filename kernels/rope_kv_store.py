"""Rope on a step's q and k heads and the KV store of k and v, as one op.

Every decode layer rotates q and k and then writes k and v into the paged pool; doing
both in one pass saves a launch and a re-read of k per layer. `qk` is the q|k part of
the fused qkv projection seen as [T, H + Hkv, D]; `rope` is `rope_gather`'s operands.

Dispatch: CUDA goes to the Triton kernel of kernels/rope_kv_store_triton.py (imported
on first use), which rotates qk IN PLACE and stores the rotated k heads and v at the
tokens' slots; other devices take `rope_rotate` then `kv_store` (the reference), and
get a new rotated tensor back. Either way the caller uses the returned qk.
"""

from __future__ import annotations

import torch

from shunter.kernels.kv_store import kv_store
from shunter.kernels.rope import rope_rotate


def rope_kv_store_ref(
    qk: torch.Tensor,
    v: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    num_q_heads: int,
) -> torch.Tensor:
    out = rope_rotate(qk, *rope)
    kv_store(k_cache, v_cache, slots, out[:, num_q_heads:], v)
    return out


def rope_kv_store(
    qk: torch.Tensor,  # [T, H + Hkv, D], last axis contiguous
    v: torch.Tensor,  # [T, Hkv, D]
    rope: tuple[torch.Tensor, torch.Tensor],
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [T] int64, distinct
    num_q_heads: int,
) -> torch.Tensor:
    """The rotated qk ([T, H + Hkv, D]; qk itself on CUDA); k and v stored at slots."""
    if qk.is_cuda:
        from shunter.kernels.rope_kv_store_triton import rope_kv_store_triton

        positions, cos_sin_cache = rope
        rope_kv_store_triton(qk, v, positions, cos_sin_cache, k_cache, v_cache, slots, num_q_heads)
        return qk
    return rope_kv_store_ref(qk, v, rope, k_cache, v_cache, slots, num_q_heads)
