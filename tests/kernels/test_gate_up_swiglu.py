"""gate/up projection with the SwiGLU in its epilogue (kernels/gate_up_swiglu.py and
kernels/gate_up_swiglu_triton.py) against the float32 reference. Without CUDA the
kernel runs under TRITON_INTERPRET=1 on the CPU at small, odd shapes in float32 (the
interpreter's bf16 dots are wrong); with CUDA also bf16 at Llama-3-8B's shapes (`gpu`).

Tolerances: float32 1e-4 relative to the largest output (float32 dots in another
summation order); bf16 against the float32 reference rounded to bf16: 2 bf16 ulps
(1.6e-2) of the largest output, and no worse than the two-launch path (F.linear, then
silu_mul, which rounds the gate_up output in between)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shunter.kernels import gate_up_swiglu as mod
from shunter.kernels.gate_up_swiglu import gate_up_swiglu, gate_up_swiglu_ref
from shunter.kernels.gate_up_swiglu_triton import gate_up_swiglu_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = (16, 16, 16, 2, 4, 2)  # small tiles: several K steps, partial M and N blocks
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def _rel_err(got, want):
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1))


@pytest.mark.parametrize(("m", "inter", "k"), [(1, 16, 16), (37, 24, 48), (50, 40, 96)])
def test_fused_gemm_matches_reference(m, inter, k):
    x, w = _randn(m, k, seed=1), _randn(2 * inter, k, seed=2, scale=0.2)
    y = gate_up_swiglu_triton(x, w, config=SMALL)
    assert y.shape == (m, inter) and y.dtype == x.dtype and y.is_contiguous()
    assert _rel_err(y, gate_up_swiglu_ref(x, w)) < 1e-4


def test_fused_gemm_reads_strided_rows_and_refuses_bad_operands():
    k, inter = 32, 16
    big = _randn(9, 2 * k, seed=3)
    x = big[:, :k]  # rows 2k apart: a view, as a slice of a wider activation is
    w = _randn(2 * inter, k, seed=4, scale=0.2)
    assert _rel_err(gate_up_swiglu_triton(x, w, config=SMALL), gate_up_swiglu_ref(x, w)) < 1e-4
    assert gate_up_swiglu_triton(x[:0], w, config=SMALL).shape == (0, inter)
    with pytest.raises(ValueError, match="gate_up_swiglu"):
        gate_up_swiglu_triton(x, w[:, :16])  # K differs
    with pytest.raises(ValueError, match="gate_up_swiglu"):
        gate_up_swiglu_triton(x, w[:-1])  # odd number of weight rows
    with pytest.raises(ValueError, match="gate_up_swiglu"):
        gate_up_swiglu_triton(x.double(), w)
    with pytest.raises(ValueError, match="output rows"):
        gate_up_swiglu_triton(x, w[:6])  # inter 3: 12-byte output rows


def test_dispatch_is_the_two_launch_path_unless_switched_on(monkeypatch):
    x, w = _randn(5, 32, seed=5), _randn(48, 32, seed=6, scale=0.2)
    assert not mod.fused_applies(x, w)  # MIN_ROWS 0: never
    two = torch.nn.functional.linear(x, w)
    want = two[:, :24] * torch.sigmoid(two[:, :24]) * two[:, 24:]
    torch.testing.assert_close(gate_up_swiglu(x, w), want)
    monkeypatch.setattr(mod, "MIN_ROWS", 4)
    xb, wb = x.bfloat16(), w.bfloat16()
    assert mod.fused_shapes(xb, wb)
    assert mod.fused_applies(xb, wb) == (DEVICE == "cuda")
    assert not mod.fused_shapes(xb[:3], wb)  # below MIN_ROWS
    assert not mod.fused_shapes(x, w)  # float32: the two launches
    assert not mod.fused_shapes(xb, wb[:6])  # inter 3: 6-byte output rows, no TMA
    assert not mod.fused_shapes(xb[:, 1:17], wb[:, :16])  # x's start off 16 bytes


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 300, 8192])
def test_fused_gemm_bf16_at_llama_8b_shape(m):
    k, inter = 4096, 14336
    x = _randn(m, k, dtype=torch.bfloat16, seed=7)
    w = _randn(2 * inter, k, dtype=torch.bfloat16, seed=8, scale=0.02)
    y = gate_up_swiglu_triton(x, w)
    want = gate_up_swiglu_ref(x, w)
    two = torch.nn.functional.silu(x @ w[:inter].t()) * (x @ w[inter:].t())
    err, err_two = _rel_err(y, want), _rel_err(two, want)
    assert err < 1.6e-2 and err <= max(err_two, 8e-3), (err, err_two)


def test_tma_readiness():
    t = torch.zeros(4, 64)
    assert mod.tma_ready(t) and mod.tma_ready(t[:, :32])
    assert not mod.tma_ready(t[:, 1:33])  # start off 16-byte alignment
    assert not mod.tma_ready(torch.zeros(4, 6))  # 24-byte rows
    assert not mod.tma_ready(t.t())  # K not contiguous


@torch.no_grad()
def test_decoder_layer_through_the_fused_gemm_equals_two_launches(monkeypatch):
    """The model's wiring: with the fused GEMM forced on (under the interpreter on the
    CPU), a decoder layer's output and residual equal the two-launch path's. Attention
    is a stand-in (the q heads of qkv), which this test is not about."""
    from shunter.actors.executor.models import llama
    from shunter.actors.executor.models.config import from_hf_dict
    from shunter.ops.bench_gpu_model import TINY_LLAMA

    torch.manual_seed(0)
    layer = llama.LlamaDecoderLayer(from_hf_dict(TINY_LLAMA), 0).to(DEVICE)
    for p in layer.parameters():  # norms away from 1, so their weights matter
        p.add_(0.1 * torch.randn_like(p))
    monkeypatch.setattr(layer.self_attn, "forward", lambda qkv, rope, ctx: qkv[:, :128])
    x, res = _randn(7, 128, seed=9), _randn(7, 128, seed=10)
    assert not layer.mlp.fuses_swiglu(x)
    want, want_res = layer(x.clone(), res.clone(), None, None)
    calls = []
    monkeypatch.setattr(llama, "fused_applies", lambda x, w: True)
    monkeypatch.setattr(mod, "fused_applies", lambda x, w: calls.append(x.shape) or True)
    got, got_res = layer(x.clone(), res.clone(), None, None)
    assert calls == [(7, 128)]  # the fused GEMM ran, once
    torch.testing.assert_close(got_res, want_res)
    assert _rel_err(got, want) < 1e-4
