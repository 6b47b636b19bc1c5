"""GEMV Triton projection (with its SwiGLU and add + RMSNorm prologues, and the gate/up
SwiGLU epilogue) (kernels/linear_triton.py) and the fused rope + KV store
(kernels/rope_kv_store_triton.py) against their torch references. Without CUDA they run
under TRITON_INTERPRET=1 on the CPU at small, odd shapes in float32 (the interpreter's
bf16 dots are wrong); with CUDA also bf16 at Llama-3-8B shapes (`gpu`).

Tolerances: float32 projections 1e-4 relative (float32 dots, another summation order);
bf16 projections against a float32 reference rounded to bf16: 2 bf16 ulps (1.6e-2) of
the largest output. The SwiGLU epilogue: equal to the GEMV then the silu_mul kernel
(the same tiles, sums and roundings). Rope + store: float32 exact against rope then kv_store; bf16 the
same kernels' rounding (exact on the GPU)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shunter.kernels.linear import (
    linear,
    linear_ref,
    norm_linear,
    norm_linear_ref,
    silu_mul_linear,
    silu_mul_linear_ref,
)
from shunter.kernels.linear_triton import (
    MAX_ROWS,
    gate_up_swiglu_gemv_triton,
    linear_gemv_triton,
    norm_linear_gemv_triton,
)
from shunter.kernels.rope import rope_cos_sin_cache, rope_gather_torch, rope_rotate_torch
from shunter.kernels.rope_kv_store import rope_kv_store, rope_kv_store_ref
from shunter.kernels.rope_kv_store_triton import rope_kv_store_triton
from shunter.kernels.silu_mul import silu_mul_ref
from shunter.kernels.silu_mul_triton import silu_mul_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CFG = (4, 32, 4)  # small tiles, so the odd shapes take several K steps and a partial N block
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _randn(*shape, dtype=torch.float32, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(device)


def _close(got, want, rel):
    scale = want.float().abs().max().clamp(min=1.0)
    torch.testing.assert_close(got.float(), want.float(), atol=rel * float(scale), rtol=rel)


@pytest.mark.parametrize("m", [1, 3, MAX_ROWS])
@pytest.mark.parametrize(("n", "k"), [(40, 64), (33, 300)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_reference(m, n, k, bias):
    x, w = _randn(m, k, seed=1), _randn(n, k, seed=2) * 0.1
    b = _randn(n, seed=3) if bias else None
    y = linear_gemv_triton(x, w, b, config=CFG)
    assert y.shape == (m, n) and y.dtype == x.dtype
    _close(y, linear_ref(x, w, b), 1e-4)


@pytest.mark.parametrize(("n", "k"), [(5, 300), (3, 4100)])
def test_gemv_default_configs_match_reference(n, k):
    """gemv_config's tiles (one weight row per program; K in one tile up to 4096, in
    512-wide steps beyond) at a short and a long K."""
    x, w = _randn(1, k, seed=1), _randn(n, k, seed=2) * 0.1
    _close(linear_gemv_triton(x, w), linear_ref(x, w), 1e-4)


@pytest.mark.parametrize("m", [1, 3])
def test_gemv_silu_mul_matches_reference(m):
    k = 96
    x, w = _randn(m, 2 * k, seed=4) * 3, _randn(24, k, seed=5) * 0.1
    y = linear_gemv_triton(x, w, silu_mul=True, config=CFG)
    _close(y, silu_mul_linear_ref(x, w), 1e-4)


@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("k", [64, 100])
def test_norm_gemv_matches_norm_then_linear(m, with_residual, k):
    x, w = _randn(m, k, seed=11) * 2, _randn(19, k, seed=12) * 0.1
    res = _randn(m, k, seed=13) if with_residual else None
    nw = _randn(k, seed=14).abs() + 0.5
    x0, res0 = x.clone(), None if res is None else res.clone()
    y, s = norm_linear_gemv_triton(x, res, nw, 1e-5, w, config=CFG)
    want_y, want_s = norm_linear_ref(x0, res0, nw, 1e-5, w)
    _close(y, want_y, 1e-4)
    torch.testing.assert_close(s, want_s)
    torch.testing.assert_close(x, x0)  # inputs untouched: other programs still read them
    if res is not None:
        torch.testing.assert_close(res, res0)


def test_gemv_reads_strided_rows():
    base = _randn(4, 100, seed=6)
    x = base[:, :64]  # row stride 100
    w = _randn(16, 64, seed=7)
    _close(linear_gemv_triton(x, w, config=CFG), linear_ref(x, w), 1e-4)


def test_gemv_rejects_a_width_mismatch():
    with pytest.raises(ValueError, match="columns"):
        linear_gemv_triton(_randn(2, 10), _randn(8, 12))
    with pytest.raises(ValueError, match="silu_mul"):
        linear_gemv_triton(_randn(2, 12), _randn(8, 12), silu_mul=True)


@pytest.mark.parametrize(("n2", "k"), [(40, 64), (34, 300), (6, 4100)])
@pytest.mark.parametrize("cfg", [CFG, None], ids=["small-tiles", "default-tiles"])
def test_gate_up_swiglu_equals_the_gemv_then_silu_mul(n2, k, cfg):
    x, w = _randn(1, k, seed=11), _randn(n2, k, seed=12) * 0.1
    y = gate_up_swiglu_gemv_triton(x, w, config=cfg)
    assert y.shape == (1, n2 // 2) and y.dtype == x.dtype
    assert torch.equal(y, silu_mul_triton(linear_gemv_triton(x, w, config=cfg)))
    _close(y, silu_mul_ref(linear_ref(x, w)), 1e-4)


def test_gate_up_swiglu_rejects_bad_shapes():
    for x, w in ((_randn(2, 8), _randn(6, 8)), (_randn(1, 8), _randn(5, 8)),
                 (_randn(1, 8), _randn(6, 9))):  # fmt: skip
        with pytest.raises(ValueError, match="gate_up_swiglu"):
            gate_up_swiglu_gemv_triton(x, w)


def test_dispatch_takes_the_torch_path_off_cuda():
    x, w = _randn(3, 8, device="cpu"), _randn(5, 8, device="cpu")
    torch.testing.assert_close(linear(x, w), x @ w.t())
    g = _randn(3, 16, device="cpu")
    torch.testing.assert_close(silu_mul_linear(g, w), silu_mul_linear_ref(g, w))
    res, nw = _randn(3, 8, seed=2, device="cpu"), _randn(8, seed=3, device="cpu")
    want = norm_linear_ref(x.clone(), res.clone(), nw, 1e-6, w)
    got = norm_linear(x.clone(), res.clone(), nw, 1e-6, w)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    got0 = norm_linear(x, None, nw, 1e-6, w)
    assert got0[1] is x
    torch.testing.assert_close(got0[0], norm_linear_ref(x, None, nw, 1e-6, w)[0])


def _rope_case(t, hq, hkv, d, dtype, seed=0, num_slots=40):
    qkv = _randn(t, (hq + 2 * hkv) * d, dtype=dtype, seed=seed)
    qk = qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    positions = torch.randperm(max(50, t), generator=torch.Generator().manual_seed(seed))[:t].to(
        DEVICE
    )
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed + 1))[:t]
    cache = rope_cos_sin_cache(d, 64, 10000.0).to(DEVICE)
    kc = torch.zeros(num_slots, hkv, d, dtype=dtype, device=DEVICE)
    return qk, v, positions, slots.to(DEVICE), cache, kc, torch.zeros_like(kc)


@pytest.mark.parametrize(("t", "hq", "hkv", "d"), [(1, 4, 2, 8), (5, 3, 1, 16), (7, 6, 3, 32)])
def test_rope_kv_store_triton_matches_rope_then_store(t, hq, hkv, d):
    qk, v, pos, slots, cache, kc, vc = _rope_case(t, hq, hkv, d, torch.float32, seed=t)
    cpu = torch.device("cpu")
    want_kc, want_vc = kc.to(cpu).clone(), vc.to(cpu).clone()
    rope = rope_gather_torch(cache.to(cpu), pos.to(cpu))
    want = rope_kv_store_ref(qk.to(cpu).clone(), v.to(cpu), rope, want_kc, want_vc,
                             slots.to(cpu), hq)  # fmt: skip
    rope_kv_store_triton(qk, v, pos, cache, kc, vc, slots, hq)
    torch.testing.assert_close(qk.to(cpu), want, atol=1e-6, rtol=1e-6)  # rotated in place
    torch.testing.assert_close(kc.to(cpu), want_kc, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(vc.to(cpu), want_vc)


def test_rope_kv_store_on_the_cpu_returns_the_rotation_and_stores():
    qk, v, pos, slots, cache, kc, vc = _rope_case(3, 2, 1, 8, torch.float32)
    qk, v, pos, slots, cache, kc, vc = (a.cpu() for a in (qk, v, pos, slots, cache, kc, vc))
    rope = rope_gather_torch(cache, pos)
    out = rope_kv_store(qk, v, rope, kc, vc, slots, 2)
    torch.testing.assert_close(out, rope_rotate_torch(qk, *rope))
    torch.testing.assert_close(kc[slots], out[:, 2:])
    torch.testing.assert_close(vc[slots], v)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, MAX_ROWS])
@pytest.mark.parametrize(
    ("n", "k"), [(6144, 4096), (4096, 4096), (4096, 14336), (57344, 4096), (128256, 4096)]
)
def test_gemv_bf16_at_llama_shapes(m, n, k):
    x, w = _randn(m, k, dtype=torch.bfloat16, seed=8), _randn(n, k, dtype=torch.bfloat16) * 0.02
    _close(linear_gemv_triton(x, w), linear_ref(x, w), 1.6e-2)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, MAX_ROWS])
def test_gemv_silu_mul_bf16_at_llama_shape(m):
    x = _randn(m, 2 * 14336, dtype=torch.bfloat16, seed=9) * 2
    w = _randn(4096, 14336, dtype=torch.bfloat16, seed=10) * 0.02
    _close(linear_gemv_triton(x, w, silu_mul=True), silu_mul_linear_ref(x, w), 1.6e-2)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, MAX_ROWS])
def test_norm_gemv_bf16_at_llama_shape(m):
    x, res = (
        _randn(m, 4096, dtype=torch.bfloat16, seed=15),
        _randn(m, 4096, dtype=torch.bfloat16, seed=16),
    )
    nw = _randn(4096, dtype=torch.bfloat16, seed=17)
    w = _randn(6144, 4096, dtype=torch.bfloat16, seed=18) * 0.02
    y, s = norm_linear_gemv_triton(x, res, nw, 1e-5, w)
    want_y, want_s = norm_linear_ref(x, res, nw, 1e-5, w)
    assert torch.equal(s, want_s)
    _close(y, want_y, 1.6e-2)


@gpu
@pytest.mark.gpu
def test_rope_kv_store_bf16_at_llama_shape_equals_the_separate_kernels():
    from shunter.kernels.kv_store_triton import kv_store_triton
    from shunter.kernels.rope_triton import rope_rotate_triton

    qk, v, pos, slots, cache, kc, vc = _rope_case(64, 32, 8, 128, torch.bfloat16, num_slots=4096)
    qk2, kc2, vc2 = qk.clone(), kc.clone(), vc.clone()
    rope_kv_store_triton(qk, v, pos, cache, kc, vc, slots, 32)
    rope_rotate_triton(qk2, pos, cache)
    kv_store_triton(kc2, vc2, slots, qk2[:, 32:], v)
    assert torch.equal(qk, qk2) and torch.equal(kc, kc2) and torch.equal(vc, vc2)


@gpu
@pytest.mark.gpu
def test_gate_up_swiglu_bf16_at_llama_shape_equals_the_two_kernels(monkeypatch):
    from shunter.kernels import linear as linear_mod

    x = _randn(1, 4096, dtype=torch.bfloat16, seed=19)
    w = _randn(28672, 4096, dtype=torch.bfloat16, seed=20) * 0.02
    two = silu_mul_triton(linear_gemv_triton(x, w))
    assert torch.equal(gate_up_swiglu_gemv_triton(x, w), two)
    monkeypatch.setattr(linear_mod, "FUSE_GATE_UP_SWIGLU", True)
    assert torch.equal(linear_mod.gate_up_swiglu(x, w), two)
    _close(two, silu_mul_ref(linear_ref(x, w)), 1.6e-2)


@gpu
@pytest.mark.gpu
def test_engine_greedy_tokens_are_the_same_with_the_swiglu_epilogue_on_gpu(tmp_path):
    """A bf16 dummy Llama decodes the same greedy tokens, with the same logprobs, with
    FUSE_GATE_UP_SWIGLU on as off (bs=1 steps take the GEMV; graphs on)."""
    from shunter.kernels import linear as linear_mod
    from shunter.ops import gpu_parity as gp

    hf_model, hf_cfg = gp.build_hf("small", torch.bfloat16, "cuda")
    prompts = gp.random_prompts(hf_cfg.vocab_size, [17])
    runs = gp.runs_with_setting(linear_mod, "FUSE_GATE_UP_SWIGLU", [False, True], hf_model,
                                hf_cfg, tmp_path, prompts, 24, dtype=torch.bfloat16, graphs=True)  # fmt: skip
    assert runs[0].tokens == runs[1].tokens
    assert runs[0].top1 == runs[1].top1
