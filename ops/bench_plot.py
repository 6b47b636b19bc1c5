"""PNG plot of one `shunter bench serve` run (matplotlib, Agg backend: no display needed).

Four panels: the CDFs of TTFT and ITL (log-scaled time axis, since tails span decades),
E2E latency of each request against the time it finished (failures marked on the axis
at their send time), and the number of requests in flight over time. A baseline run (HF transformers on the same
requests) is drawn beside the server's in the first three panels when given.
"""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import MaxNLocator

from shunter.ops.bench_metrics import RequestResult

COLORS = ("tab:blue", "tab:orange")


def _cdf(ax, values_ms: list[float], label: str, color: str) -> None:
    if not values_ms:
        return
    v = np.sort(np.asarray(values_ms))  # [num_values] ascending
    ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", label=label, color=color)
    for q, ls in ((50, "--"), (99, ":")):
        ax.axvline(np.percentile(v, q), color=color, ls=ls, lw=0.8)


def _in_flight(results: list[RequestResult]) -> tuple[np.ndarray, np.ndarray]:
    """(times, requests in flight from each time on), from sends and ends."""
    events = []
    for r in results:
        if r.success and not math.isnan(r.e2e_s):
            events += [(r.start_s, 1), (r.start_s + r.e2e_s, -1)]
    events.sort()
    times = np.array([0.0] + [t for t, _ in events])
    counts = np.cumsum([0] + [d for _, d in events])
    return times, counts


def write_plot(
    path: str, results: list[RequestResult], summary: dict, *, label: str = "server",
    baseline: list[RequestResult] | None = None, baseline_label: str = "HF transformers",
) -> None:  # fmt: skip
    """Draw the run (and the baseline, if any) into a PNG at `path`."""
    runs = [(label, results)] + ([(baseline_label, baseline)] if baseline else [])
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    (ax_ttft, ax_itl), (ax_e2e, ax_conc) = axes
    for (name, rs), color in zip(runs, COLORS):
        ok = [r for r in rs if r.success]
        _cdf(ax_ttft, [r.ttft_s * 1e3 for r in ok if not math.isnan(r.ttft_s)], name, color)
        _cdf(ax_itl, [x * 1e3 for r in ok for x in r.itl_s], name, color)
        ax_e2e.scatter([r.start_s + r.e2e_s for r in ok], [r.e2e_s * 1e3 for r in ok], s=10,
                       color=color, label=name, alpha=0.7)  # fmt: skip
        bad = [r.start_s for r in rs if not r.success]  # when they were sent
        if bad:
            ax_e2e.scatter(bad, [0.0] * len(bad), marker="x", color="tab:red",
                           label=f"{name}: failed ({len(bad)})")  # fmt: skip
    for ax, title in ((ax_ttft, "Time to first token"), (ax_itl, "Inter-token latency")):
        ax.set(title=f"{title} (CDF; dashed p50, dotted p99)", xlabel="ms",
               ylabel="fraction of requests" if ax is ax_ttft else "fraction of gaps")  # fmt: skip
        if ax.lines:
            ax.set_xscale("log")
            ax.legend(loc="lower right")
        ax.grid(True, which="both", alpha=0.3)
    ax_e2e.set(title="E2E latency by finish time (failures: x at send time)",
               xlabel="time since start (s)", ylabel="E2E (ms)")  # fmt: skip
    ax_e2e.grid(True, alpha=0.3)
    if ax_e2e.collections:
        ax_e2e.legend(loc="best")
    times, counts = _in_flight(results)
    ax_conc.step(times, counts, where="post", color=COLORS[0])
    ax_conc.set(title=f"{label}: requests in flight", xlabel="time (s)", ylabel="requests")
    ax_conc.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax_conc.grid(True, alpha=0.3)

    def fmt(key: str, unit: str) -> str:
        v = summary.get(key)
        return f"{v:.1f} {unit}" if isinstance(v, int | float) else "-"

    fig.suptitle(
        f"{summary.get('backend', label)} | {summary.get('dataset', '')} | "
        f"{summary.get('completed', 0)} ok, {summary.get('failed', 0)} failed | "
        f"out {fmt('output_token_throughput', 'tok/s')} | "
        f"TTFT p50 {fmt('median_ttft_ms', 'ms')} | ITL p50 {fmt('median_itl_ms', 'ms')}"
        + (
            f" | cache hits {summary['cache_hit_rate']:.0%}"
            if summary.get("cache_hit_rate")
            else ""
        )
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
