"""`shunter bench ab` (ops/bench_ab.py) end to end on the CPU: two variants of the
executor bench at toy sizes, each round a real `shunter bench executor` process, and
the table and summary that compare them; variants that run other code (a package
directory, a git revision); bad variants are refused up front."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from shunter.ops.bench_ab import parse_variant, source_root
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
    per_run = [ln for ln in lines if ln.startswith("  ") and "decode_tok_s_bs1 " in ln]
    assert len(per_run) == 4  # each run's figures as it ends


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
    assert parse_variant("x=a.B=1; c.D=(1, 2)") == ("x", None, ["a.B=1", "c.D=(1, 2)"])
    assert parse_variant("base=") == ("base", None, [])
    assert parse_variant("old@HEAD~2=a.B=1") == ("old", "HEAD~2", ["a.B=1"])
    with pytest.raises(ValueError):
        parse_variant("old@=a.B=1")


REPO = Path(__file__).resolve().parents[2]


def _in_git() -> bool:
    probe = ["git", "-C", str(REPO), "rev-parse", "--verify", "HEAD^{commit}"]
    return subprocess.run(probe, capture_output=True).returncode == 0


@pytest.mark.skipif(not _in_git(), reason="needs the git checkout")
def test_a_variant_runs_the_code_of_its_source(tmp_path, capsys):
    """A package directory whose kernels/linear.py has a constant the checkout lacks:
    the setting fails against the checkout's code and works against that directory's,
    so the variant's process ran the directory's code; a revision archives the same."""
    root = source_root("HEAD", tmp_path)
    linear = root / "shunter" / "kernels" / "linear.py"
    assert linear.is_file()
    linear.write_text(linear.read_text() + "\nPROBE_ONLY_HERE = 1\n")
    probe = "kernels.linear.PROBE_ONLY_HERE=2"
    rc = main(["bench", "ab", "--variant", "head@HEAD=", "--variant", f"probe@{root}={probe}",
               "--rounds", "1", "--", *TOY])  # fmt: skip
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["sources"] == {"head": "HEAD", "probe": str(root)}
    assert summary["ratio"]["probe"]["decode_tok_s_bs1"] > 0
    rc = main(["bench", "ab", "--variant", "base=", "--variant", f"probe={probe}",
               "--rounds", "1", "--", *TOY])  # fmt: skip
    assert rc == 1 and "variant probe exited 2" in capsys.readouterr().err


@pytest.mark.parametrize("source", ["no-such-revision-or-dir", "."])
def test_a_bad_source_is_refused(source, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # "." is then a directory without a shunter package
    argv = ["bench", "ab", "--variant", "base=", "--variant", f"x@{source}=", "--", *TOY]
    assert main(argv) == 2
    assert "bench ab:" in capsys.readouterr().err
