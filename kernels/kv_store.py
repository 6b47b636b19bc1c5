"""Write new tokens' K and V into the paged pool at their flat slots.

CUDA pools go to the Triton kernel of kernels/kv_store_triton.py (imported on first use;
it reads strided views of the fused qkv output and casts to the pool dtype); others
take the torch path (`index_copy_`)."""

from __future__ import annotations

import torch


def kv_store_ref(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    for i, s in enumerate(slots.tolist()):
        k_cache[s] = k[i]
        v_cache[s] = v[i]


def kv_store(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """k_cache, v_cache: [num_slots, Hkv, D]; slots: [T] int64; k, v: [T, Hkv, D].
    Slots must be distinct (a slot written twice in one call is undefined)."""
    if k_cache.is_cuda:
        from shunter.kernels.kv_store_triton import kv_store_triton

        kv_store_triton(k_cache, v_cache, slots, k, v)
        return
    kv_store_torch(k_cache, v_cache, slots, k, v)


def check_kv_store_shapes(
    k_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """ValueError unless k, v are [T, Hkv, D] with the cache's trailing shape and T slots."""
    if k.shape != v.shape or k.shape[1:] != k_cache.shape[1:]:
        raise ValueError(
            f"kv_store shape mismatch: k {tuple(k.shape)}, cache {tuple(k_cache.shape)}"
        )
    if slots.shape[0] != k.shape[0]:
        raise ValueError(f"{slots.shape[0]} slots for {k.shape[0]} tokens")


def kv_store_torch(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """The torch path of `kv_store` (any device)."""
    check_kv_store_shapes(k_cache, slots, k, v)
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))
