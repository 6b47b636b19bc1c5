"""The GQA-packed split-KV extend kernel (kernels/attention_extend_split_triton.py)
against float64 SDPA over each entry's gathered KV and against the one-block-per-head
kernel: split counts from one (no merge) to more splits than some blocks have keys,
sliding windows, GQA groups that are not powers of two, page sizes 1 and 16. Without
CUDA under TRITON_INTERPRET=1 at small shapes; `gpu` tests at Llama-3-8B head shapes."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shunter.kernels import attention_extend_split_triton as short
from shunter.kernels.attention_extend import (
    extend_fields,
    extend_meta,
    extend_meta_rows,
    plan_extend,
)
from shunter.kernels.attention_extend_split_triton import (
    attention_extend_split_triton,
    split_launch,
)
from shunter.kernels.attention_extend_triton import attention_extend_triton
from tests.kernels.test_attention_triton import DEVICE, TOL, _extend_case, _extend_expected

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _run(num_heads, num_kv, head_dim, num_new, seq_lens, page_size, dtype, *, splits=None,
         window=None, seed=5):  # fmt: skip
    q, kc, vc, tables = _extend_case(num_heads, num_kv, head_dim, num_new, seq_lens,
                                     page_size, dtype, seed)  # fmt: skip
    scale = head_dim**-0.5
    plan = plan_extend(num_new, seq_lens, tables, device=DEVICE, sliding_window=window)
    meta = extend_meta(plan, torch.device(DEVICE))
    out = attention_extend_split_triton(q, kc, vc, meta, scale, sliding_window=window,
                                        num_splits=splits)  # fmt: skip
    want = _extend_expected(q, kc, vc, num_new, tables, scale, window)
    return out, want, (q, kc, vc, meta, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv", "head_dim", "num_new", "seq_lens", "splits"),
    [
        (8, 2, 32, [5], [200], 3),  # one entry, a long prefix split three ways
        # group of 3 (padded to 4); no prefix; 3 splits of 64 keys, so the 9-key entry's
        # second and third splits are empty and merge with weight 0
        (6, 2, 16, [3, 1, 9], [70, 130, 9], 4),
        (4, 4, 8, [20, 2], [150, 40], 1),  # MHA, one split: the output written directly
        (8, 1, 32, [17], [90], 7),  # group of 8: several blocks of tokens
        (4, 2, 16, [3], [1200], 40),  # 19 splits: the merge reads them 16 at a time
    ],
)
def test_split_extend_matches_sdpa(dtype, page_size, num_heads, num_kv, head_dim, num_new,
                                   seq_lens, splits):  # fmt: skip
    out, want, _ = _run(num_heads, num_kv, head_dim, num_new, seq_lens, page_size, dtype,
                        splits=splits)  # fmt: skip
    assert out.dtype == dtype and out.shape == want.shape
    torch.testing.assert_close(out.double(), want, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("splits", [1, 2, 5])
def test_split_extend_sliding_window(splits):
    """Keys before a block's window are given to no split; rows whose window starts
    inside a split are masked there."""
    out, want, _ = _run(6, 3, 32, [4, 12], [50, 80], 16, torch.float32, splits=splits,
                        window=9)  # fmt: skip
    torch.testing.assert_close(out.double(), want, rtol=TOL[torch.float32],
                               atol=TOL[torch.float32])  # fmt: skip


def test_split_extend_chosen_count_agrees_with_the_per_head_kernel():
    out, _, (q, kc, vc, meta, scale) = _run(8, 2, 16, [6, 30], [300, 64], 16, torch.float32)
    other = attention_extend_triton(q, None, None, kc, vc, meta, scale, split=False)
    torch.testing.assert_close(out, other, rtol=2e-5, atol=2e-5)


def test_short_extends_dispatch_to_the_split_kernel(monkeypatch):
    """attention_extend_triton takes the split kernel for steps of at most
    SPLIT_MAX_NEW_TOKENS new tokens per entry (same result as asking for it)."""
    n = 64
    monkeypatch.setattr(short, "SPLIT_MAX_NEW_TOKENS", n)
    q, kc, vc, tables = _extend_case(4, 2, 16, [n], [n + 40], 1, torch.float32, 9)
    meta = extend_meta(plan_extend([n], [n + 40], tables, device=DEVICE), torch.device(DEVICE))
    auto = attention_extend_triton(q, None, None, kc, vc, meta, 0.25)
    forced = attention_extend_triton(q, None, None, kc, vc, meta, 0.25, split=True)
    assert torch.equal(auto, forced)
    want = _extend_expected(q, kc, vc, [n], tables, 0.25)
    torch.testing.assert_close(auto.double(), want, rtol=2e-5, atol=2e-5)


def test_split_launch_packs_the_group_into_at_most_128_rows():
    assert split_launch(4, 128, 2) == (32, 4, 8)  # the 8B step: 32 tokens x 4 heads
    assert split_launch(4, 128, 4) == (16, 4, 4)  # float32: 64 rows
    assert split_launch(3, 64, 2) == (32, 4, 8)  # group of 3 padded to 4
    assert split_launch(1, 64, 2) == (128, 1, 8)
    assert split_launch(32, 128, 2) == (4, 32, 8)
    assert split_launch(64, 256, 2) == (1, 64, 4)  # 64 rows: one token, its 64 heads


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
def test_split_extend_llama8b_heads_on_gpu(page_size):
    """The 8B head shape, bf16: 32 new tokens over 2,048 cached, several short entries
    over long prefixes, one over none."""
    num_new, seq_lens = [32, 1, 64, 7], [2080, 9000, 4160, 7]
    out, want, _ = _run(32, 8, 128, num_new, seq_lens, page_size, torch.bfloat16)
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("split", [False, True])
def test_extend_kernels_read_entries_from_a_device_row_table(split):
    """Metadata over a runner's row table (extend_meta_rows): each entry's slots are a
    row of a wider table, at rows out of order, beside rows of other requests; both
    kernels give what they give over the padded copy of the same slot tables."""
    num_new, seq_lens = [4, 20, 2], [90, 20, 37]
    q, kc, vc, tables = _extend_case(8, 2, 16, num_new, seq_lens, 16, torch.float32, 11)
    plan = plan_extend(num_new, seq_lens, tables, device=DEVICE)
    padded = extend_meta(plan, torch.device(DEVICE))
    rows = [5, 0, 3]
    g = torch.Generator().manual_seed(2)
    table = torch.randint(0, kc.shape[0], (7, 128), generator=g, dtype=torch.int32)
    for r, t in zip(rows, tables, strict=True):
        table[r, : t.shape[0]] = t.to(torch.int32)
    fields = torch.tensor(extend_fields(rows, num_new, seq_lens), device=DEVICE)
    meta = extend_meta_rows(table.to(DEVICE), fields, num_new, seq_lens)
    assert (meta.max_num_new, meta.max_seq_len) == (20, 90)
    got = attention_extend_triton(q, None, None, kc, vc, meta, 0.25, split=split)
    want = attention_extend_triton(q, None, None, kc, vc, padded, 0.25, split=split)
    assert torch.equal(got, want)
