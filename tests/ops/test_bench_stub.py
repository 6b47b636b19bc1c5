"""Timing-only stubs (ops/bench_stub.py): every group rebinds a function a decode step
really calls, a stubbed run completes and says so, and bad use is refused."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from shunter.actors.executor.build import build_core
from shunter.actors.executor.config import ExecutorConfig
from shunter.actors.executor.models import llama
from shunter.kernels import linear
from shunter.ops import bench_gpu as bg
from shunter.ops import bench_gpu_model as bm
from shunter.ops import bench_stub
from shunter.ops.bench_gpu_driver import Driver, random_prompts
from shunter.ops.cli import build_parser

TARGETS = {"attn": (llama, "attention_decode_rope_store"),
           "norm": (linear, "fused_add_rmsnorm"), "silu": (linear, "silu_mul")}  # fmt: skip


@pytest.fixture
def restored(monkeypatch):
    """The stubs' targets and STUB come back after the test (apply rebinds module
    globals; --set sets STUB)."""
    monkeypatch.setattr(bench_stub, "STUB", "")
    for mod, name in TARGETS.values():
        monkeypatch.setattr(mod, name, getattr(mod, name))
    return monkeypatch


def _args(argv: list[str]):
    full = ["bench", "executor", "--device", "cpu", "--model", "tiny-llama", "--dtype",
            "float32", "--batch-sizes", "1", "--decode-steps", "3", "--prefill-len", "16",
            "--bs1-prompt-len", "8", "--repeats", "1", "--offline-requests", "1",
            "--offline-input-len", "8", "--offline-output-len", "2", *argv]  # fmt: skip
    return build_parser(full).parse_args(full)


def test_every_group_stubs_a_function_the_decode_step_calls(restored, tmp_path):
    restored.setattr(bench_stub, "STUB", " attn, norm,silu ")
    assert bench_stub.apply() == ["attn", "norm", "silu"]
    calls = Counter()
    for group, (mod, name) in TARGETS.items():
        stub = getattr(mod, name)

        def counted(*a, _stub=stub, _group=group, **k):
            calls[_group] += 1
            return _stub(*a, **k)

        restored.setattr(mod, name, counted)
    model_dir = bm.write_model_dir(tmp_path / "tiny", bm.TINY_LLAMA)
    core = build_core(ExecutorConfig(model_path=str(model_dir), load_format="dummy",
                                     device="cpu", dtype="float32", load_progress=False,
                                     max_total_tokens=512, context_length=128,
                                     max_num_rows=4))  # fmt: skip
    driver = Driver(core)
    rows, _ = driver.prefill(random_prompts(1, 8, core.vocab_size, seed=0), token_budget=64)
    calls.clear()
    driver.decode(rows)
    layers = core.runner.config.num_layers
    assert calls["attn"] == layers and calls["silu"] == layers
    assert calls["norm"] >= layers  # each layer's norm before qkv (and before gate/up)


def test_a_stubbed_run_completes_and_records_its_groups(restored, capsys):
    args = _args(["--skip-hf", "--set", "ops.bench_stub.STUB='norm,silu'"])
    assert bg.run(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["config"]["stubbed"] == ["norm", "silu"]
    assert summary["decode_tok_s_bs1"] > 0


@pytest.mark.parametrize(("argv", "says"), [
    (["--skip-hf", "--set", "ops.bench_stub.STUB='attn,rope'"], "unknown group(s) ['rope']"),
    (["--set", "ops.bench_stub.STUB='attn'"], "add --skip-hf"),
])  # fmt: skip
def test_bad_stubs_are_refused(restored, argv, says, capsys):
    assert bg.run(_args(argv)) == 2
    assert says in capsys.readouterr().err
