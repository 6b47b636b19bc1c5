"""`shunter bench ab` (ops/bench_ab.py) end to end on the CPU: two variants of the
executor bench at toy sizes, each round a real `shunter bench executor` process, and
the table and summary that compare them; bad variants are refused up front."""

from __future__ import annotations

import json

import pytest

from shunter.ops.bench_ab import parse_variant
from shunter.ops.cli import main

TOY = ["--device", "cpu", "--batch-sizes", "1", "--decode-steps", "2", "--prefill-len", "16",
       "--decode-prompt-len", "8", "--repeats", "1", "--skip-hf"]  # fmt: skip


def test_two_variants_alternate_and_compare(capsys):
    rc = main(["bench", "ab", "--variant", "base=", "--variant",
               "fused=kernels.attention_decode.FUSE_ROPE_STORE=True;kernels.linear.GEMV_MAX_N=1",
               "--rounds", "2", "--", *TOY])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert [ln.split(":")[1].split()[0] for ln in lines if ln.startswith("round")] == [
        "base",
        "fused",
        "fused",
        "base",
    ]  # rotated each round
    summary = json.loads(lines[-1])
    assert summary["baseline"] == "base" and summary["variants"]["base"] == []
    assert len(summary["variants"]["fused"]) == 2
    for key in ("decode_tok_s_bs1", "prefill_tok_s"):
        assert len(summary["values"]["fused"][key]) == 2
        assert summary["ratio"]["fused"][key] > 0
        assert key in out  # a table row


def test_a_failing_variant_fails_the_command(capsys):
    rc = main(["bench", "ab", "--variant", "base=", "--variant", "bad=kernels.linear.NOPE=1",
               "--rounds", "1", "--", *TOY])  # fmt: skip
    assert rc == 1
    assert "variant bad exited 2" in capsys.readouterr().err


@pytest.mark.parametrize("variants", [["base="], ["a=", "a="], ["=x", "b="], ["noequals", "b="]])
def test_bad_variant_lists_are_refused(variants, capsys):
    argv = ["bench", "ab"] + [a for v in variants for a in ("--variant", v)] + ["--", *TOY]
    assert main(argv) == 2
    assert "bench ab:" in capsys.readouterr().err


def test_parse_variant_splits_settings():
    assert parse_variant("x=a.B=1; c.D=(1, 2)") == ("x", ["a.B=1", "c.D=(1, 2)"])
    assert parse_variant("base=") == ("base", [])
