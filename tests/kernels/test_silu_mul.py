"""SiLU(gate) * up vs float64 x * sigmoid(x) * up. Tolerances: float32 1e-6, bf16 2e-2."""

from __future__ import annotations

import pytest
import torch

from shunter.kernels.silu_mul import silu_mul, silu_mul_ref


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", [(1, 2), (7, 26), (2, 3, 3072)])
def test_silu_mul_matches_formula(dtype, tol, shape):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    d = shape[-1] // 2
    g, u = x[..., :d].double(), x[..., d:].double()
    want = (g / (1 + torch.exp(-g)) * u).to(dtype)
    for fn in (silu_mul, silu_mul_ref):
        out = fn(x)
        assert out.shape == (*shape[:-1], d)
        torch.testing.assert_close(out, want, atol=tol, rtol=tol)


def test_silu_mul_rejects_odd_width():
    with pytest.raises(ValueError, match="even"):
        silu_mul(torch.zeros(2, 5))
