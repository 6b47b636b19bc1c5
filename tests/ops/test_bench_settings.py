"""`--set MODULE.CONSTANT=VALUE` (ops/bench_settings.py): constants change before a run
and the summary records them; a wrong name, type or literal is refused before any
constant changes."""

from __future__ import annotations

import json

import pytest

from shunter.kernels import attention_decode_triton as adt
from shunter.kernels import linear
from shunter.ops import bench_gpu as bg
from shunter.ops import bench_settings
from shunter.ops.cli import build_parser


@pytest.fixture
def restore(monkeypatch):
    """Constants the tests change come back afterwards."""
    monkeypatch.setattr(linear, "SKINNY_MAX_ROWS", linear.SKINNY_MAX_ROWS)
    monkeypatch.setattr(linear, "FUSE_NORM", linear.FUSE_NORM)
    monkeypatch.setattr(adt, "MERGE_IN_SPLIT", adt.MERGE_IN_SPLIT)


def test_settings_apply_with_their_types(restore):
    got = bench_settings.apply(["kernels.linear.SKINNY_MAX_ROWS=4",
                                "kernels.attention_decode_triton.MERGE_IN_SPLIT = True"])  # fmt: skip
    assert got == {"kernels.linear.SKINNY_MAX_ROWS": 4,
                   "kernels.attention_decode_triton.MERGE_IN_SPLIT": True}  # fmt: skip
    assert linear.SKINNY_MAX_ROWS == 4 and adt.MERGE_IN_SPLIT is True


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("kernels.linear.SKINNY_MAX_ROWS", "expected"),
        ("SKINNY_MAX_ROWS=1", "expected"),
        ("kernels.linear.linear=1", "expected"),  # only UPPER_CASE constants
        ("kernels.nowhere.X=1", "no module"),
        ("kernels.linear.NOPE=1", "has no NOPE"),
        ("kernels.linear.SKINNY_MAX_ROWS=True", "of type int, got bool"),
        ("kernels.linear.FUSE_NORM=1", "of type bool, got int"),
        ("kernels.linear.SKINNY_MAX_ROWS=four", "not a Python literal"),
    ],
)
def test_bad_settings_change_nothing(restore, text, why):
    before = linear.FUSE_NORM
    with pytest.raises(ValueError, match=why):
        bench_settings.apply(["kernels.linear.FUSE_NORM=True", text])
    assert linear.FUSE_NORM is before  # the good one before it was not applied either


def test_the_bench_records_its_settings_and_refuses_bad_ones(restore, capsys):
    common = ["bench", "executor", "--device", "cpu", "--model", "tiny-llama", "--dtype",
              "float32", "--batch-sizes", "1", "--decode-steps", "2", "--prefill-len", "16",
              "--bs1-prompt-len", "8", "--repeats", "1", "--skip-hf", "--offline-requests",
              "1", "--offline-input-len", "8", "--offline-output-len", "2"]  # fmt: skip
    args = build_parser(common).parse_args([*common, "--set", "kernels.linear.FUSE_NORM=True"])
    assert bg.run(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["config"]["settings"] == {"kernels.linear.FUSE_NORM": True}
    args = build_parser(common).parse_args([*common, "--set", "kernels.linear.NOPE=1"])
    assert bg.run(args) == 2
    assert "has no NOPE" in capsys.readouterr().err
