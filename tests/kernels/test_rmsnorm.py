"""RMSNorm and fused add+RMSNorm vs a float64 computation written out by hand.
Tolerances: float32 1e-5 abs/rel; bfloat16 2e-2 (its resolution at these magnitudes)."""

from __future__ import annotations

import pytest
import torch

from shunter.kernels.rmsnorm import fused_add_rmsnorm, fused_add_rmsnorm_ref, rmsnorm, rmsnorm_ref

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _expected(x, w, eps):
    x64 = x.double()
    return x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 7), (5, 64), (3, 4, 577), (0, 16)])
def test_rmsnorm_matches_formula(dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = torch.randn(shape[-1], generator=g).to(dtype)
    want = _expected(x, w, 1e-6).to(dtype)
    for fn in (rmsnorm, rmsnorm_ref):
        out = fn(x, w, 1e-6)
        assert out.dtype == dtype and out.shape == x.shape
        torch.testing.assert_close(out, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rmsnorm_returns_norm_and_sum(dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 33, generator=g).to(dtype)
    res = torch.randn(9, 33, generator=g).to(dtype)
    w = torch.rand(33, generator=g).to(dtype)
    want_sum = (x.double() + res.double()).to(dtype)
    want = _expected(want_sum, w, 1e-5).to(dtype)
    for fn in (fused_add_rmsnorm, fused_add_rmsnorm_ref):
        out, new_res = fn(x.clone(), res.clone(), w, 1e-5)
        torch.testing.assert_close(new_res, want_sum, **TOL[dtype])
        torch.testing.assert_close(out, want, **TOL[dtype])


def test_rmsnorm_float32_is_bitwise_the_hf_formula():
    """The CPU path must agree exactly with the float32 reference (HF's formula), since
    greedy parity with HF depends on it."""
    x = torch.randn(16, 576)
    w = torch.randn(576)
    torch.testing.assert_close(rmsnorm(x, w, 1e-5), rmsnorm_ref(x, w, 1e-5), atol=2e-6, rtol=1e-6)
