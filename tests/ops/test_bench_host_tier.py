"""`shunter bench host-tier` (ops/bench_host_tier.py) end to end on the CPU at the tiny
model's KV shape: every layout and path is timed, the module setting it changes is put
back, and bad arguments are refused."""

from __future__ import annotations

import json

from shunter.actors.executor import host_pool
from shunter.ops.cli import main


def test_every_layout_and_path_is_timed(capsys):
    rc = main(["bench", "host-tier", "--device", "cpu", "--model", "tiny-llama",
               "--tokens", "64", "--page-size", "4", "--repeats", "1",
               "--layouts", "runs,runs-3,scattered"])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    s = json.loads(out.strip().splitlines()[-1])
    # tiny-llama: 2 layers, 1 KV head of 64, float32 on the CPU; K and V
    assert (s["tokens"], s["page_size"], s["bytes"]) == (64, 4, 2 * 2 * 64 * 64 * 4)
    assert [(r["layout"], r["path"]) for r in s["copies"]] == [
        (layout, path) for layout in ("runs", "runs-3", "scattered")
        for path in ("sliced", "indexed")]  # fmt: skip
    for r in s["copies"]:
        assert r["spill_ms"] > 0 and r["load_ms"] > 0 and r["load_frac"] > 0
    assert s["plain_ms"]["to_host"] > 0 and "of plain" in out
    assert host_pool._MIN_RUN_BYTES == 64 << 10


def test_bad_arguments_are_refused(capsys):
    assert main(["bench", "host-tier", "--device", "cpu", "--layouts", "spiral"]) == 2
    assert "layouts ['spiral']: choose from runs, scattered" in capsys.readouterr().err
    assert main(["bench", "host-tier", "--device", "cpu", "--layouts", "runs-0"]) == 2
    assert "layouts ['runs-0']" in capsys.readouterr().err
    assert main(["bench", "host-tier", "--device", "cpu", "--tokens", "2", "--page-size", "4"]) == 2
    assert "--tokens >= --page-size" in capsys.readouterr().err


def test_runs_layout_covers_every_page_once():
    import torch

    from shunter.ops.bench_host_tier import _pages

    device, host = _pages("runs-4", 10, torch.Generator().manual_seed(0))
    assert sorted(host) == list(range(10)) and device == list(range(9, -1, -1))
    runs, i = [], 0
    while i < len(host):  # every run starts at a multiple of 4 and holds 4 pages (or the rest)
        assert host[i] % 4 == 0
        runs.append(tuple(host[i : i + min(4, 10 - host[i])]))
        i += len(runs[-1])
    assert sorted(runs) == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9)]
