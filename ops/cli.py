"""The `shunter` command: `serve`, `launch`, `bench <what>`.

Each subcommand lives in its own module and is imported only when it is the one asked
for (`shunter serve ...` never imports the benchmarks, which pull in torch and HF), so
`--help` and argument errors answer at once and a missing optional dependency of one
subcommand does not break the others.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). Each module exposes `add_arguments(parser)` and
# `run(args) -> int`.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("shunter.ops.serve", "start the server (all actors, one process or many)"),
    "launch": ("shunter.ops.launch", "run one actor in this process (used by --multi-process)"),
}
BENCHMARKS: dict[str, tuple[str, str]] = {
    "ab": ("shunter.ops.bench_ab", "the executor bench for variants of module settings, as ratios"),
    "bus": ("shunter.ops.bench_bus", "message codec and transport latency/throughput"),
    "executor": ("shunter.ops.bench_executor", "model forward speed, beside HF transformers"),
    "gemv": ("shunter.ops.bench_gemv", "one-row GEMV tile configs at decode projection shapes"),
    "host-tier": ("shunter.ops.bench_host_tier", "the host KV tier's copies beside a plain copy"),
    "scheduler": ("shunter.ops.bench_scheduler", "scheduler and radix cache cores, no model"),
    "serve": ("shunter.ops.bench_serve", "online serving benchmark against any OpenAI URL"),
}


def _load(module: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == module:
            return None
        raise


def _chosen(argv: list[str]) -> str | None:
    """The module of the subcommand argv names, if any (before parsing: options of the
    top-level parser come first only as -h/--help)."""
    words = [a for a in argv if not a.startswith("-")]
    if not words:
        return None
    if words[0] in SUBCOMMANDS:
        return SUBCOMMANDS[words[0]][0]
    if words[0] == "bench" and len(words) > 1 and words[1] in BENCHMARKS:
        return BENCHMARKS[words[1]][0]
    return None


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole parser; only the subcommand named in argv gets its arguments (and its
    module imported). With argv None every subcommand is filled in (tests, docs)."""
    chosen = None if argv is None else _chosen(argv)
    parser = argparse.ArgumentParser(prog="shunter", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(subparsers, name: str, module: str, help_: str) -> None:
        p = subparsers.add_parser(name, help=help_, description=help_, allow_abbrev=False)
        if argv is None or module == chosen:
            mod = _load(module)
            if mod is not None:
                mod.add_arguments(p)
        p.set_defaults(_module=module)

    for name, (module, help_) in SUBCOMMANDS.items():
        add(sub, name, module, help_)
    bench = sub.add_parser("bench", help="benchmarks; each prints a JSON summary as its last line")
    bsub = bench.add_subparsers(dest="bench", required=True, metavar="WHAT")
    for name, (module, help_) in BENCHMARKS.items():
        add(bsub, name, module, help_)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    mod = _load(args._module)
    if mod is None:
        print(f"shunter: '{args._module}' is not available in this build", file=sys.stderr)
        return 2
    return int(mod.run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
