"""`shunter bench scheduler` runs end to end (small sizes) and reports its JSON line."""

from __future__ import annotations

import json

from shunter.ops.cli import main


def test_bench_scheduler_prints_a_json_summary_last(capsys):
    argv = ["bench", "scheduler", "--num-running", "32", "--steps", "20", "--warmup", "5",
            "--radix-requests", "100", "--page-size", "4"]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["num_running"] == 32
    assert 0 < summary["decode_step_us_32"] < 100_000
    assert summary["decode_step_us_32_with_codec"] > 0
    assert summary["radix_ops_per_s"] > 0 and 0 < summary["radix_hit_rate"] <= 1


def test_bench_scheduler_rejects_bad_sizes(capsys):
    assert main(["bench", "scheduler", "--num-running", "0"]) == 2
    assert "must be >= 1" in capsys.readouterr().err
