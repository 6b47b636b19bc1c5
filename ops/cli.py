"""The `shunter` command: `serve`, `launch`, `bench <what>`.

Each subcommand lives in its own module and is imported only when asked for, so
`shunter --help` stays fast and a missing optional dependency of one subcommand does
not break the others.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). Each module exposes `add_arguments(parser)` and
# `run(args) -> int`.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("shunter.ops.serve", "start the server (all actors, one process or many)"),
}
BENCHMARKS: dict[str, tuple[str, str]] = {
    "bus": ("shunter.ops.bench_bus", "message codec and transport latency/throughput"),
    "executor": ("shunter.ops.bench_executor", "model forward speed, beside HF transformers"),
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shunter", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_) in SUBCOMMANDS.items():
        mod = _load(module)
        p = sub.add_parser(name, help=help_, description=help_, allow_abbrev=False)
        if mod is not None:
            mod.add_arguments(p)
        p.set_defaults(_module=module)
    bench = sub.add_parser("bench", help="benchmarks; each prints a JSON summary as its last line")
    bsub = bench.add_subparsers(dest="bench", required=True, metavar="WHAT")
    for name, (module, help_) in BENCHMARKS.items():
        p = bsub.add_parser(name, help=help_, description=help_, allow_abbrev=False)
        mod = _load(module)
        if mod is not None:
            mod.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    mod = _load(args._module)
    if mod is None:
        print(f"shunter: '{args._module}' is not available in this build", file=sys.stderr)
        return 2
    return int(mod.run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
