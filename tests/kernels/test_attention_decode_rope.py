"""The decode kernel with rope and the KV store folded in (`attention_decode_rope_store`,
kernels/attention_decode_triton.py's RopeStore path) against the ops it replaces:
`rope_kv_store_ref` (rotate q and k, store k and v) then `attention_decode_ref`. The
pool cells of the new tokens start as garbage, so the kernel must store before it
reads them. Without CUDA: the Triton interpreter in float32 (its bf16 dots are wrong)
at odd shapes, every split count and both merges; with CUDA also bf16 at the 8B heads.

Tolerances: the stored k/v equal the reference's (float32: same float32 arithmetic,
1e-6 for the order of the rotation's two products); attention output 2e-5 (float32),
2e-2 (bf16), as tests/kernels/test_attention_triton.py."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shunter.kernels import attention_decode as ad
from shunter.kernels.attention_decode import (
    RopeStore,
    attention_decode_ref,
    plan_decode,
    plan_decode_rows,
)
from shunter.kernels.attention_decode_triton import attention_decode_triton
from shunter.kernels.rope import rope_cos_sin_cache, rope_gather_torch
from shunter.kernels.rope_kv_store import rope_kv_store_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _case(num_heads, num_kv, head_dim, lens, page_size, dtype, seed):
    """(qk, v, caches, slot tables, new slots, rope table): the new token of entry b
    sits at position lens[b] - 1, in the last cell of its slot table."""
    g = torch.Generator().manual_seed(seed)
    pages_each = [-(-n // page_size) for n in lens]
    perm = torch.randperm(sum(pages_each) + 2, generator=g)
    tables, at = [], 0
    for n, p in zip(lens, pages_each, strict=True):
        slots = (perm[at : at + p, None] * page_size + torch.arange(page_size)).reshape(-1)[:n]
        tables.append(slots.to(DEVICE))
        at += p
    num_slots = (sum(pages_each) + 2) * page_size
    kc, vc = (torch.randn(num_slots, num_kv, head_dim, generator=g).to(dtype).to(DEVICE)
              for _ in range(2))  # fmt: skip
    new = torch.stack([t[-1] for t in tables])
    kc[new], vc[new] = 50.0, -50.0  # garbage until the op stores the new tokens
    qk = torch.randn(len(lens), num_heads + num_kv, head_dim, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(len(lens), num_kv, head_dim, generator=g).to(dtype).to(DEVICE)
    cs = rope_cos_sin_cache(head_dim, max(lens) + 1, 10000.0).to(DEVICE)
    return qk, v, kc, vc, tables, new, cs


def _reference(qk, v, kc, vc, tables, new, cs, num_heads, scale, window=None):
    """(output, k pool, v pool) of rope + store, then attention, on CPU copies (float64
    out), returned on qk's device: the torch rotation, not the CUDA dispatch."""
    kc, vc = kc.cpu().clone(), vc.cpu().clone()
    pos = torch.tensor([t.shape[0] - 1 for t in tables])
    rope = rope_gather_torch(cs.cpu(), pos)
    rot = rope_kv_store_ref(qk.cpu().clone(), v.cpu(), rope, kc, vc, new.cpu(), num_heads)
    out = attention_decode_ref(rot[:, :num_heads].double(), kc.double(), vc.double(),
                               [t.cpu() for t in tables], scale, sliding_window=window)  # fmt: skip
    return out.to(qk.device), kc.to(qk.device), vc.to(qk.device)


def _fused(qk, v, kc, vc, plan, new, cs, num_heads, scale, window=None, **kw):
    kc, vc = kc.clone(), vc.clone()
    rs = RopeStore(qk[:, num_heads:], v, cs, new)
    out = attention_decode_triton(qk[:, :num_heads].clone(), kc, vc, plan, scale,
                                  sliding_window=window, rope_store=rs, **kw)  # fmt: skip
    return out, kc, vc


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv", "head_dim", "lens"),
    [(9, 3, 64, [1, 70, 300, 5]), (8, 1, 16, [17, 2, 129])],
)
def test_fused_decode_matches_rope_store_then_attention(page_size, num_heads, num_kv, head_dim,
                                                        lens):  # fmt: skip
    qk, v, kc, vc, tables, new, cs = _case(num_heads, num_kv, head_dim, lens, page_size,
                                           torch.float32, seed=1)  # fmt: skip
    scale = head_dim**-0.5
    want, want_k, want_v = _reference(qk, v, kc, vc, tables, new, cs, num_heads, scale)
    plan = plan_decode(tables, device=DEVICE)
    for num_splits, in_split in itertools.product((None, 1, 3), (False, True)):
        out, k_pool, v_pool = _fused(qk, v, kc, vc, plan, new, cs, num_heads, scale,
                                     num_splits=num_splits, merge_in_split=in_split)  # fmt: skip
        torch.testing.assert_close(k_pool, want_k, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(v_pool, want_v, rtol=0, atol=0)
        torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-5)


def test_fused_decode_with_a_window_and_a_row_plan():
    """A sliding window (the new token's split is the last with keys, not the last of
    the grid) over a row table, as a captured step reads it."""
    lens = [3, 90, 200, 130]
    qk, v, kc, vc, tables, new, cs = _case(6, 2, 24, lens, 16, torch.float32, seed=2)
    want, want_k, _ = _reference(qk, v, kc, vc, tables, new, cs, 6, 0.2, window=40)
    rows, width = [3, 0, 6, 1], 256
    table = torch.zeros(7, width, dtype=torch.int32, device=DEVICE)
    for r, slots in zip(rows, tables, strict=True):
        table[r, : slots.shape[0]] = slots.to(torch.int32)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    plan = plan_decode_rows(table, torch.tensor(rows, device=DEVICE), lens_t, max_len=width,
                            sliding_window=40)  # fmt: skip
    for num_splits in (2, 7):
        out, k_pool, _ = _fused(qk, v, kc, vc, plan, new, cs, 6, 0.2, window=40,
                                num_splits=num_splits)  # fmt: skip
        torch.testing.assert_close(k_pool, want_k, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-5)


def test_dispatch_off_cuda_and_switched_off_is_rope_store_then_attention(monkeypatch):
    """`attention_decode_rope_store` on the CPU (or with FUSE_ROPE_STORE off) runs the
    separate ops: the same result as the reference, pools included."""
    monkeypatch.setattr(ad, "FUSE_ROPE_STORE", False)
    qk, v, kc, vc, tables, new, cs = _case(4, 2, 8, [5, 9], 1, torch.float32, seed=3)
    want, want_k, want_v = _reference(qk, v, kc, vc, tables, new, cs, 4, 0.3)
    pos = torch.tensor([t.shape[0] - 1 for t in tables], device=DEVICE)
    rope = (pos, cs) if qk.is_cuda else rope_gather_torch(cs, pos)
    k_pool, v_pool = kc.clone(), vc.clone()
    out = ad.attention_decode_rope_store(qk.clone(), v, rope, k_pool, v_pool, new, 4,
                                         plan_decode(tables, device=DEVICE), 0.3)  # fmt: skip
    torch.testing.assert_close(k_pool, want_k, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(v_pool, want_v, rtol=0, atol=0)
    torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-5)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("in_split", [False, True])
def test_fused_decode_bf16_at_llama8b_heads_on_gpu(in_split):
    lens = [1, 100, 4096, 30000, 777, 5000, 2, 130]
    qk, v, kc, vc, tables, new, cs = _case(32, 8, 128, lens, 1, torch.bfloat16, seed=5)
    want, want_k, want_v = _reference(qk, v, kc, vc, tables, new, cs, 32, 128**-0.5)
    out, k_pool, v_pool = _fused(qk, v, kc, vc, plan_decode(tables, device=DEVICE), new, cs,
                                 32, 128**-0.5, merge_in_split=in_split)  # fmt: skip
    torch.testing.assert_close(k_pool.float(), want_k.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(v_pool, want_v, rtol=0, atol=0)
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_engine_greedy_tokens_are_the_same_with_the_fused_decode_on_gpu(tmp_path, graphs):
    """The executor (triton backend, float32, small dummy Llama) decodes the same greedy
    tokens with FUSE_ROPE_STORE on as off, captured graphs included; logprobs within
    float32 roundoff (the rotation's products may be fused differently)."""
    from shunter.ops import gpu_parity as gp

    hf_model, hf_cfg = gp.build_hf("small", torch.float32, "cuda")
    prompts = gp.random_prompts(hf_cfg.vocab_size, [5, 17, 33])
    runs = gp.runs_with_setting(ad, "FUSE_ROPE_STORE", [False, True], hf_model, hf_cfg, tmp_path,
                                prompts, 24, dtype=torch.float32, graphs=graphs)  # fmt: skip
    assert runs[0].tokens == runs[1].tokens
    for a, b in zip(runs[0].top1, runs[1].top1, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-4)
