"""The prefill timeline's idle accounting (ops/bench_profile.idle_gaps) on kernels laid
out by hand: overlapping kernels count once, gaps are named by their neighbours."""

from __future__ import annotations

import pytest

from shunter.ops.bench_profile import format_idle, idle_gaps


def test_idle_gaps_unions_overlaps_and_ranks_gaps():
    kernels = [(110.0, 150.0, "gemm"), (140.0, 160.0, "norm"),  # overlap: one busy stretch
               (200.0, 260.0, "attn"), (261.0, 300.0, "gemm2"), (170.0, 180.0, "rope")]  # fmt: skip
    got = idle_gaps(kernels, start=100.0, top=2)
    assert got["span_us"] == pytest.approx(200.0)
    assert got["busy_us"] == pytest.approx(50 + 10 + 60 + 39)
    assert got["head_us"] == pytest.approx(10.0)
    assert got["idle_us"] == pytest.approx(200.0 - 159.0)
    assert got["gap_count"] == 3 and got["gap_us"] == pytest.approx(10 + 20 + 1)
    assert got["gaps"] == [{"us": 20.0, "after": "rope", "before": "attn"},
                           {"us": 10.0, "after": "norm", "before": "rope"}]  # fmt: skip
    text = format_idle(got)
    assert "31 in 3 gaps" in text and "after rope before attn" in text


def test_idle_gaps_of_a_contained_kernel_and_of_none():
    got = idle_gaps([(0.0, 100.0, "long"), (10.0, 20.0, "inside"), (150.0, 160.0, "last")], 0.0)
    assert got["busy_us"] == pytest.approx(110.0)
    assert got["gaps"] == [{"us": 50.0, "after": "long", "before": "last"}]
    assert idle_gaps([], 5.0)["span_us"] == 0.0
    assert format_idle(idle_gaps([], 5.0)) == "no device kernels traced"
