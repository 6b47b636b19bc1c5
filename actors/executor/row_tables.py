"""RowTables: the executor's per-row page and slot tables, written from a batch's
diffs with a few vectorized writes.

`pages` [num_rows, max_pages_per_row] int64 holds each row's page ids; `slots`
[num_rows, max_context_len] int64 the flat KV slot of every token position
(slot = page * page_size + position % page_size). With page_size 1 a page is a slot
and both names are one tensor. An entry's slot table handed to the runner is a view
`slots[row, :seq_len]`, so a decode step allocates nothing per row. Tables grow (by
at least ROW_CHUNK rows, doubling) when a row index past them arrives; a view taken
before a growth still reads the old storage, so views are taken per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shunter.actors.executor.slot_table import SLICE_MAX_ENTRIES, long_tensor

ROW_CHUNK = 64  # tables grow by at least this many rows


class RowTables:
    def __init__(self, page_size: int, max_pages_per_row: int, max_context_len: int) -> None:
        self.page_size = page_size
        self.pages = torch.zeros(0, max_pages_per_row, dtype=torch.int64)
        self.slots = (
            self.pages if page_size == 1 else torch.zeros(0, max_context_len, dtype=torch.int64)
        )

    def ensure(self, max_row_idx: int) -> None:
        """Grow the tables so that row `max_row_idx` exists (new rows are zero)."""
        have = self.pages.shape[0]
        if max_row_idx < have:
            return
        grow = max(max_row_idx + 1 - have, have, ROW_CHUNK)
        self.pages = torch.cat([self.pages, self.pages.new_zeros(grow, self.pages.shape[1])])
        if self.page_size == 1:
            self.slots = self.pages
        else:
            self.slots = torch.cat([self.slots, self.slots.new_zeros(grow, self.slots.shape[1])])

    def open(self, row_idx: int, prefix_pages: torch.Tensor | None, num_prefix_tokens: int) -> None:
        """A row opens on a cached prefix: its pages ([n] int64; None or empty: no
        prefix), and the slots of its tokens."""
        if prefix_pages is None or not len(prefix_pages):
            return
        self.pages[row_idx, : len(prefix_pages)] = prefix_pages
        ps = self.page_size
        if ps > 1 and num_prefix_tokens:
            p = torch.arange(num_prefix_tokens)
            self.slots[row_idx, :num_prefix_tokens] = self.pages[row_idx, p // ps] * ps + p % ps

    def append_pages(
        self,
        rows: Sequence[int],
        base_pages: Sequence[int],
        num_new_pages: Sequence[int],
        new_pages: torch.Tensor,
    ) -> None:
        """Entry e's num_new_pages[e] pages (consecutive in new_pages, [P] int64) go to
        row rows[e]'s page cells base_pages[e] onwards."""
        if len(rows) <= SLICE_MAX_ENTRIES:  # a slice per entry (slot_table.py says why)
            off = 0
            for r, b, k in zip(rows, base_pages, num_new_pages, strict=True):
                self.pages[r, b : b + k] = new_pages[off : off + k]
                off += k
            return
        k = long_tensor(num_new_pages)  # [E]
        base = long_tensor(base_pages) - (torch.cumsum(k, 0) - k)
        page_rows = torch.repeat_interleave(long_tensor(rows), k)
        page_idx = torch.repeat_interleave(base, k) + torch.arange(len(new_pages))
        self.pages[page_rows, page_idx] = new_pages

    def write_slots(self, token_rows: torch.Tensor, positions: torch.Tensor) -> None:
        """The slots of new tokens (row, position), from their rows' pages."""
        ps = self.page_size
        if ps > 1:
            self.slots[token_rows, positions] = (
                self.pages[token_rows, positions // ps] * ps + positions % ps
            )
