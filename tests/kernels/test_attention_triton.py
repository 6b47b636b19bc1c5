"""Triton paged decode (split-KV) and extend attention vs float64 SDPA over each
entry's gathered KV, and vs the torch references. Without CUDA they run under
TRITON_INTERPRET=1 at small, odd shapes (there the dots are taken in float32, as the
interpreter's bf16 dots are wrong); with CUDA compiled, plus `gpu` tests at Llama-3-8B
head shapes and long contexts.

Tolerances: float32 pool 1e-5 (interpreted) / 2e-5 (compiled); bf16 pool 2e-2 (the
output is rounded to bf16, and on the GPU the softmax weights are rounded to bf16
before the second dot)."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shunter.kernels.attention_decode import attention_decode_ref, plan_decode, plan_decode_rows
from shunter.kernels.attention_decode_triton import attention_decode_triton, choose_num_splits
from shunter.kernels.attention_extend import attention_extend_ref, extend_meta, plan_extend
from shunter.kernels.attention_extend_triton import attention_extend_triton, extend_launch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _pool(num_slots, num_kv, head_dim, dtype, gen):
    k = torch.randn(num_slots, num_kv, head_dim, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(num_slots, num_kv, head_dim, generator=gen).to(dtype).to(DEVICE)
    return k, v


def _tables(lens, page_size, gen):
    """Slot tables of entries whose pages are scattered over the pool (page_size 1:
    every token on its own page)."""
    pages_each = [-(-n // page_size) for n in lens]
    num_pages = sum(pages_each) + 3
    perm = torch.randperm(num_pages, generator=gen)
    tables, at = [], 0
    for n, p in zip(lens, pages_each, strict=True):
        pages = perm[at : at + p]
        at += p
        slots = (pages[:, None] * page_size + torch.arange(page_size)[None, :]).reshape(-1)
        tables.append(slots[:n].to(DEVICE))
    return tables, num_pages * page_size


def _sdpa64(q, k_cache, v_cache, slots, scale, q_pos, window=None):
    """q: [n, H, D] at positions q_pos [n]; keys at positions 0..len(slots)-1."""
    k = k_cache[slots].double().transpose(0, 1)  # [Hkv, L, D]
    v = v_cache[slots].double().transpose(0, 1)
    rep = q.shape[1] // k.shape[0]
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    kpos = torch.arange(slots.shape[0], device=q.device)
    mask = kpos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= kpos[None, :] > q_pos[:, None] - window
    o = F.scaled_dot_product_attention(
        q.double().transpose(0, 1), k, v, attn_mask=mask, scale=scale
    )
    return o.transpose(0, 1)  # [n, H, D]


def _decode_case(num_heads, num_kv, head_dim, lens, page_size, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    tables, num_slots = _tables(lens, page_size, g)
    kc, vc = _pool(num_slots, num_kv, head_dim, dtype, g)
    q = torch.randn(len(lens), num_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    return q, kc, vc, tables


def _decode_expected(q, kc, vc, tables, scale, window=None):
    outs = []
    for b, slots in enumerate(tables):
        pos = torch.tensor([slots.shape[0] - 1], device=q.device)
        outs.append(_sdpa64(q[b : b + 1], kc, vc, slots, scale, pos, window)[0])
    return torch.stack(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv", "head_dim", "lens"),
    [(9, 3, 64, [1, 70, 300, 5]), (4, 4, 7, [33]), (8, 1, 16, [17, 2, 129])],
)
@pytest.mark.parametrize("in_split", [False, True], ids=["merge-kernel", "merge-in-split"])
def test_decode_matches_sdpa(dtype, page_size, num_heads, num_kv, head_dim, lens, in_split):
    q, kc, vc, tables = _decode_case(num_heads, num_kv, head_dim, lens, page_size, dtype, seed=1)
    scale = head_dim**-0.5
    want = _decode_expected(q, kc, vc, tables, scale)
    plan = plan_decode(tables, device=DEVICE)
    tol = TOL[dtype]
    for num_splits in (None, 1, 3):  # default choice, one split (direct), merged splits
        out = attention_decode_triton(q, kc, vc, plan, scale, num_splits=num_splits,
                                      merge_in_split=in_split)  # fmt: skip
        assert out.dtype == dtype and out.shape == q.shape
        torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("in_split", [False, True], ids=["merge-kernel", "merge-in-split"])
def test_decode_agrees_with_torch_reference_and_window(in_split):
    q, kc, vc, tables = _decode_case(6, 2, 24, [3, 90, 200, 130], 16, torch.float32, seed=2)
    want = attention_decode_ref(q, kc, vc, tables, 0.2, sliding_window=40)
    plan = plan_decode(tables, device=DEVICE, sliding_window=40)
    for num_splits in (2, 7):  # the window leaves some entries one split with keys, some two
        out = attention_decode_triton(q, kc, vc, plan, 0.2, sliding_window=40,
                                      num_splits=num_splits, merge_in_split=in_split)  # fmt: skip
        torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)
    assert not torch.allclose(out, attention_decode_ref(q, kc, vc, tables, 0.2), atol=1e-3)


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_from_row_table_matches_padded_plan(page_size):
    """A row plan (what a captured decode step reads): entries at scattered rows of a
    wide table whose cells past each row's length hold garbage slots; one split count
    fixed for every length, as a graph replays it."""
    lens = [1, 70, 300, 5]
    q, kc, vc, tables = _decode_case(8, 2, 32, lens, page_size, torch.float32, seed=4)
    rows = [5, 2, 0, 7]
    width = 512
    table = torch.full((9, width), kc.shape[0] - 1, dtype=torch.int32, device=DEVICE)
    for r, slots in zip(rows, tables, strict=True):
        table[r, : slots.shape[0]] = slots.to(torch.int32)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    plan = plan_decode_rows(table, torch.tensor(rows, device=DEVICE), lens_t, max_len=width)
    want = _decode_expected(q, kc, vc, tables, 0.2)
    for num_splits, in_split in itertools.product((None, 1, 5), (False, True)):
        out = attention_decode_triton(q, kc, vc, plan, 0.2, num_splits=num_splits,
                                      merge_in_split=in_split)  # fmt: skip
        torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-5)


def test_decode_split_count_fills_the_gpu_without_tiny_splits():
    assert choose_num_splits(1, 8, 131072, 132) == 66  # one long entry: 4 programs per SM
    assert choose_num_splits(4, 8, 131072, 132) == 16
    assert choose_num_splits(64, 8, 32768, 132) == 1  # 512 programs already
    assert choose_num_splits(1, 8, 300, 132) == 2  # no split shorter than 256 keys
    assert choose_num_splits(1, 1, 1, 132) == 1


def _extend_case(num_heads, num_kv, head_dim, num_new, seq_lens, page_size, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    tables, num_slots = _tables(seq_lens, page_size, g)
    kc, vc = _pool(num_slots, num_kv, head_dim, dtype, g)
    q = torch.randn(sum(num_new), num_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    return q, kc, vc, tables


def _extend_expected(q, kc, vc, num_new, tables, scale, window=None):
    outs, start = [], 0
    for n, slots in zip(num_new, tables, strict=True):
        pos = torch.arange(slots.shape[0] - n, slots.shape[0], device=q.device)
        outs.append(_sdpa64(q[start : start + n], kc, vc, slots, scale, pos, window))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv", "head_dim", "num_new", "seq_lens"),
    [
        (9, 3, 64, [3, 70, 1], [10, 70, 40]),  # prefix + new, no prefix, one new token
        (4, 4, 7, [130], [133]),  # several query blocks
        (8, 2, 16, [5, 66], [5, 200]),
        (4, 2, 32, [3, 1, 16], [40, 1, 16]),  # short extends: 16-row query blocks
    ],
)
def test_extend_matches_sdpa(dtype, page_size, num_heads, num_kv, head_dim, num_new, seq_lens):
    q, kc, vc, tables = _extend_case(
        num_heads, num_kv, head_dim, num_new, seq_lens, page_size, dtype, seed=3
    )
    scale = head_dim**-0.5
    want = _extend_expected(q, kc, vc, num_new, tables, scale)
    plan = plan_extend(num_new, seq_lens, tables, device=DEVICE)
    out = attention_extend_triton(q, None, None, kc, vc, plan, scale)
    assert out.dtype == dtype and out.shape == q.shape
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)


def test_extend_window_and_reusable_meta_agree_with_torch_reference():
    num_new, seq_lens = [4, 80], [50, 80]
    q, kc, vc, tables = _extend_case(6, 3, 32, num_new, seq_lens, 16, torch.float32, seed=4)
    plan = plan_extend(num_new, seq_lens, tables, device=DEVICE, sliding_window=9)
    meta = extend_meta(plan, torch.device(DEVICE))
    out = attention_extend_triton(q, None, None, kc, vc, meta, 0.25, sliding_window=9)
    cpu = [t.cpu() for t in (q, kc, vc)]  # the torch reference builds its masks on the CPU
    tabs = [t.cpu() for t in tables]
    want = attention_extend_ref(*cpu, num_new, tabs, 0.25, sliding_window=9)
    torch.testing.assert_close(out.cpu(), want, rtol=2e-5, atol=2e-5)
    full = attention_extend_triton(q, None, None, kc, vc, meta, 0.25)
    want = attention_extend_ref(*cpu, num_new, tabs, 0.25)
    torch.testing.assert_close(full.cpu(), want, rtol=2e-5, atol=2e-5)


def test_extend_launch_keeps_big_blocks_to_16_bit_heads_up_to_128():
    assert extend_launch(4096, 128, 2) == (128, 128, 8, 2)
    assert extend_launch(4096, 128, 4)[:2] == (64, 64)  # float32: 128x128 overflows smem
    assert extend_launch(4096, 256, 2)[:2] == (64, 64)
    assert extend_launch(40, 128, 2)[0] == 64
    assert extend_launch(3, 128, 2)[0] == 16


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_llama8b_heads_long_context_on_gpu(page_size):
    lens = [1, 100, 4096, 32768, 777, 5000, 2, 16384]
    q, kc, vc, tables = _decode_case(32, 8, 128, lens, page_size, torch.bfloat16, seed=5)
    want = _decode_expected(q, kc, vc, tables, 128**-0.5)
    out = attention_decode_triton(q, kc, vc, plan_decode(tables, device=DEVICE), 128**-0.5)
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)


@gpu
@pytest.mark.gpu
def test_decode_merge_in_split_repeats_the_merge_kernels_output_on_gpu():
    """The in-split merge on the device, where the splits of one entry really run
    at once: 200 launches at the 8B heads (long and short entries, 66 splits each, as
    a bs=1-8 graph splits) and every output within the merge kernel's tolerance of the
    merge-kernel path; a counter left off 0 would mis-merge the launches after it."""
    lens = [1, 100, 4096, 30000, 777, 5000, 2, 130]
    q, kc, vc, tables = _decode_case(32, 8, 128, lens, 1, torch.bfloat16, seed=6)
    plan = plan_decode(tables, device=DEVICE)
    want = attention_decode_triton(q, kc, vc, plan, 128**-0.5, num_splits=66,
                                   merge_in_split=False).float()  # fmt: skip
    outs = [attention_decode_triton(q, kc, vc, plan, 128**-0.5, num_splits=66,
                                    merge_in_split=True) for _ in range(200)]  # fmt: skip
    for out in outs:
        torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2)


@gpu
@pytest.mark.gpu
def test_extend_float32_long_prompt_on_gpu():
    """A float32 pool with 64-wide heads and a 300-token prompt (the launch that once
    asked for more shared memory than the GPU has)."""
    q, kc, vc, tables = _extend_case(8, 2, 64, [300], [300], 16, torch.float32, 7)
    want = _extend_expected(q, kc, vc, [300], tables, 0.125)
    out = attention_extend_triton(q, None, None, kc, vc, plan_extend([300], [300], tables), 0.125)
    torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-5)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_llama8b_heads_on_gpu(page_size):
    num_new, seq_lens = [1024, 300, 1, 2000], [1024, 4396, 9000, 2048]
    q, kc, vc, tables = _extend_case(32, 8, 128, num_new, seq_lens, page_size, torch.bfloat16, 6)
    want = _extend_expected(q, kc, vc, num_new, tables, 128**-0.5)
    plan = plan_extend(num_new, seq_lens, tables, device=DEVICE)
    out = attention_extend_triton(q, None, None, kc, vc, plan, 128**-0.5)
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)
