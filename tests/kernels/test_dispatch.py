"""Device dispatch of the ops in kernels/*.py: CPU tensors take the torch path (plans
with masks, no device metadata), CUDA tensors the Triton kernels (`gpu` tests: the
dispatching op returns exactly what its Triton kernel returns, and matches the torch
path on CPU copies of the same data)."""

from __future__ import annotations

import pytest
import torch

from shunter.kernels.attention_decode import (
    attention_decode,
    attention_decode_ref,
    attention_decode_torch,
    plan_decode,
)
from shunter.kernels.attention_extend import (
    attention_extend,
    attention_extend_ref,
    attention_extend_torch,
    plan_extend,
)
from shunter.kernels.kv_store import kv_store, kv_store_torch
from shunter.kernels.rmsnorm import (
    fused_add_rmsnorm,
    fused_add_rmsnorm_torch,
    rmsnorm,
    rmsnorm_torch,
)
from shunter.kernels.rope import rope_cos_sin_cache, rope_gather, rope_rotate
from shunter.kernels.silu_mul import silu_mul, silu_mul_torch


def gpu(fn):
    """Mark `fn` as a GPU test, skipped without CUDA."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    return pytest.mark.gpu(skip(fn))


def _tables(lens: list[int], gen: torch.Generator) -> tuple[list[torch.Tensor], int]:
    num_slots = sum(lens) + 5
    perm = torch.randperm(num_slots, generator=gen)
    tables, at = [], 0
    for n in lens:
        tables.append(perm[at : at + n].clone())
        at += n
    return tables, num_slots


def test_cpu_plans_carry_masks_and_window():
    gen = torch.Generator().manual_seed(0)
    tables, _ = _tables([5, 9], gen)
    plan = plan_decode(tables, sliding_window=4)
    assert plan.sliding_window == 4 and plan.mask is not None
    assert plan.mask[0, 0, 0].tolist() == [
        False,
        True,
        True,
        True,
        True,
        False,
        False,
        False,
        False,
    ]
    assert plan_decode(tables, build_mask=False).mask is None
    eplan = plan_extend([2, 9], [5, 9], tables, sliding_window=4)
    assert eplan.sliding_window == 4 and eplan.device_meta is None
    assert all(m is not None for m in eplan.masks)  # a prefix, and a prompt past the window
    assert plan_extend([2], [5], tables[:1], build_masks=False).masks == [None]


def test_cpu_dispatch_is_the_torch_path():
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 64, generator=gen), torch.randn(64, generator=gen)
    assert torch.equal(rmsnorm(x, w, 1e-6), rmsnorm_torch(x, w, 1e-6))
    gu = torch.randn(3, 32, generator=gen)
    assert torch.equal(silu_mul(gu), silu_mul_torch(gu))
    cs = rope_cos_sin_cache(8, 16, 10000.0)
    q = torch.randn(3, 2, 8, generator=gen)
    cos, sin = rope_gather(cs, torch.tensor([0, 4, 9]))
    assert cos.shape == (3, 1, 8) and sin.shape == (3, 1, 8)
    out = rope_rotate(q, cos, sin)
    assert out.data_ptr() != q.data_ptr()  # the torch path returns a new tensor
    with pytest.raises(ValueError, match="beyond the rope table"):
        rope_gather(cs, torch.tensor([16]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@gpu
def test_cuda_norm_act_rope_store_dispatch(dtype):
    from shunter.kernels.rmsnorm_triton import rmsnorm_triton
    from shunter.kernels.rope_triton import rope_rotate_triton
    from shunter.kernels.silu_mul_triton import silu_mul_triton

    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    gen = torch.Generator().manual_seed(2)
    x, res = (
        torch.randn(7, 96, generator=gen).to(dtype),
        torch.randn(7, 96, generator=gen).to(dtype),
    )
    w = (1 + 0.3 * torch.randn(96, generator=gen)).to(dtype)
    xc, rc, wc = x.cuda(), res.cuda(), w.cuda()
    assert torch.equal(rmsnorm(xc, wc, 1e-5), rmsnorm_triton(xc, wc, 1e-5))
    torch.testing.assert_close(
        rmsnorm(xc, wc, 1e-5).cpu(), rmsnorm_torch(x, w, 1e-5), atol=tol, rtol=tol
    )
    y, s = fused_add_rmsnorm(xc, rc, wc, 1e-5)
    wy, ws = fused_add_rmsnorm_torch(x.clone(), res, w, 1e-5)
    assert s.data_ptr() == xc.data_ptr()  # the sum is written into x, as on the CPU
    torch.testing.assert_close(s.cpu(), ws, atol=0, rtol=0)
    torch.testing.assert_close(y.cpu(), wy, atol=tol, rtol=tol)
    gu = torch.randn(5, 2 * 40, generator=gen).to(dtype)
    assert torch.equal(silu_mul(gu.cuda()), silu_mul_triton(gu.cuda()))
    torch.testing.assert_close(silu_mul(gu.cuda()).cpu(), silu_mul_torch(gu), atol=tol, rtol=tol)
    # a per-head norm over a strided [T, H, D] view of a fused projection (Qwen3)
    proj = torch.randn(7, 3 * 96, generator=gen).to(dtype)
    heads = proj[:, 96:192].view(7, 6, 16)
    got = rmsnorm(proj.cuda()[:, 96:192].view(7, 6, 16), wc[:16], 1e-5)
    torch.testing.assert_close(got.cpu(), rmsnorm_torch(heads, w[:16], 1e-5), atol=tol, rtol=tol)
    # rope over the joint q/k view of a fused projection: in place on CUDA
    cs = rope_cos_sin_cache(16, 64, 10000.0)
    pos = torch.tensor([0, 3, 17, 63, 5])
    qkv = torch.randn(5, 7 * 16, generator=gen).to(dtype)
    qk = qkv[:, : 6 * 16].view(5, 6, 16)
    want = rope_rotate(qk, *rope_gather(cs, pos))
    qkv_c = qkv.cuda()
    qk_c = qkv_c[:, : 6 * 16].view(5, 6, 16)
    a, b = rope_gather(cs.cuda(), pos.cuda())
    assert a is not None and b.shape == cs.shape  # (positions, table): no gather on CUDA
    ref_c = rope_rotate_triton(qk_c.clone(), a, b)
    got = rope_rotate(qk_c, a, b)
    assert got.data_ptr() == qkv_c.data_ptr() and torch.equal(got, ref_c)
    torch.testing.assert_close(got.cpu(), want, atol=tol, rtol=tol)
    assert torch.equal(qkv_c[:, 6 * 16 :].cpu(), qkv[:, 6 * 16 :])  # v untouched
    # the KV store reads strided views and casts to the pool dtype
    kc, vc = torch.zeros(20, 2, 16, dtype=dtype), torch.zeros(20, 2, 16, dtype=dtype)
    kv = torch.randn(5, 4 * 16, generator=gen)
    k, v = kv[:, :32].view(5, 2, 16), kv[:, 32:].view(5, 2, 16)
    slots = torch.tensor([7, 0, 19, 3, 11])
    kv_store_torch(kc, vc, slots, k, v)
    kcc, vcc = torch.zeros_like(kc).cuda(), torch.zeros_like(vc).cuda()
    kvc = kv.cuda()
    kv_store(kcc, vcc, slots.cuda(), kvc[:, :32].view(5, 2, 16), kvc[:, 32:].view(5, 2, 16))
    assert torch.equal(kcc.cpu(), kc) and torch.equal(vcc.cpu(), vc)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@gpu
def test_cuda_attention_dispatch(dtype, window):
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    gen = torch.Generator().manual_seed(3)
    num_heads, num_kv, head_dim, scale = 8, 2, 64, 0.125
    lens = [1, 9, 30, 4]
    tables, num_slots = _tables(lens, gen)
    kc = torch.randn(num_slots, num_kv, head_dim, generator=gen).to(dtype)
    vc = torch.randn(num_slots, num_kv, head_dim, generator=gen).to(dtype)
    kcc, vcc = kc.cuda(), vc.cuda()
    tables_c = [t.cuda() for t in tables]
    # decode: one query per entry; the CUDA plan has no mask, the kernel reads the window
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
    dplan = plan_decode(tables_c, device="cuda", sliding_window=window)
    assert dplan.mask is None and dplan.sliding_window == window
    got = attention_decode(q.cuda(), kcc, vcc, dplan, scale).cpu()
    want = attention_decode_torch(q, kc, vc, plan_decode(tables, sliding_window=window), scale)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    ref = attention_decode_ref(q.cuda(), kcc, vcc, tables_c, scale, window)
    torch.testing.assert_close(got, ref.cpu(), atol=tol, rtol=tol)
    # extend: new tokens after cached prefixes; the plan carries the kernel's metadata
    num_new = [1, 4, 30, 2]
    qe = torch.randn(sum(num_new), num_heads, head_dim, generator=gen).to(dtype)
    eplan = plan_extend(num_new, lens, tables_c, device="cuda", sliding_window=window)
    assert eplan.device_meta is not None and eplan.masks == [None] * len(lens)
    assert eplan.sliding_window == window
    got = attention_extend(qe.cuda(), None, None, kcc, vcc, eplan, scale).cpu()
    new = torch.cat([t[s - n :] for t, n, s in zip(tables, num_new, lens, strict=True)])
    cplan = plan_extend(num_new, lens, tables, sliding_window=window)
    want = attention_extend_torch(qe, kc[new], vc[new], kc, vc, cplan, scale)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    # the reference builds its masks on the tables' device
    ref = attention_extend_ref(qe.cuda(), kcc, vcc, num_new, tables_c, scale, window)
    torch.testing.assert_close(got, ref.cpu(), atol=tol, rtol=tol)
