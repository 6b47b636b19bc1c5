"""`shunter bench host-tier` (ops/bench_host_tier.py) end to end on the CPU at the tiny
model's KV shape: every layout and path is timed, the module setting it changes is put
back, and bad arguments are refused."""

from __future__ import annotations

import itertools
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


def test_runs_layouts_keep_their_runs_apart():
    import torch

    from shunter.ops.bench_host_tier import _pages

    device, host = _pages("runs-4", 10, torch.Generator().manual_seed(0))
    assert len(set(host)) == 10 and device == list(range(9, -1, -1))
    assert all(p < 20 for p in host)  # a host pool of twice the pages
    runs, i = [], 0
    while i < len(host):  # runs of 4 (the last maybe fewer) starting at multiples of 8
        assert host[i] % 8 == 0
        n = 1
        while i + n < len(host) and host[i + n] == host[i] + n:
            n += 1
        runs.append(n)
        i += n
    assert sorted(runs) == [2, 4, 4]
    s = sorted(host)  # sorted, as a copy does: still apart
    assert sum(1 for a, b in itertools.pairwise(s) if b != a + 1) == 2
    _, scattered = _pages("scattered", 10, torch.Generator().manual_seed(0))
    assert len(set(scattered)) == 10 and max(scattered) < 20
