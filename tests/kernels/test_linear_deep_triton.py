"""The one-row GEMV streaming its weight through shared memory
(kernels/linear_deep_triton.py) against the torch reference: under TRITON_INTERPRET=1
on the CPU at small, odd shapes in float32 (1e-4 relative; the interpreter's bf16 is
not what it is for), and with CUDA in bf16 at Llama-3-8B shapes (2 bf16 ulps of the
largest output, against a float32 reference rounded to bf16), where the first tiles
are requested before the PDL wait and x is read by the inline-assembly load."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shunter.kernels.linear import linear_ref
from shunter.kernels.linear_deep_triton import deep_gemv_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _randn(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


def _close(got, want, rel):
    scale = want.float().abs().max().clamp(min=1.0)
    torch.testing.assert_close(got.float(), want.float(), atol=rel * float(scale), rtol=rel)


@pytest.mark.parametrize(("n", "k"), [(40, 64), (33, 300), (7, 1000)])
@pytest.mark.parametrize("config", [(4, 64, 3, 4), (8, 32, 2, 2)])
def test_deep_gemv_matches_reference(n, k, config):
    x, w = _randn(1, k, seed=1), _randn(n, k, seed=2) * 0.1
    y = deep_gemv_triton(x, w, config=config)
    assert y.shape == (1, n) and y.dtype == x.dtype
    _close(y, linear_ref(x, w), 1e-4)


def test_deep_gemv_rejects_more_than_one_row():
    with pytest.raises(ValueError, match="one row"):
        deep_gemv_triton(_randn(2, 64), _randn(8, 64))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    ("n", "k"), [(6144, 4096), (4096, 4096), (4096, 14336), (57344, 4096), (128256, 4096)]
)
def test_deep_gemv_bf16_at_llama_shapes(n, k):
    x, w = _randn(1, k, dtype=torch.bfloat16, seed=8), _randn(n, k, dtype=torch.bfloat16) * 0.02
    _close(deep_gemv_triton(x, w), linear_ref(x, w), 1.6e-2)
