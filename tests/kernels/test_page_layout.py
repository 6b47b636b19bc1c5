"""The host page layout for paged attention (kernels/page_layout.py), CPU only: the
page-table layout helpers (`kv_page_layout`, `extend_qo_indptr`) and the device
page-id gather (`kv_page_indices`, against a per-entry Python loop, and through the
runner's pinned staging path). The flashinfer wrapper that reads this layout is
tested in test_attention_flashinfer.py; the slot-table helpers are in conftest.py."""

from __future__ import annotations

import pytest
import torch

from shunter.actors.executor.slot_table import PinnedStager
from shunter.kernels.page_layout import extend_qo_indptr, kv_page_indices, kv_page_layout
from tests.kernels.conftest import _row_table, _scatter


def test_kv_page_layout():
    indptr, last = kv_page_layout([1, 16, 17, 33, 48], 16)
    assert indptr.dtype == last.dtype == torch.int32 and indptr.device.type == "cpu"
    assert indptr.tolist() == [0, 1, 2, 4, 7, 10]
    assert last.tolist() == [1, 16, 1, 1, 16]
    indptr, last = kv_page_layout([3, 1, 1200], 1)
    assert indptr.tolist() == [0, 3, 4, 1204] and last.tolist() == [1, 1, 1]
    with pytest.raises(ValueError):
        kv_page_layout([4, 0], 16)


def test_extend_qo_indptr():
    indptr = extend_qo_indptr([5, 1, 37])
    assert indptr.dtype == torch.int32 and indptr.tolist() == [0, 5, 6, 43]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_kv_page_indices(page_size, dtype):
    gen = torch.Generator().manual_seed(page_size)
    lens = [1, 16, 17, 1500, 5, 32, 33]
    tables, _ = _scatter(lens, page_size, gen)
    table, rows = _row_table(tables, 11, gen, dtype)
    got = kv_page_indices(table, rows, lens, page_size)
    staged = kv_page_indices(table, rows, lens, page_size, PinnedStager(table.device).stage)
    assert torch.equal(staged, got)  # the runner's pinned staging path
    want = [
        int(table[r, j]) // page_size
        for r, n in zip(rows.tolist(), lens, strict=True)
        for j in range(0, n, page_size)
    ]
    assert got.dtype == torch.int32 and got.tolist() == want
    indptr, _ = kv_page_layout(lens, page_size)
    assert got.shape[0] == int(indptr[-1])


def test_kv_page_indices_empty_and_mismatched():
    table = torch.zeros(2, 8, dtype=torch.int64)
    assert kv_page_indices(table, torch.zeros(0, dtype=torch.int64), [], 4).shape == (0,)
    with pytest.raises(ValueError):
        kv_page_indices(table, torch.zeros(2, dtype=torch.int64), [3], 4)
