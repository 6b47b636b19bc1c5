"""`shunter bench ab`: the executor bench run for several variants of module settings
or of the code itself, alternating, with each figure's ratio to the first variant.

Theory of operation: a variant is a name, optionally the code it runs, and zero or
more `--set` settings (ops/bench_settings.py), e.g.
`fused=kernels.attention_decode.FUSE_ROPE_STORE=True`; settings of one variant are
separated by ';'. `NAME@SOURCE=...` runs other code: SOURCE is a directory holding a
`shunter` package (say `git archive --prefix=shunter/ REV | tar -x -C DIR`, for a
machine without the repository), or else a revision of the git checkout this shunter
was imported from, archived into a temporary directory; the variant's process finds
that package first on PYTHONPATH. Every round runs each variant once as
its own `shunter bench executor` process with the arguments after `--` (so module
state never leaks between variants), in an order rotated by one each round, so no
variant always runs first on a cooling or warming device. The figures compared are
the summary's decode rates, prefill rate, MFU and host time, and the offline rate
(or those named by --metric); each variant's value is the median over its rounds,
and the table gives it beside the first variant's as a ratio (each run's figures are
printed as it ends, so a comparison cut short still shows them). A variant whose
process fails is reported with its exit status and stderr tail, and the command
fails. The JSON summary (per variant, per metric: every round's value and the
median; the ratios) is the last stdout line.

    shunter bench ab --variant base= \\
        --variant fused='kernels.attention_decode.FUSE_ROPE_STORE=True' \\
        --rounds 2 -- --device cuda --batch-sizes 1 --skip-hf --prefill-len 512
    shunter bench ab --variant new= --variant old@HEAD~3= -- --device cuda ...
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

DEFAULT_METRICS = re.compile(
    r"decode_tok_s_bs\d+|prefill_tok_s|prefill_mfu|prefill_host_ms|offline_output_tok_s"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--variant", action="append", default=[],
                   metavar="NAME[@SOURCE]=[SETTING;...]",
                   help="a variant (repeatable; the first is the baseline)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=2, help="runs of every variant")
    p.add_argument("--metric", action="append", default=[],
                   help="summary keys to compare (default: rates, MFU, host time)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=1800, help="seconds per bench process")
    p.add_argument("bench_args", nargs=argparse.REMAINDER,
                   help="-- then the arguments of `shunter bench executor`")  # fmt: skip


def parse_variant(text: str) -> tuple[str, str | None, list[str]]:
    """(name, source or None, settings) of NAME[@SOURCE]=[SETTING;...]."""
    head, eq, rest = text.partition("=")
    name, at, source = (x.strip() for x in head.partition("@"))
    if not eq or not name or (at and not source):
        raise ValueError(f"--variant {text!r}: expected NAME[@SOURCE]=[SETTING;...]")
    return name, source or None, [s.strip() for s in rest.split(";") if s.strip()]


def source_root(source: str, tmp: Path) -> Path:
    """The directory to put first on PYTHONPATH for `source` (see the module docstring);
    ValueError when it is neither such a directory nor a revision of this checkout."""
    given = Path(source)
    if given.is_dir():
        if not (given / "shunter" / "__init__.py").is_file():
            raise ValueError(f"{source}: no shunter/__init__.py under it")
        return given.resolve()
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run(["git", "-C", str(repo), "archive", "--prefix=shunter/", source],
                          capture_output=True)  # fmt: skip
    if proc.returncode != 0:
        why = proc.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["git failed"]
        raise ValueError(f"{source}: not a directory, nor a revision of {repo} ({why[0]})")
    root = Path(tempfile.mkdtemp(prefix="src-", dir=tmp))
    with tarfile.open(fileobj=io.BytesIO(proc.stdout)) as tar:
        tar.extractall(root, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    return root


def _env(root: Path | None) -> dict[str, str] | None:
    if root is None:
        return None
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    return env


def _command(bench_args: list[str], settings: list[str], out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "shunter.ops.cli", "bench", "executor", *bench_args]
    for s in settings:
        cmd += ["--set", s]
    return [*cmd, "--out", str(out)]


def _metrics(summary: dict, wanted: list[str]) -> dict[str, float]:
    keys = wanted or [k for k in summary if DEFAULT_METRICS.fullmatch(k)]
    return {k: float(summary[k]) for k in keys if isinstance(summary.get(k), (int, float))}


def run(args: argparse.Namespace) -> int:
    bench_args = list(args.bench_args)
    if bench_args[:1] == ["--"]:
        bench_args = bench_args[1:]
    try:
        variants = [parse_variant(v) for v in args.variant]
    except ValueError as e:
        print(f"bench ab: {e}", file=sys.stderr)
        return 2
    names = [n for n, _, _ in variants]
    if len(variants) < 2 or len(set(names)) != len(names) or args.rounds < 1:
        print("bench ab: give at least two variants, named apart, and --rounds >= 1",
              file=sys.stderr)  # fmt: skip
        return 2
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            roots = {n: source_root(src, Path(tmp)) if src else None for n, src, _ in variants}
        except ValueError as e:
            print(f"bench ab: {e}", file=sys.stderr)
            return 2
        for r in range(args.rounds):
            for i in range(len(variants)):
                name, source, settings = variants[(i + r) % len(variants)]
                out = Path(tmp) / f"{name}-{r}.json"
                code = f"@{source} " if source else ""
                print(f"round {r + 1}/{args.rounds}: {name} {code}{' '.join(settings)}",
                      flush=True)  # fmt: skip
                proc = subprocess.run(_command(bench_args, settings, out), capture_output=True,
                                      text=True, timeout=args.timeout, env=_env(roots[name]))  # fmt: skip
                if proc.returncode != 0 or not out.exists():
                    print(f"bench ab: variant {name} exited {proc.returncode}:\n"
                          f"{proc.stderr[-2000:]}", file=sys.stderr)  # fmt: skip
                    return 1
                runs[name].append(got := _metrics(json.loads(out.read_text()), args.metric))
                print("  " + ", ".join(f"{k} {v:.4g}" for k, v in got.items()), flush=True)
    base = names[0]
    keys = [k for k in runs[base][0] if all(k in m for n in names for m in runs[n])]
    med = {n: {k: statistics.median(m[k] for m in runs[n]) for k in keys} for n in names}
    ratios = {n: {k: (med[n][k] / med[base][k] if med[base][k] else None) for k in keys}
              for n in names[1:]}  # fmt: skip
    width = max(len(k) for k in keys) if keys else 10
    print(f"{'median of ' + str(args.rounds):<{width}}  " + "  ".join(f"{n:>16}" for n in names))
    for k in keys:
        cells = [f"{med[base][k]:16.4g}"]
        for n in names[1:]:
            ratio = ratios[n][k]
            cells.append(f"{med[n][k]:9.4g} {ratio:5.3f}x" if ratio is not None
                         else f"{med[n][k]:16.4g}")  # fmt: skip
        print(f"{k:<{width}}  " + "  ".join(cells))
    summary = {"baseline": base, "rounds": args.rounds,
               "variants": {n: settings for n, _, settings in variants},
               "sources": {n: src for n, src, _ in variants if src},
               "values": {n: {k: [m[k] for m in runs[n]] for k in keys} for n in names},
               "median": med, "ratio": ratios}  # fmt: skip
    print(json.dumps(summary))
    return 0
