"""RowTables (actors/executor/row_tables.py): vectorized page and slot writes against a
per-token Python model of the same rows, across table growth."""

from __future__ import annotations

import random

import pytest
import torch

from shunter.actors.executor.row_tables import ROW_CHUNK, SLICE_MAX_ENTRIES, RowTables


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("num_rows", [3, SLICE_MAX_ENTRIES + 4])  # slices; one scatter
def test_pages_and_slots_match_a_per_token_model(page_size, num_rows):
    rng = random.Random(page_size * 100 + num_rows)
    max_ctx = 512  # a prefix under 40 plus 20 steps of at most 20 tokens
    tables = RowTables(page_size, -(-max_ctx // page_size), max_ctx)
    free = list(range(10_000))
    rng.shuffle(free)
    model: dict[int, list[int]] = {}  # row -> its page ids
    lens: dict[int, int] = {}
    growing = [3, ROW_CHUNK + 7, 2 * ROW_CHUNK + 1]  # each grows the tables
    for o_row in growing + list(range(10, 10 + num_rows - len(growing))):
        tables.ensure(o_row)
        n_prefix = rng.randrange(0, 40)
        pages = [free.pop() for _ in range(-(-n_prefix // page_size))]
        tables.open(o_row, torch.tensor(pages, dtype=torch.int64), n_prefix)
        model[o_row], lens[o_row] = pages, n_prefix
    assert tables.pages.shape[0] > 2 * ROW_CHUNK + 1
    for _ in range(20):  # steps: each row extends by 1..20 tokens
        rows = sorted(model)
        counts = [rng.randrange(1, 21) for _ in rows]
        base, k_new, new = [], [], []
        for r, c in zip(rows, counts):
            need = -(-(lens[r] + c) // page_size) - len(model[r])
            base.append(len(model[r]))
            k_new.append(need)
            got = [free.pop() for _ in range(need)]
            new += got
            model[r] += got
        tables.append_pages(rows, base, k_new, torch.tensor(new, dtype=torch.int64))
        token_rows = torch.tensor([r for r, c in zip(rows, counts) for _ in range(c)])
        positions = torch.tensor([lens[r] + i for r, c in zip(rows, counts) for i in range(c)])
        tables.write_slots(token_rows, positions)
        for r, c in zip(rows, counts):
            lens[r] += c
    for r, pages in model.items():
        assert tables.pages[r, : len(pages)].tolist() == pages
        want = [pages[p // page_size] * page_size + p % page_size for p in range(lens[r])]
        assert tables.slots[r, : lens[r]].tolist() == want
