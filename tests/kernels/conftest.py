"""Shared helpers for the paged-attention tests (test_attention_flashinfer.py,
test_page_layout.py): slot tables scattered over a page pool, and a row table
holding them. The test modules import these helpers by name."""

from __future__ import annotations

import torch


def _scatter(lens, page_size, gen, spare_pages=3):
    """Per entry [len] int64 slot tables whose pages are scattered over a pool of
    num_pages pages (page_size 1: every token on its own page), and num_pages."""
    pages_each = [-(-n // page_size) for n in lens]
    perm = torch.randperm(sum(pages_each) + spare_pages, generator=gen)
    offsets = torch.arange(page_size)
    owned = perm[: sum(pages_each)].split(pages_each)
    tables = [(p[:, None] * page_size + offsets).reshape(-1)[:n] for p, n in zip(owned, lens)]
    return tables, perm.numel()


def _row_table(tables, num_rows, gen, dtype=torch.int32):
    """A [num_rows, max_ctx] slot table holding the entries at shuffled rows, and the
    [B] rows of the entries."""
    max_ctx = max(t.shape[0] for t in tables) + 5
    table = torch.randint(0, 1 << 20, (num_rows, max_ctx), generator=gen).to(dtype)
    rows = torch.randperm(num_rows, generator=gen)[: len(tables)]
    for r, t in zip(rows.tolist(), tables, strict=True):
        table[r, : t.shape[0]] = t.to(dtype)
    return table, rows
