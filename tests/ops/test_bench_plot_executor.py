"""The bench executor plot: the decode figures it reads from a summary, a real PNG from
two summaries through the command line, and refusals of summaries with nothing to draw."""

from __future__ import annotations

import json

import pytest

from shunter.ops.bench_plot_executor import decode_points, main, write_plot

GREEDY = {"config": {"device_name": "H200", "model": "llama-3.1-8b", "dtype": "bfloat16"},
          "decode_tok_s_bs64": 9098.9, "decode_bs64_roofline_frac": 0.79,
          "decode_tok_s_bs1": 224.7, "decode_bs1_roofline_frac": 0.791,
          "decode_tok_s_bs1_no_overlap": 225.1, "decode_tok_s_bs16": 2947.4}  # fmt: skip


def test_points_are_by_batch_size_with_their_roofline_fraction():
    assert decode_points(GREEDY) == [(1, 224.7, 0.791), (16, 2947.4, None), (64, 9098.9, 0.79)]
    with pytest.raises(ValueError, match="no decode_tok_s_bs"):
        decode_points({"prefill_tok_s": 1.0})


def test_command_line_writes_a_png_of_two_summaries(tmp_path, capsys):
    top_p = {**GREEDY, "decode_tok_s_bs64": 7771.4, "decode_bs64_roofline_frac": 0.675}
    files = []
    for name, summary in (("greedy", GREEDY), ("top-p", top_p)):
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(json.dumps(summary))
    out = tmp_path / "decode.png"
    assert main([str(out), f"greedy={files[0]}", f"top-p={files[1]}"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert capsys.readouterr().out.strip() == str(out)
    assert main([str(out), str(files[0])]) == 2  # no LABEL=
    with pytest.raises(ValueError, match="nothing to plot"):
        write_plot({}, str(out))
