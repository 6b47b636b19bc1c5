"""`shunter bench gemv` (ops/bench_gemv.py) end to end on the CPU, its kernels under the
Triton interpreter at tiny shapes: the summary names every shape with the fastest
config, the default one (kernels/linear_triton.gemv_config) and cuBLAS's slot."""

from __future__ import annotations

import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shunter.kernels.linear_triton import gemv_config
from shunter.ops import bench_gemv
from shunter.ops.cli import main


def test_sweep_reports_every_shape(capsys):
    rc = main(["bench", "gemv", "--device", "cpu", "--dtype", "float32", "--layers", "2",
               "--shapes", "a=8x64,b=3x200", "--configs", "1x64x1,2x32x1",
               "--passes", "1", "--reps", "1"])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    assert set(summary["shapes"]) == {"a", "b"}
    for name, (n, k) in {"a": (8, 64), "b": (3, 200)}.items():
        got = summary["shapes"][name]
        assert (got["n"], got["k"]) == (n, k)
        assert got["default"] == list(gemv_config(n, k))
        assert got["best"] in ([1, 64, 1], [2, 32, 1], got["default"])
        assert got["best_us"] <= got["default_us"] and got["cublas_us"] > 0
        assert got["best_eviction"] == ""
    assert "a [8 x 64]" in out and "default" in out


def test_sweep_crosses_configs_with_load_policies(capsys):
    """--evictions runs every config under each weight-load policy; the first policy
    is the default's, and each policy's config is printed with it."""
    rc = main(["bench", "gemv", "--device", "cpu", "--dtype", "float32", "--layers", "1",
               "--shapes", "a=8x64", "--configs", "1x64x1", "--evictions", ",evict_first",
               "--passes", "1", "--reps", "1", "--top", "8"])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    got = json.loads(out.strip().splitlines()[-1])["shapes"]["a"]
    assert got["best_eviction"] in ("", "evict_first")
    # two configs (the listed one and the default) under two policies
    assert sum(" (" in ln and ln.lstrip()[0].isdigit() for ln in out.splitlines()) == 4
    assert "1x64x1/evict_first" in out


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--shapes", "a=8by64"),
        ("--shapes", "a=0x64"),
        ("--configs", "1x64"),
        ("--evictions", "evict_sometimes"),
    ],
)
def test_bad_arguments_are_refused(flag, value, capsys):
    assert main(["bench", "gemv", "--device", "cpu", flag, value]) == 2
    assert "bench gemv:" in capsys.readouterr().err


def test_default_grid_keeps_each_threads_share_in_bounds():
    for bn, bk, warps in bench_gemv.default_grid():
        assert 4 <= bn * bk // (32 * warps) <= 128
