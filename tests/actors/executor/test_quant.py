"""Packed weight formats: each layer computes x @ W^T + b for its rounded W, and the
default model in these formats departs from the float32 greedy reference only at a
step where the reference's own top-1/top-2 margin is small."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from shunter.actors.executor.kv_pool import KVPool
from shunter.actors.executor.loader import LoadError, load_model
from shunter.actors.executor.models import quant
from shunter.actors.executor.models.quant import PackedLinear, convert_linears, int8_supported
from shunter.actors.executor.runner import ForwardInput, ModelRunner

pytestmark = pytest.mark.skipif(not int8_supported(), reason="no int8 weight kernel in this torch")


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_computes_rounded_weights(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(70, 48, generator=g)
    b = torch.randn(70, generator=g) if bias else None
    x = torch.randn(rows, 48, generator=g)
    bf = PackedLinear(w, b, "bf16")
    want_bf = F.linear(
        x.bfloat16().double(), w.bfloat16().double(), None if b is None else b.bfloat16().double()
    )
    torch.testing.assert_close(bf(x).double(), want_bf, atol=0.1, rtol=1e-2)
    q = PackedLinear(w, b, "int8")
    scales = w.abs().amax(1) / 127
    w_int8 = (w / scales[:, None]).round() * scales[:, None]
    want = F.linear(x.double(), w_int8.double(), None if b is None else b.double())
    out = q(x)
    assert out.dtype == x.dtype and out.shape == (rows, 70)
    # bf16 activations/scales: relative error ~1e-2 of the output scale
    assert (out.double() - want).abs().max() < 0.05 * want.abs().max()


@pytest.mark.skipif(not quant.prepacked_bf16_supported(), reason="no oneDNN bf16 packing")
@pytest.mark.parametrize("rows", [1, 13, 32, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_bf16_weights_give_exactly_the_plain_gemm(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(rows, 64, generator=g)
    layer = PackedLinear(w, b, "bf16")
    assert layer.weight_bf16_packed is not None
    want = F.linear(x.bfloat16(), w.bfloat16(), None if b is None else b.bfloat16()).float()
    assert torch.equal(layer(x), want)


@pytest.mark.skipif(not quant.int4_supported(), reason="no int4 weight kernel in this torch")
@pytest.mark.parametrize("rows", [1, 4, 9, 13])
def test_int4_packs_groups_of_32_and_recovers_q4_1_weights(rows):
    g = torch.Generator().manual_seed(rows)
    # weights built as Q4_1 builds them: per group of 32, d * q + m with q in 0..15
    d = torch.rand(48, 96 // 32, generator=g) * 0.05 + 0.01
    m = -torch.rand(48, 96 // 32, generator=g) * 0.3
    q = torch.randint(0, 16, (48, 96), generator=g)
    q[:, ::32], q[:, 1::32] = 0, 15  # every group spans the full range
    w = (d.repeat_interleave(32, 1) * q + m.repeat_interleave(32, 1)).float()
    x = torch.randn(rows, 96, generator=g)
    layer = PackedLinear(w, None, "int4")
    want = F.linear(x.double(), w.double())
    out = layer(x)
    assert out.dtype == x.dtype and out.shape == (rows, 48)
    # exact weights up to bf16 scale/zero rounding and bf16 activations
    assert (out.double() - want).abs().max() < 0.02 * want.abs().max()
    with pytest.raises(ValueError, match="int4 weights need"):
        PackedLinear(torch.zeros(48, 40), None, "int4")


def test_convert_rejects_unknown_format():
    with pytest.raises(ValueError, match="unknown weight format"):
        convert_linears(torch.nn.Sequential(), "fp4")


def test_load_model_rejects_unknown_format(tiny_model_dir):
    with pytest.raises(LoadError, match="unknown weight format"):
        load_model(str(tiny_model_dir("llama")), weight_format="fp4", progress=False)


@pytest.mark.parametrize(("fmt", "min_margin"), [("int8", 0.4), ("bf16", 0.2), ("int4", 0.3)])
def test_default_model_agrees_where_the_reference_is_clear(
    fmt, min_margin, reference, default_model, monkeypatch
):
    """Teacher-forced over the reference outputs (so one early flip cannot cascade): at
    every step whose float32 top-1/top-2 margin exceeds min_margin the packed model
    picks the reference token. Low-margin steps may flip, as bf16 and llama.cpp do.
    Flips seen: int8 at margins <= 0.22, bf16 <= 0.09, int4 (near-exact for this
    Q4_1 file, logits head at 8 bits) <= 0.06 on hosts with AVX-512, and on an AVX2-only
    host also at the 0.22 step where int8 flips (the int8 head's kernel rounds
    differently there), hence int4's bound sits above int8's largest flip."""
    if fmt == "int4" and not quant.int4_supported():
        pytest.skip("no int4 weight kernel in this torch")
    monkeypatch.setattr(quant, "INT8_MAX_ROWS", 1 << 30)  # the packed kernel for every row
    monkeypatch.setattr(quant, "INT4_MAX_ROWS", 1 << 30)
    model, config = copy.deepcopy(default_model[0]), default_model[1]
    convert_linears(model, fmt)
    assert all(not isinstance(m, torch.nn.Linear) for m in model.modules())
    runner = ModelRunner(model, KVPool(config, 512))
    checked = 0
    for p in reference["prompts"]:
        ids = p["input_ids"] + p["output_ids"][:-1]
        inp = ForwardInput.build([ids], [0], [torch.arange(len(ids))], logits="all")
        picks = runner.forward(inp)[len(p["input_ids"]) - 1 :].argmax(-1).tolist()
        for step, (got, want, margin) in enumerate(
            zip(picks, p["output_ids"], p["step_top1_top2_margin"])
        ):
            if margin > min_margin:
                assert got == want, (fmt, p["name"], step, margin)
                checked += 1
    assert checked > 100
