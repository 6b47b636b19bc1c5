"""Paged decode attention vs torch SDPA (math, float64) over each entry's gathered KV.
Tolerance: float32 1e-5; bfloat16 pool 2e-2."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shunter.kernels.attention_decode import (
    attention_decode,
    attention_decode_ref,
    plan_decode,
    plan_decode_rows,
)


def _expected(q, k_cache, v_cache, tables, scale, window=None):
    outs = []
    for b, slots in enumerate(tables):
        k = k_cache[slots].double().transpose(0, 1)  # [Hkv, L, D]
        v = v_cache[slots].double().transpose(0, 1)
        if window is not None:
            k, v = k[:, -window:], v[:, -window:]
        rep = q.shape[1] // k.shape[0]
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        o = F.scaled_dot_product_attention(q[b].double()[:, None, :], k, v, scale=scale)
        outs.append(o[:, 0, :])
    return torch.stack(outs)


def _case(num_heads, num_kv, head_dim, lens, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_slots = sum(lens) + 13
    k_cache = torch.randn(num_slots, num_kv, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_slots, num_kv, head_dim, generator=g).to(dtype)
    perm = torch.randperm(num_slots, generator=g)
    tables, at = [], 0
    for n in lens:
        tables.append(perm[at : at + n])
        at += n
    q = torch.randn(len(lens), num_heads, head_dim, generator=g).to(dtype)
    return q, k_cache, v_cache, tables


@pytest.mark.parametrize(("num_heads", "num_kv", "head_dim"), [(9, 3, 64), (4, 4, 7), (8, 1, 16)])
@pytest.mark.parametrize("lens", [[1], [5, 1, 33, 2], [17] * 6])
def test_decode_matches_sdpa_over_gathered_kv(num_heads, num_kv, head_dim, lens):
    q, kc, vc, tables = _case(num_heads, num_kv, head_dim, lens, torch.float32)
    scale = head_dim**-0.5
    want = _expected(q, kc, vc, tables, scale).float()
    out = attention_decode(q, kc, vc, plan_decode(tables), scale)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        attention_decode_ref(q, kc, vc, tables, scale), want, atol=1e-5, rtol=1e-5
    )


def test_decode_sliding_window_sees_only_recent_keys():
    q, kc, vc, tables = _case(4, 2, 8, [3, 10, 25], torch.float32, seed=5)
    want = _expected(q, kc, vc, tables, 0.3, window=6).float()
    out = attention_decode(q, kc, vc, plan_decode(tables, sliding_window=6), 0.3)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    ref = attention_decode_ref(q, kc, vc, tables, 0.3, sliding_window=6)
    torch.testing.assert_close(ref, want, atol=1e-5, rtol=1e-5)


def test_decode_bfloat16_pool():
    q, kc, vc, tables = _case(6, 2, 32, [4, 19], torch.bfloat16, seed=2)
    want = _expected(q, kc, vc, tables, 0.2).to(torch.bfloat16)
    out = attention_decode(q, kc, vc, plan_decode(tables), 0.2)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)


def test_plan_decode_rejects_empty():
    with pytest.raises(ValueError):
        plan_decode([])
    with pytest.raises(ValueError):
        plan_decode([torch.zeros(0, dtype=torch.int64)])


def _row_table(tables, num_rows, width, rows, stale):
    """A [num_rows, width] table holding tables[b] at row rows[b]; every other cell
    `stale` (cells past a row's length must never be read)."""
    t = torch.full((num_rows, width), stale, dtype=torch.int32)
    for r, slots in zip(rows, tables, strict=True):
        t[r, : slots.shape[0]] = slots.to(torch.int32)
    return t


@pytest.mark.parametrize("window", [None, 5])
def test_row_plan_matches_padded_plan(window):
    lens = [5, 1, 33, 2]
    q, kc, vc, tables = _case(8, 2, 16, lens, torch.float32, seed=3)
    rows = [6, 0, 3, 7]
    table = _row_table(tables, 9, 40, rows, stale=kc.shape[0] - 1)
    plan = plan_decode_rows(
        table, torch.tensor(rows), torch.tensor(lens), max_len=40, sliding_window=window
    )
    out = attention_decode(q, kc, vc, plan, 0.25)
    want = attention_decode(q, kc, vc, plan_decode(tables, sliding_window=window), 0.25)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)


def test_row_plan_checks_its_bound():
    table = torch.zeros(2, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="max_len"):
        plan_decode_rows(table, torch.tensor([0]), torch.tensor([1]), max_len=9)
