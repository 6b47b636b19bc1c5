"""Paged extend attention (cached prefix + causal new tokens) vs torch SDPA (float64)
with an explicit mask over each entry's gathered KV. Tolerance: float32 1e-5."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shunter.kernels.attention_extend import attention_extend, attention_extend_ref, plan_extend
from shunter.kernels.kv_store import kv_store


def _expected(q, kc, vc, num_new, tables, scale, window=None):
    outs, start = [], 0
    for n, slots in zip(num_new, tables):
        s = slots.shape[0]
        k = kc[slots].double().transpose(0, 1)
        v = vc[slots].double().transpose(0, 1)
        rep = q.shape[1] // k.shape[0]
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        mask = torch.zeros(n, s, dtype=torch.bool)
        for i in range(n):
            qpos = s - n + i
            lo = 0 if window is None else max(0, qpos - window + 1)
            mask[i, lo : qpos + 1] = True
        qe = q[start : start + n].double().transpose(0, 1)
        outs.append(
            F.scaled_dot_product_attention(qe, k, v, attn_mask=mask, scale=scale).transpose(0, 1)
        )
        start += n
    return torch.cat(outs)


def _case(num_heads, num_kv, head_dim, entries, seed=0):
    """entries: (num_prefix, num_new) per entry; the new tokens' K/V get stored."""
    g = torch.Generator().manual_seed(seed)
    total = sum(p + n for p, n in entries)
    kc = torch.randn(total + 9, num_kv, head_dim, generator=g)
    vc = torch.randn(total + 9, num_kv, head_dim, generator=g)
    perm = torch.randperm(total + 9, generator=g)
    tables, at = [], 0
    for p, n in entries:
        tables.append(perm[at : at + p + n])
        at += p + n
    num_tokens = sum(n for _, n in entries)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=g)
    k = torch.randn(num_tokens, num_kv, head_dim, generator=g)
    v = torch.randn(num_tokens, num_kv, head_dim, generator=g)
    new_slots = torch.cat([t[p:] for t, (p, _) in zip(tables, entries)])
    kv_store(kc, vc, new_slots, k, v)
    return q, k, v, kc, vc, tables


@pytest.mark.parametrize(("num_heads", "num_kv", "head_dim"), [(9, 3, 64), (3, 3, 5), (4, 1, 16)])
@pytest.mark.parametrize("entries", [[(0, 1)], [(0, 13)], [(5, 7), (0, 3), (20, 1), (1, 31)]])
def test_extend_matches_masked_sdpa(num_heads, num_kv, head_dim, entries):
    q, k, v, kc, vc, tables = _case(num_heads, num_kv, head_dim, entries)
    num_new = [n for _, n in entries]
    seq_lens = [p + n for p, n in entries]
    scale = head_dim**-0.5
    want = _expected(q, kc, vc, num_new, tables, scale).float()
    plan = plan_extend(num_new, seq_lens, tables)
    torch.testing.assert_close(
        attention_extend(q, k, v, kc, vc, plan, scale), want, atol=1e-5, rtol=1e-5
    )
    ref = attention_extend_ref(q, kc, vc, num_new, tables, scale)
    torch.testing.assert_close(ref, want, atol=1e-5, rtol=1e-5)


def test_extend_sliding_window():
    entries = [(0, 12), (9, 4)]
    q, k, v, kc, vc, tables = _case(4, 2, 8, entries, seed=3)
    num_new, seq_lens = [12, 4], [12, 13]
    want = _expected(q, kc, vc, num_new, tables, 0.4, window=5).float()
    plan = plan_extend(num_new, seq_lens, tables, sliding_window=5)
    torch.testing.assert_close(
        attention_extend(q, k, v, kc, vc, plan, 0.4), want, atol=1e-5, rtol=1e-5
    )
    ref = attention_extend_ref(q, kc, vc, num_new, tables, 0.4, sliding_window=5)
    torch.testing.assert_close(ref, want, atol=1e-5, rtol=1e-5)


def test_plan_extend_rejects_bad_entries():
    with pytest.raises(ValueError):
        plan_extend([3], [2], [torch.arange(2)])
    with pytest.raises(ValueError):
        plan_extend([0], [4], [torch.arange(4)])
