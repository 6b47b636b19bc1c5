"""KV pool sizing, layout and page-to-slot mapping."""

from __future__ import annotations

import pytest
import torch

from shunter.actors.executor.kv_pool import KVPool
from shunter.actors.executor.models.config import ModelConfig

CFG = ModelConfig(family="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=4)  # fmt: skip
PER_TOKEN_F32 = 2 * 3 * 2 * 4 * 4  # K and V, layers, kv heads, head dim, bytes


def test_layout_per_layer_views_of_one_allocation():
    pool = KVPool(CFG, 5, page_size=4)
    assert (pool.num_pages, pool.page_size, pool.num_slots) == (5, 4, 20)
    assert len(pool.k_buffers) == len(pool.v_buffers) == 3
    assert pool.k_buffers[1].shape == (20, 2, 4)
    pool.k_buffers[2][7] = 1.0
    assert pool.k_all[2, 7].eq(1.0).all() and pool.k_all[1].eq(0).all()
    s = pool.statistics()
    assert (s.bytes_per_token, s.total_bytes) == (PER_TOKEN_F32, PER_TOKEN_F32 * 20)


def test_from_budget_precedence_and_rounding():
    p = KVPool.from_budget(
        CFG, dtype=torch.float32, device="cpu", page_size=16, max_total_tokens=33
    )
    assert (p.num_pages, p.num_slots) == (3, 48)  # rounded up to whole pages
    p = KVPool.from_budget(CFG, dtype=torch.float32, device="cpu", page_size=4,
                           mem_bytes=PER_TOKEN_F32 * 10)  # fmt: skip
    assert (p.num_pages, p.num_slots) == (2, 8)  # whole pages that fit
    p = KVPool.from_budget(CFG, dtype=torch.bfloat16, device="cpu", mem_bytes=PER_TOKEN_F32 * 10)
    assert p.num_slots == 20 and p.k_all.dtype == torch.bfloat16
    p = KVPool.from_budget(CFG, dtype=torch.float32, device="cpu", host_mem_fraction=1e-6)
    assert p.num_slots >= 1


def test_no_budget_on_cpu_is_capped():
    from shunter.actors.executor.kv_pool import DEFAULT_CPU_MAX_TOKENS

    small = ModelConfig(family="llama", vocab_size=8, hidden_size=4, intermediate_size=8,
                        num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2)  # fmt: skip
    p = KVPool.from_budget(small, dtype=torch.float32, device="cpu", page_size=16)
    assert p.num_slots == DEFAULT_CPU_MAX_TOKENS  # 512 KiB: far below any host's memory


def test_from_budget_rejects_impossible_budgets():
    with pytest.raises(ValueError, match="below one page"):
        KVPool.from_budget(
            CFG, dtype=torch.float32, device="cpu", page_size=4, mem_bytes=PER_TOKEN_F32
        )
    with pytest.raises(ValueError, match="max_total_tokens"):
        KVPool.from_budget(CFG, dtype=torch.float32, device="cpu", max_total_tokens=0)
    with pytest.raises(ValueError, match="host_mem_fraction"):
        KVPool.from_budget(CFG, dtype=torch.float32, device="cpu", host_mem_fraction=1.5)
    with pytest.raises(ValueError, match="page_size"):
        KVPool(CFG, 4, page_size=0)


def test_slots_of_pages_follows_page_mapping():
    pool = KVPool(CFG, 8, page_size=4)
    slots = pool.slots_of_pages([5, 2, 7], 10)
    want = [
        5 * 4 + i % 4 if i < 4 else (2 * 4 + i % 4 if i < 8 else 7 * 4 + i % 4) for i in range(10)
    ]
    assert slots.tolist() == want and slots.dtype == torch.int64
    assert KVPool(CFG, 8).slots_of_pages([3, 1, 6], 2).tolist() == [3, 1]
    with pytest.raises(ValueError, match="do not fit"):
        pool.slots_of_pages([1], 5)
