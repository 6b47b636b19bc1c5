"""A step's attention context (actors/executor/models/attention.py): mixed steps take
their decode and extend rows as slices when each kind is one run of entries (the
scheduler's order) and as index tensors otherwise; either way, and with or without an
`out` buffer, paged_attention matches the float32 reference that treats every entry
as an extend (a decode is an extend of one token)."""

from __future__ import annotations

import pytest
import torch

from shunter.actors.executor.models.attention import build_attention_context, paged_attention
from shunter.kernels.attention_extend import attention_extend_ref

H, HKV, D = 4, 2, 16


def _step(num_new: list[int], seq_lens: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    num_slots = sum(seq_lens) + 8
    perm = torch.randperm(num_slots, generator=g)
    tables, at = [], 0
    for s in seq_lens:
        tables.append(perm[at : at + s].clone())
        at += s
    kc = torch.randn(num_slots, HKV, D, generator=g)
    vc = torch.randn(num_slots, HKV, D, generator=g)
    t = sum(num_new)
    q = torch.randn(t, H, D, generator=g)
    out_slots = torch.cat(
        [tb[s - n : s] for tb, n, s in zip(tables, num_new, seq_lens, strict=True)]
    )
    k, v = kc[out_slots].clone(), vc[out_slots].clone()  # the new tokens' K/V, already stored
    ctx = build_attention_context([kc], [vc], num_new, seq_lens, tables, device=torch.device("cpu"))
    want = attention_extend_ref(q, kc, vc, num_new, tables, D**-0.5)
    return ctx, q, k, v, want


@pytest.mark.parametrize(
    ("num_new", "seq_lens", "kind"),
    [
        ([5, 3, 1, 1], [9, 3, 7, 12], slice),  # prefill pieces, then decodes
        ([1, 1, 6], [4, 10, 6], slice),  # decodes first
        ([1, 4, 1], [5, 8, 3], torch.Tensor),  # interleaved: index rows
        ([2, 3], [2, 9], type(None)),  # no decode entry
    ],
)
@pytest.mark.parametrize("with_out", [False, True])
def test_mixed_rows_as_slices_or_indices_match_the_reference(num_new, seq_lens, kind, with_out):
    ctx, q, k, v, want = _step(num_new, seq_lens)
    assert isinstance(ctx.decode_rows, kind) and isinstance(ctx.extend_rows, kind)
    out = torch.full_like(q, float("nan")) if with_out else None
    got = paged_attention(ctx, 0, q, k, v, D**-0.5, stored=True, out=out)
    if with_out:
        assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_decode_slice_covers_exactly_the_decode_tokens():
    ctx, *_ = _step([5, 3, 1, 1], [9, 3, 7, 12])
    assert ctx.extend_rows == slice(0, 8) and ctx.decode_rows == slice(8, 10)
    ctx, *_ = _step([1, 1, 6], [4, 10, 6])
    assert ctx.decode_rows == slice(0, 2) and ctx.extend_rows == slice(2, 8)
