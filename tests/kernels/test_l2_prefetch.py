"""The L2 prefetch of the next weight (kernels/l2_prefetch.py): how much it warms, that it
does nothing off Hopper, and on CUDA (`gpu`) that it changes no result, in a captured
graph and in the engine's greedy decode. That it builds for sm_90 with its launch
order is checked by tests/kernels/test_compile_hopper.py."""

from __future__ import annotations

import pytest
import torch

from shunter.kernels import l2_prefetch as lp

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_prefetch_bytes_is_capped_by_the_weight_and_whole_16_byte_units(monkeypatch):
    w = torch.empty(6, 5, dtype=torch.bfloat16)  # 60 bytes
    monkeypatch.setattr(lp, "PREFETCH_BYTES", 0)
    assert lp.prefetch_bytes(w) == 0
    monkeypatch.setattr(lp, "PREFETCH_BYTES", 40)
    assert lp.prefetch_bytes(w) == 32
    monkeypatch.setattr(lp, "PREFETCH_BYTES", 1 << 30)
    assert lp.prefetch_bytes(w) == 48


def test_off_cuda_it_is_a_no_op(monkeypatch):
    monkeypatch.setattr(lp, "PREFETCH_BYTES", 1 << 20)
    w = torch.randn(64, 64)
    before = w.clone()
    lp.prefetch_weight(w)
    assert torch.equal(w, before)


@gpu
@pytest.mark.gpu
def test_prefetch_inside_a_captured_graph_changes_nothing(monkeypatch):
    """A graph of prefetch then GEMV, replayed, gives the GEMV's result without it."""
    from shunter.kernels.linear_triton import linear_gemv_triton

    monkeypatch.setattr(lp, "PREFETCH_BYTES", 64 << 20)
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(14336, 4096, generator=g, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 4096, generator=g, device="cuda", dtype=torch.bfloat16)
    want = linear_gemv_triton(x, w, None)
    lp.prefetch_weight(w)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lp.prefetch_weight(w)
        y = linear_gemv_triton(x, w, None)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, want)


@gpu
@pytest.mark.gpu
def test_engine_greedy_tokens_are_the_same_with_prefetch(tmp_path):
    """A bf16 dummy Llama decodes the same greedy tokens, with the same logprobs, with
    the prefetch on as off (bs=1 steps run it before every GEMV; graphs on)."""
    from shunter.ops import gpu_parity as gp

    hf_model, hf_cfg = gp.build_hf("small", torch.bfloat16, "cuda")
    prompts = gp.random_prompts(hf_cfg.vocab_size, [17])
    runs = gp.runs_with_setting(lp, "PREFETCH_BYTES", [0, 1 << 20], hf_model, hf_cfg,
                                tmp_path, prompts, 24, dtype=torch.bfloat16, graphs=True)  # fmt: skip
    assert runs[0].tokens == runs[1].tokens
    assert runs[0].top1 == runs[1].top1
