"""The `shunter` command line: subcommands listed, and only the chosen one imported."""

from __future__ import annotations

import subprocess
import sys

from shunter.ops.cli import BENCHMARKS, SUBCOMMANDS, build_parser


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shunter", *argv], capture_output=True, text=True, timeout=60
    )


def test_help_lists_every_subcommand_and_benchmark():
    top = _run("--help")
    assert top.returncode == 0
    for name in [*SUBCOMMANDS, "bench"]:
        assert name in top.stdout
    bench = _run("bench", "--help")
    assert bench.returncode == 0
    for name in BENCHMARKS:
        assert name in bench.stdout


def test_full_parser_knows_every_subcommands_arguments():
    parser = build_parser()
    assert parser.parse_args(["serve", "--tp", "1"]).tp_size == 1
    assert parser.parse_args(["bench", "scheduler"])._module == BENCHMARKS["scheduler"][0]


def test_serve_argument_errors_do_not_import_the_benchmarks():
    code = (
        "import sys\n"
        "from shunter.ops.cli import main\n"
        "print('exit', main(['serve', '--tp-size', '2']))\n"
        "print('torch' in sys.modules, 'transformers' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "tensor parallelism is not supported" in out.stderr
    assert out.stdout.split() == ["exit", "2", "False", "False"]
