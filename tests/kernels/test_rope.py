"""Rope vs an independent complex-number rotation in float64, and Llama 3.1 inverse
frequencies vs transformers' own implementation. Tolerance 1e-5 (float32)."""

from __future__ import annotations

import math

import pytest
import torch

from shunter.actors.executor.models.config import RopeScaling
from shunter.kernels.rope import apply_rope, apply_rope_ref, rope_cos_sin_cache, rope_inv_freq


def _rotate_complex(x, positions, inv_freq, fp32_angles=True):
    # pair i with i + D/2, rotate (x_i + j x_{i+D/2}) by pos * inv_freq[i]; HF (and so
    # this stack) rounds that angle to float32, which at position ~1000 moves it by
    # ~6e-5 rad, so the exact-angle check is looser.
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double())
    if fp32_angles:
        ang = (positions.float()[:, None] * inv_freq.float()[None, :]).double()
    else:
        ang = positions.double()[:, None] * inv_freq.double()[None, :]
    z = z * torch.polar(torch.ones_like(ang), ang)[:, None, :]
    return torch.cat([z.real, z.imag], -1)


@pytest.mark.parametrize("head_dim", [2, 64, 70])
@pytest.mark.parametrize("scaling", [None, RopeScaling("linear", factor=2.0),
                                     RopeScaling("llama3", factor=8.0, original_max_position_embeddings=32)])  # fmt: skip
def test_apply_rope_is_a_rotation_of_pairs(head_dim, scaling):
    g = torch.Generator().manual_seed(head_dim)
    q = torch.randn(11, 5, head_dim, generator=g)
    k = torch.randn(11, 1, head_dim, generator=g)
    positions = torch.tensor([0, 1, 2, 7, 100, 3, 999, 4, 5, 511, 6])
    cache = rope_cos_sin_cache(head_dim, 1000, 10000.0, scaling)
    inv = rope_inv_freq(head_dim, 10000.0, scaling)
    want_q = _rotate_complex(q, positions, inv).float()
    want_k = _rotate_complex(k, positions, inv).float()
    for fn in (apply_rope, apply_rope_ref):
        oq, ok = fn(q, k, positions, cache)
        torch.testing.assert_close(oq, want_q, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ok, want_k, atol=1e-5, rtol=1e-5)
        exact = _rotate_complex(q, positions, inv, fp32_angles=False).float()
        torch.testing.assert_close(oq, exact, atol=5e-4, rtol=0)


def test_plain_inv_freq_formula():
    inv = rope_inv_freq(8, 500.0)
    want = torch.tensor([500.0 ** (-2 * i / 8) for i in range(4)])
    torch.testing.assert_close(inv, want, atol=0, rtol=1e-6)


def test_llama3_inv_freq_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_parameters=params)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    ours = rope_inv_freq(128, 500000.0, RopeScaling("llama3", 8.0, 1.0, 4.0, 8192))
    torch.testing.assert_close(ours, want.float(), atol=0, rtol=1e-6)
    # the three bands: high frequencies untouched, low ones divided by the factor
    plain = rope_inv_freq(128, 500000.0)
    assert ours[0] == plain[0]
    assert math.isclose(float(ours[-1]), float(plain[-1]) / 8.0, rel_tol=1e-6)


def test_rope_position_beyond_table_is_an_error():
    cache = rope_cos_sin_cache(4, 8, 10000.0)
    with pytest.raises(ValueError, match="beyond"):
        apply_rope(torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), torch.tensor([8]), cache)
