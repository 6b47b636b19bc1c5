"""Triton rmsnorm / fused add+rmsnorm / silu*up / rope / kv store vs their torch
references. Without CUDA they run under TRITON_INTERPRET=1 on the CPU at small, odd
shapes; with CUDA the same tests run compiled, plus `gpu` tests at Llama-3-8B shapes.

Tolerances: float32 1e-5. bf16 outputs within two bf16 ulps (rtol 1.6e-2): the
interpreter rounds float32 -> bf16 by truncation, and rsqrt may differ in its last
bit from torch's; on the GPU the kernels round to nearest. Rope in float32 and the
KV store are exact."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shunter.kernels.kv_store import kv_store_ref
from shunter.kernels.kv_store_triton import kv_store_triton
from shunter.kernels.rmsnorm import fused_add_rmsnorm_ref, rmsnorm_ref
from shunter.kernels.rmsnorm_triton import fused_add_rmsnorm_triton, rmsnorm_triton
from shunter.kernels.rope import apply_rope_ref, rope_cos_sin_cache
from shunter.kernels.rope_triton import apply_rope_triton, rope_rotate_triton
from shunter.kernels.silu_mul import silu_mul_ref
from shunter.kernels.silu_mul_triton import silu_mul_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


def _randn(*shape, dtype, seed, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 8), (5, 37), (2, 3, 100)])
def test_rmsnorm_matches_ref(dtype, shape):
    x = _randn(*shape, dtype=dtype, seed=1) * 3
    w = _randn(shape[-1], dtype=dtype, seed=2)
    out = rmsnorm_triton(x, w, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    tol = TOL[dtype]
    torch.testing.assert_close(out, rmsnorm_ref(x, w, 1e-6), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rmsnorm_writes_sum_into_x_and_normalizes_it(dtype):
    x = _randn(7, 45, dtype=dtype, seed=3)
    res = _randn(7, 45, dtype=dtype, seed=4)
    w = _randn(45, dtype=dtype, seed=5)
    want_y, want_sum = fused_add_rmsnorm_ref(x.clone(), res, w, 1e-5)
    y, new_res = fused_add_rmsnorm_triton(x, res, w, 1e-5)
    assert new_res.data_ptr() == x.data_ptr()  # the residual stream is updated in place
    tol = TOL[dtype]
    torch.testing.assert_close(new_res, want_sum, rtol=tol, atol=tol)
    torch.testing.assert_close(y, rmsnorm_ref(new_res, w, 1e-5), rtol=tol, atol=tol)
    torch.testing.assert_close(y, want_y, rtol=2 * tol, atol=2 * tol)


def test_rmsnorm_reads_rows_with_a_stride():
    base = _randn(6, 64, dtype=torch.float32, seed=6)
    x = base[:, :40]  # row stride 64, last axis contiguous
    w = _randn(40, dtype=torch.float32, seed=7)
    torch.testing.assert_close(rmsnorm_triton(x, w, 1e-6), rmsnorm_ref(x, w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2), (3, 4, 46), (9, 2 * 1500)])
def test_silu_mul_matches_ref(dtype, shape):
    x = _randn(*shape, dtype=dtype, seed=8) * 4
    out = silu_mul_triton(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    tol = TOL[dtype]
    torch.testing.assert_close(out, silu_mul_ref(x), rtol=tol, atol=tol)


def test_silu_mul_rejects_odd_width():
    with pytest.raises(ValueError, match="even"):
        silu_mul_triton(_randn(2, 5, dtype=torch.float32, seed=9))


def _qkv(num_tokens, num_heads, num_kv, head_dim, dtype, seed):
    """q, k, v as views into one fused projection, as the model has them."""
    q_size, kv_size = num_heads * head_dim, num_kv * head_dim
    qkv = _randn(num_tokens, q_size + 2 * kv_size, dtype=dtype, seed=seed)
    q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv, head_dim)
    v = qkv[:, q_size + kv_size :].view(num_tokens, num_kv, head_dim)
    return qkv, q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv", "head_dim"), [(9, 3, 64), (4, 4, 6), (5, 1, 34)])
def test_rope_in_place_on_fused_qkv_views(dtype, num_heads, num_kv, head_dim):
    _, q, k, v = _qkv(11, num_heads, num_kv, head_dim, dtype, seed=10)
    v_before = v.clone()
    cs = rope_cos_sin_cache(head_dim, 4096, 10000.0).to(DEVICE)
    pos = torch.tensor([0, 1, 2, 4095, 17, 17, 300, 5, 9, 1000, 2048], device=DEVICE)
    want_q, want_k = apply_rope_ref(q, k, pos, cs)
    out_q, out_k = apply_rope_triton(q, k, pos, cs)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    tol = 2e-6 if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(q, want_q, rtol=tol, atol=tol)
    torch.testing.assert_close(k, want_k, rtol=tol, atol=tol)
    assert torch.equal(v, v_before)  # the v part of the projection is untouched


def test_rope_rotate_of_the_joint_qk_view_equals_separate_q_and_k():
    qkv, q, k, _ = _qkv(9, 6, 2, 32, torch.float32, seed=16)
    cs = rope_cos_sin_cache(32, 64, 10000.0).to(DEVICE)
    pos = torch.arange(9, device=DEVICE) * 7
    want_q, want_k = apply_rope_ref(q, k, pos, cs)
    qk = qkv[:, : 8 * 32].view(9, 8, 32)  # the model's one pass over q and k heads
    assert rope_rotate_triton(qk, pos, cs).data_ptr() == qkv.data_ptr()
    torch.testing.assert_close(q, want_q, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(k, want_k, rtol=2e-6, atol=2e-6)


def test_rope_rejects_odd_head_dim():
    q = _randn(2, 2, 5, dtype=torch.float32, seed=11)
    cs = torch.zeros(8, 5, device=DEVICE)
    with pytest.raises(ValueError, match="even"):
        apply_rope_triton(q, q.clone(), torch.zeros(2, dtype=torch.int64, device=DEVICE), cs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_store_writes_exactly_the_given_slots(dtype):
    _, _, k, v = _qkv(13, 6, 3, 24, dtype, seed=12)
    k_cache = _randn(40, 3, 24, dtype=dtype, seed=13)
    v_cache = _randn(40, 3, 24, dtype=dtype, seed=14)
    g = torch.Generator().manual_seed(15)
    slots = torch.randperm(40, generator=g)[:13].to(DEVICE)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    kv_store_ref(want_k, want_v, slots, k, v)
    kv_store_triton(k_cache, v_cache, slots, k, v)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_kv_store_rejects_mismatched_shapes():
    cache = torch.zeros(8, 2, 4, device=DEVICE)
    k = torch.zeros(3, 2, 4, device=DEVICE)
    with pytest.raises(ValueError, match="shape mismatch"):
        kv_store_triton(cache, cache.clone(), torch.arange(3, device=DEVICE), k, k[:, :1])
    with pytest.raises(ValueError, match="slots for"):
        kv_store_triton(cache, cache.clone(), torch.arange(2, device=DEVICE), k, k)


@gpu
@pytest.mark.gpu
def test_llama8b_shapes_bf16_on_gpu():
    """hidden 4096, intermediate 14336, 32 q / 8 kv heads of 128, 512 tokens."""
    t, hidden, inter = 512, 4096, 14336
    x = _randn(t, hidden, dtype=torch.bfloat16, seed=20)
    res = _randn(t, hidden, dtype=torch.bfloat16, seed=21)
    w = _randn(hidden, dtype=torch.bfloat16, seed=22)
    torch.testing.assert_close(rmsnorm_triton(x, w, 1e-5), rmsnorm_ref(x, w, 1e-5))
    y, s = fused_add_rmsnorm_triton(x.clone(), res, w, 1e-5)
    wy, ws = fused_add_rmsnorm_ref(x.clone(), res, w, 1e-5)
    assert torch.equal(s, ws)
    torch.testing.assert_close(y, wy)
    gu = _randn(t, 2 * inter, dtype=torch.bfloat16, seed=23)
    torch.testing.assert_close(silu_mul_triton(gu), silu_mul_ref(gu))
    _, q, k, v = _qkv(t, 32, 8, 128, torch.bfloat16, seed=24)
    cs = rope_cos_sin_cache(128, 8192, 500000.0).to(DEVICE)
    pos = torch.randint(0, 8192, (t,), device=DEVICE)
    wq, wk = apply_rope_ref(q, k, pos, cs)
    apply_rope_triton(q, k, pos, cs)
    torch.testing.assert_close(q, wq, rtol=1.6e-2, atol=1.6e-2)
    torch.testing.assert_close(k, wk, rtol=1.6e-2, atol=1.6e-2)
    kc = torch.zeros(8192, 8, 128, dtype=torch.bfloat16, device=DEVICE)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(8192, device=DEVICE)[:t]
    kv_store_triton(kc, vc, slots, k, v)
    assert torch.equal(kc[slots], k) and torch.equal(vc[slots], v)
