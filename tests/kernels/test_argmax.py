"""Row argmax (kernels/argmax.py, kernels/argmax_triton.py) against torch.argmax: ties
to the first index, -inf rows, rows split over many programs. Without CUDA the
kernels run under TRITON_INTERPRET=1 on the CPU; with CUDA also at a 128k vocabulary
in float32 and bf16 (`gpu`). Exact: an index, no tolerance."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shunter.kernels import argmax as dispatch
from shunter.kernels import argmax_triton as mod
from shunter.kernels.argmax import argmax
from shunter.kernels.argmax_triton import argmax_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(mod, "BLOCK", 16)  # several blocks per split at small sizes


@pytest.mark.parametrize("num_splits", [1, 3, 7, None])
@pytest.mark.parametrize(("rows", "vocab"), [(1, 200), (5, 97), (3, 16)])
def test_matches_torch_argmax(small_blocks, num_splits, rows, vocab):
    g = torch.Generator().manual_seed(rows * vocab)
    x = torch.randn(rows, vocab, generator=g).to(DEVICE)
    got = argmax_triton(x, num_splits)
    assert got.dtype == torch.int64 and torch.equal(got, x.argmax(-1))


def test_ties_go_to_the_first_index_across_blocks_and_splits(small_blocks):
    x = torch.zeros(4, 100)
    x[0, [90, 7, 55]] = 3.0  # ties in different splits: the earliest wins
    x[1, [17, 18]] = 2.0  # ties inside one block
    x[2] = -float("inf")  # nothing finite: index 0, as torch
    x[3, 99] = float("inf")
    x = x.to(DEVICE)
    for s in (1, 4, 7):
        got = argmax_triton(x, s).tolist()
        assert got == [7, 17, 0, 99] == x.argmax(-1).tolist()


def test_strided_rows_empty_batch_and_bad_input(small_blocks):
    x = torch.randn(6, 80).to(DEVICE)[::2]  # rows 160 apart
    assert torch.equal(argmax_triton(x, 3), x.argmax(-1))
    assert argmax_triton(x[:0]).shape == (0,)
    with pytest.raises(ValueError):
        argmax_triton(x.t())
    assert torch.equal(argmax(x), x.argmax(-1))  # the dispatcher, either path


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 8, 256])
def test_llama3_vocabulary_on_the_gpu(monkeypatch, dtype, rows):
    monkeypatch.setattr(dispatch, "MAX_ROWS", 256)
    x = (torch.randn(rows, 128256, device="cuda") * 4).to(dtype)
    x[0, 128255] = x[0].max() + 1  # the last column wins in row 0
    assert torch.equal(argmax(x), x.argmax(-1))


def test_wider_dtypes_are_refused_by_the_kernel_and_go_to_torch():
    x = torch.randn(2, 50, dtype=torch.float64).to(DEVICE)
    with pytest.raises(ValueError, match="float32"):
        argmax_triton(x)
    assert torch.equal(argmax(x), x.argmax(-1))
