"""The qkv GEMV with rope and the KV store in its epilogue (kernels/qkv_rope_store*.py)
against the GEMV followed by the rope + store kernel, and against the torch reference.
Without CUDA under TRITON_INTERPRET=1 on the CPU at small, odd shapes in float32; with
CUDA also bf16 at Llama-3.1-8B's shapes (`gpu`), and the engine's greedy tokens.

Tolerances: equal to the two Triton kernels (same tiles, sums and roundings); against
the float32 reference 1e-4 relative (another summation order); bf16 against it 2 bf16
ulps (1.6e-2) of the largest output."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shunter.kernels import qkv_rope_store as qrs
from shunter.kernels.linear_triton import linear_gemv_triton
from shunter.kernels.qkv_rope_store_triton import qkv_rope_store_triton
from shunter.kernels.rope import rope_cos_sin_cache, rope_gather_torch
from shunter.kernels.rope_kv_store_triton import rope_kv_store_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _case(hq, hkv, d, k, dtype, seed=0, num_slots=9, pos=37):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn((hq + 2 * hkv) * d, k, generator=g) * 0.1).to(dtype).to(DEVICE)
    positions = torch.tensor([pos], device=DEVICE)
    slots = torch.tensor([num_slots - 3], device=DEVICE)
    cache = rope_cos_sin_cache(d, 64, 10000.0).to(DEVICE)
    kc = torch.zeros(num_slots, hkv, d, dtype=dtype, device=DEVICE)
    return x, w, positions, slots, cache, kc, torch.zeros_like(kc)


def _two_kernels(x, w, positions, slots, cache, kc, vc, hq, config=None):
    """The GEMV, then rope + store: what the fused kernel must equal."""
    hkv, d = kc.shape[1:]
    qkv = linear_gemv_triton(x, w, config=config)
    qk = qkv[:, : (hq + hkv) * d].view(1, -1, d)
    v = qkv[:, (hq + hkv) * d :].view(1, hkv, d)
    rope_kv_store_triton(qk, v, positions, cache, kc, vc, slots, hq)
    return qk[:, :hq]


@pytest.mark.parametrize(("hq", "hkv", "d", "k"), [(4, 2, 8, 64), (3, 1, 16, 300), (6, 3, 32, 40)])
@pytest.mark.parametrize("cfg", [(4, 32, 4), None], ids=["small-tiles", "default-tiles"])
def test_fused_equals_the_gemv_then_rope_store(hq, hkv, d, k, cfg):
    x, w, pos, slots, cache, kc, vc = _case(hq, hkv, d, k, torch.float32, seed=d + k)
    kc2, vc2 = kc.clone(), vc.clone()
    q = qkv_rope_store_triton(x, w, pos, cache, kc, vc, slots, hq, config=cfg)
    assert q.shape == (1, hq, d) and q.dtype == x.dtype
    want_q = _two_kernels(x, w, pos, slots, cache, kc2, vc2, hq, config=cfg)
    assert torch.equal(q, want_q) and torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert kc.abs().sum() > 0 and vc.abs().sum() > 0  # the slot's row was written
    cpu = torch.device("cpu")
    rk, rv = torch.zeros_like(kc, device=cpu), torch.zeros_like(vc, device=cpu)
    ref = qrs.qkv_rope_store_ref(x.cpu(), w.cpu(), rope_gather_torch(cache.cpu(), pos.cpu()),
                                 rk, rv, slots.cpu(), hq)  # fmt: skip
    for got, want in ((q, ref), (kc, rk), (vc, rv)):
        torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)


def test_fused_rejects_bad_shapes():
    x, w, pos, slots, cache, kc, vc = _case(4, 2, 8, 64, torch.float32)
    with pytest.raises(ValueError, match="one row"):
        qkv_rope_store_triton(x.expand(2, -1).contiguous(), w, pos, cache, kc, vc, slots, 4)
    with pytest.raises(ValueError, match="q\\|k\\|v"):
        qkv_rope_store_triton(x, w[:-8], pos, cache, kc, vc, slots, 4)
    with pytest.raises(ValueError, match="q\\|k\\|v"):
        qkv_rope_store_triton(x, w, pos, cache, kc, vc, slots, 3)


def test_dispatch_off_cuda_is_the_reference(monkeypatch):
    """On the CPU the op is linear then rope_kv_store, switch or not (the kernel is
    CUDA's), and it stores k and v at the slot."""
    monkeypatch.setattr(qrs, "FUSE_QKV_ROPE_STORE", True)
    x, w, pos, slots, cache, kc, vc = (a.cpu() for a in _case(4, 2, 8, 64, torch.float32))
    rope = rope_gather_torch(cache, pos)
    assert not qrs.fusable(x, w, None)
    rk, rv = kc.clone(), vc.clone()
    q = qrs.qkv_rope_store(x, w, None, rope, kc, vc, slots, 4)
    torch.testing.assert_close(q, qrs.qkv_rope_store_ref(x, w, rope, rk, rv, slots, 4))
    assert torch.equal(kc, rk) and torch.equal(vc, rv) and kc[slots].abs().sum() > 0


@gpu
@pytest.mark.gpu
def test_fused_bf16_at_llama_shape_equals_the_two_kernels():
    x, w, pos, slots, cache, kc, vc = _case(32, 8, 128, 4096, torch.bfloat16, num_slots=4096)
    x, w = x * 2, w * 0.2
    kc2, vc2 = kc.clone(), vc.clone()
    q = qkv_rope_store_triton(x, w, pos, cache, kc, vc, slots, 32)
    want_q = _two_kernels(x, w, pos, slots, cache, kc2, vc2, 32)
    assert torch.equal(q, want_q) and torch.equal(kc, kc2) and torch.equal(vc, vc2)


@gpu
@pytest.mark.gpu
def test_engine_greedy_tokens_are_the_same_with_rope_store_in_the_qkv_gemv(tmp_path):
    """A bf16 dummy Llama decodes the same greedy tokens, with the same logprobs, with
    FUSE_QKV_ROPE_STORE on as off (bs=1 steps take the fused kernel; graphs on)."""
    from shunter.ops import gpu_parity as gp

    hf_model, hf_cfg = gp.build_hf("small", torch.bfloat16, "cuda")
    prompts = gp.random_prompts(hf_cfg.vocab_size, [17])
    runs = gp.runs_with_setting(qrs, "FUSE_QKV_ROPE_STORE", [False, True], hf_model, hf_cfg,
                                tmp_path, prompts, 24, dtype=torch.bfloat16, graphs=True)  # fmt: skip
    assert runs[0].tokens == runs[1].tokens
    assert runs[0].top1 == runs[1].top1
