"""Programmatic dependent launch (kernels/pdl.py): off where it cannot run, and on an
H100/H200 a chain of PDL-launched kernels (as a decode layer chains them), eager and
replayed from a CUDA graph, gives bit for bit the results of plain launches, also when
each kernel lets the next launch before it waits (pdl.TRIGGER_FIRST)."""

from __future__ import annotations

import pytest
import torch

import shunter.kernels.pdl as pdl


def test_off_the_gpu_and_under_the_interpreter(monkeypatch):
    assert not pdl.use_pdl(torch.zeros(1))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if torch.cuda.is_available():
        assert not pdl.use_pdl(torch.zeros(1, device="cuda"))


def _assert_pdl_equals_plain(run, monkeypatch) -> None:
    """run() under PDL, eager and replayed from a CUDA graph, equals run() with PDL off."""
    with_pdl = run()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    graph.replay()
    torch.cuda.synchronize()
    monkeypatch.setattr(pdl, "_capable", lambda index: False)
    plain = run()
    assert torch.equal(with_pdl, plain) and torch.equal(captured, plain)


def _chain(x, res, w_norm, w1, w2):
    from shunter.kernels.linear_triton import linear_gemv_triton, norm_linear_gemv_triton
    from shunter.kernels.rmsnorm import fused_add_rmsnorm

    h, res = fused_add_rmsnorm(x, res, w_norm, 1e-5)
    h, res = norm_linear_gemv_triton(h, res, w_norm, 1e-5, w1)  # [M, 2I]
    return linear_gemv_triton(h, w2, silu_mul=True), res


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("trigger_first", [False, True])
def test_pdl_chain_equals_plain_launches(monkeypatch, trigger_first):
    monkeypatch.setattr(pdl, "TRIGGER_FIRST", trigger_first)
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9")
    g = torch.Generator(device="cuda").manual_seed(0)
    dev, bf = "cuda", torch.bfloat16

    def randn(*s):
        return torch.randn(*s, generator=g, device=dev).to(bf)

    x, res, wn = randn(4, 1024), randn(4, 1024), randn(1024)
    w1, w2 = randn(2 * 2816, 1024) * 0.03, randn(1024, 2816) * 0.03

    def run():
        out, r = _chain(x.clone(), res.clone(), wn, w1, w2)
        return torch.cat([out, r], 1)

    assert pdl.use_pdl(x)
    _assert_pdl_equals_plain(run, monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("trigger_first", [False, True])
def test_pdl_decode_attention_and_swiglu_equal_plain_launches(monkeypatch, trigger_first):
    """rope+store, split-KV attention (stage 1 and merge) and SwiGLU chained as in a
    decode layer, under PDL (either order of wait and trigger) and replayed from a
    graph, equal plain launches bit for bit."""
    monkeypatch.setattr(pdl, "TRIGGER_FIRST", trigger_first)
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9")
    from shunter.kernels.attention_decode import plan_decode_rows
    from shunter.kernels.attention_decode_triton import attention_decode_triton
    from shunter.kernels.rope import rope_cos_sin_cache
    from shunter.kernels.rope_kv_store_triton import rope_kv_store_triton
    from shunter.kernels.silu_mul_triton import silu_mul_triton

    g = torch.Generator(device="cuda").manual_seed(1)
    dev, bf = "cuda", torch.bfloat16
    b, h, hkv, d, width = 3, 32, 8, 128, 1024
    kc = torch.randn(4096, hkv, d, generator=g, device=dev).to(bf)
    vc = torch.randn(4096, hkv, d, generator=g, device=dev).to(bf)
    qk0 = torch.randn(b, h + hkv, d, generator=g, device=dev).to(bf)
    v = torch.randn(b, hkv, d, generator=g, device=dev).to(bf)
    gate_up = torch.randn(b, 2 * 1536, generator=g, device=dev).to(bf)
    lens = torch.tensor([1, 700, 129], device=dev)
    table = torch.randperm(4096, generator=g, device=dev)[: b * width].view(b, width).int()
    slots = table[torch.arange(b, device=dev), lens - 1].long()
    plan = plan_decode_rows(table, torch.arange(b, device=dev), lens, max_len=width)
    cs = rope_cos_sin_cache(d, width, 500000.0).to(dev)

    def run():
        qk, k2, v2 = qk0.clone(), kc.clone(), vc.clone()
        rope_kv_store_triton(qk, v, lens - 1, cs, k2, v2, slots, h)
        o = attention_decode_triton(qk[:, :h], k2, v2, plan, d**-0.5)
        return torch.cat([o.view(b, -1), silu_mul_triton(gate_up)], 1)

    assert pdl.use_pdl(qk0)
    _assert_pdl_equals_plain(run, monkeypatch)
