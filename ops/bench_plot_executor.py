"""PNG plot of `shunter bench executor --device cuda` summaries, one line per summary.

Two panels over the decode batch sizes a summary measured (`decode_tok_s_bs{N}` and
`decode_bs{N}_roofline_frac`): output tokens per second (log-log, so batch 1 and 256
share an axis) and the fraction of the bandwidth roofline each step reached, where
the gap to 1 is what a step loses to kernels that do not stream at copy bandwidth.
The title names the device and the prompt lengths of the first summary.

    python -m shunter.ops.bench_plot_executor OUT.png LABEL=SUMMARY.json [LABEL=SUMMARY.json ...]
"""

from __future__ import annotations

import json
import re
import sys

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter

_KEY = re.compile(r"decode_tok_s_bs(\d+)$")


def decode_points(summary: dict) -> list[tuple[int, float, float | None]]:
    """(batch size, tok/s, roofline fraction or None) of each decode batch measured,
    by batch size; ValueError when the summary measured none."""
    pts = []
    for key, tok_s in summary.items():
        m = _KEY.match(key)
        if m:
            bs = int(m.group(1))
            pts.append((bs, float(tok_s), summary.get(f"decode_bs{bs}_roofline_frac")))
    if not pts:
        raise ValueError("the summary holds no decode_tok_s_bs<N> figures")
    return sorted(pts)


def write_plot(runs: dict[str, dict], path: str) -> None:
    """Plot each labelled summary's decode figures into the PNG at `path`."""
    if not runs:
        raise ValueError("nothing to plot")
    fig, (ax_tok, ax_roof) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, summary in runs.items():
        pts = decode_points(summary)
        bs = [p[0] for p in pts]
        ax_tok.plot(bs, [p[1] for p in pts], marker="o", label=label)
        roof = [(b, p[2]) for b, p in zip(bs, pts, strict=True) if p[2] is not None]
        ax_roof.plot([b for b, _ in roof], [f * 100 for _, f in roof], marker="o", label=label)
    for ax in (ax_tok, ax_roof):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # 16, not 2^4
        ax.set_xlabel("decode batch size")
        ax.grid(True, which="both", alpha=0.3)
    ax_tok.set_yscale("log")
    ax_tok.set_ylabel("output tokens / s")
    ax_roof.set_ylabel("% of the bandwidth roofline")
    ax_roof.set_ylim(0, 100)
    ax_tok.legend()
    first = next(iter(runs.values()))
    cfg = first.get("config", {})
    fig.suptitle(f"bench executor, {cfg.get('device_name', '?')}, {cfg.get('model', '?')} "
                 f"({cfg.get('dtype', '?')})")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    if len(argv) < 2 or any("=" not in a for a in argv[1:]):
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    runs = {}
    for arg in argv[1:]:
        label, _, file = arg.partition("=")
        with open(file) as f:
            runs[label] = json.load(f)
    write_plot(runs, argv[0])
    print(argv[0])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
