"""`shunter bench gemv`: the one-row GEMV's tile configs at decode projection shapes.

Theory of operation: for each shape [N, K] it makes --layers distinct weights (as many
as a model's layers, so that no weight is still in L2 when it is read again) and times
one launch per weight back to back: on CUDA as a captured graph replayed --reps times
(launch overheads as a decode step's graph sees them, PDL edges included), best of
three, over --passes interleaved passes whose median is reported; elsewhere eagerly
(the Triton interpreter in tests: the figures mean nothing there). Each config is a
kernels/linear_triton.py (BLOCK_N, BLOCK_K, num_warps); cuBLAS (`F.linear`) and the
default `gemv_config` run in the same passes; --evictions crosses every config with
the weight loads' L2 policies (kernels/linear_triton.WEIGHT_EVICTION; the first listed
is the default's). Prints, per shape, the fastest configs
with their bandwidth (weight bytes / time) and the default's and cuBLAS's, then a
JSON summary as the last line.

    shunter bench gemv [--shapes qkv=6144x4096,o=4096x4096,gate_up=28672x4096,down=4096x14336]
        [--layers 32]   (the logits: lm_head=128256x4096 --layers 4) [--evictions ,evict_first]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

LLAMA_8B_SHAPES = "qkv=6144x4096,o=4096x4096,gate_up=28672x4096,down=4096x14336"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", default=LLAMA_8B_SHAPES, help="NAME=NxK,... weight shapes")
    p.add_argument("--layers", type=int, default=32, help="distinct weights per shape")
    p.add_argument("--configs", default=None,
                   help="BNxBKxWARPS,... (default: a grid of 1-4 rows, 512-4096 wide)")  # fmt: skip
    p.add_argument("--evictions", default="",
                   help="weight-load L2 policies to sweep with every config, e.g. "
                        "',evict_first' ('' = none, the default)")  # fmt: skip
    p.add_argument("--passes", type=int, default=3, help="interleaved passes (median)")
    p.add_argument("--reps", type=int, default=20, help="replays per timing")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--top", type=int, default=8, help="configs printed per shape")
    p.add_argument("--seed", type=int, default=0)


def parse_shapes(text: str) -> dict[str, tuple[int, int]]:
    out = {}
    for part in text.split(","):
        name, _, dims = part.partition("=")
        n, _, k = dims.partition("x")
        if not (name and n.isdigit() and k.isdigit()) or int(n) < 1 or int(k) < 1:
            raise ValueError(f"shape {part!r} is not NAME=NxK")
        out[name] = (int(n), int(k))
    return out


def parse_configs(text: str) -> list[tuple[int, int, int]]:
    out = []
    for part in text.split(","):
        bits = part.split("x")
        if len(bits) != 3 or not all(b.isdigit() and int(b) > 0 for b in bits):
            raise ValueError(f"config {part!r} is not BLOCK_NxBLOCK_KxWARPS")
        out.append((int(bits[0]), int(bits[1]), int(bits[2])))
    return out


def parse_evictions(text: str) -> list[str]:
    out = [p.strip() for p in text.split(",")]
    for p in out:
        if p not in ("", "evict_first", "evict_last"):
            raise ValueError(f"eviction policy {p!r} is not '', evict_first or evict_last")
    return list(dict.fromkeys(out))


def _label(c: tuple) -> str:
    """'1x4096x4', or '1x4096x4/evict_first' for a config with a load policy."""
    (cfg, policy) = c
    return "x".join(map(str, cfg)) + (f"/{policy}" if policy else "")


def default_grid() -> list[tuple[int, int, int]]:
    """1-4 weight rows per program, 512-4096 columns per step, 2-8 warps, keeping each
    thread's share of a tile between 4 and 128 elements."""
    grid = itertools.product((1, 2, 4), (512, 1024, 2048, 4096), (2, 4, 8))
    return [c for c in grid if 4 <= c[0] * c[1] // (32 * c[2]) <= 128]


class _Timer:
    """Seconds per call of fn: a CUDA graph replayed under events, or eager wall time."""

    def __init__(self, device: torch.device, reps: int) -> None:
        self.cuda = device.type == "cuda"
        self.reps = reps
        # one side stream for every warm-up and capture, as the decode graphs do: cuBLAS
        # then takes its workspace for that stream in a warm-up, outside any graph's pool
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def prepare(self, fn):
        if not self.cuda:
            fn()  # compiles
            return fn
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            fn()  # compiles, and settles the allocator and cuBLAS's workspace
        self.stream.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=self.stream):
            fn()
        torch.cuda.current_stream().wait_stream(self.stream)
        return g.replay

    def time(self, run) -> float:
        if not self.cuda:
            t0 = time.perf_counter()
            for _ in range(self.reps):
                run()
            return (time.perf_counter() - t0) / self.reps
        run()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(3):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(self.reps):
                run()
            e.record()
            torch.cuda.synchronize()
            best = min(best, s.elapsed_time(e) / 1e3 / self.reps)
        return best


def _time_shape(args, lt, timer, name, n, k, grid, policies, gen, dev, dtype) -> dict:
    """Every config's (and cuBLAS's) times for one shape over the interleaved passes.
    The graphs are captured and dropped shape by shape: with several shapes' graphs
    alive at once, replaying the first shape's cuBLAS graph hit an illegal address on
    an H100 (torch 2.11), which one shape per sweep never did."""
    ws = [(torch.randn(n, k, generator=gen) * 0.02).to(dev, dtype) for _ in range(args.layers)]
    x = torch.randn(1, k, generator=gen).to(dev, dtype)
    runs = {(name, "cublas"): timer.prepare(lambda: [F.linear(x, w) for w in ws])}
    padded_k = max(16, 1 << (k - 1).bit_length())
    configs = dict.fromkeys([c for c in grid if c[1] <= padded_k] + [lt.gemv_config(n, k)])
    for c, p in itertools.product(configs, policies):
        runs[(name, (c, p))] = timer.prepare(
            lambda c=c, p=p: [lt.linear_gemv_triton(x, w, config=c, eviction=p) for w in ws]
        )
    times: dict[tuple[str, object], list[float]] = {key: [] for key in runs}
    for _ in range(args.passes):
        for key, run in runs.items():
            times[key].append(timer.time(run))
    if timer.cuda:
        torch.cuda.synchronize()
    return times


def sweep(args: argparse.Namespace) -> dict:
    from shunter.kernels import linear_triton as lt

    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    shapes = parse_shapes(args.shapes)
    grid = parse_configs(args.configs) if args.configs else default_grid()
    policies = parse_evictions(args.evictions)
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    timer = _Timer(dev, args.reps)
    times: dict[tuple[str, object], list[float]] = {}
    for name, (n, k) in shapes.items():  # one shape's graphs at a time (see _time_shape)
        times.update(_time_shape(args, lt, timer, name, n, k, grid, policies, gen, dev, dtype))
    summary: dict = {"device": str(dev), "layers": args.layers, "shapes": {}}
    for name, (n, k) in shapes.items():
        nbytes = n * k * torch.empty(0, dtype=dtype).element_size() * args.layers
        med = {c: statistics.median(v) for (s, c), v in times.items() if s == name}
        ranked = sorted((t, c) for c, t in med.items() if c != "cublas")
        default = (lt.gemv_config(n, k), policies[0])
        print(f"{name} [{n} x {k}], {args.layers} weights, us per pass (GB/s):")
        for t, c in ranked[: args.top]:
            mark = "  <- default" if c == default else ""
            print(f"  {_label(c):>10s} {t * 1e6:9.1f} ({nbytes / t / 1e9:6.0f}){mark}")
        for label, t in (("default", med[default]), ("cublas", med["cublas"])):
            print(f"  {label:>10s} {t * 1e6:9.1f} ({nbytes / t / 1e9:6.0f})")
        best_t, (best_c, best_p) = ranked[0]
        summary["shapes"][name] = {
            "n": n, "k": k, "best": list(best_c), "best_eviction": best_p,
            "best_us": best_t * 1e6, "default": list(default[0]), "default_us": med[default] * 1e6,
            "cublas_us": med["cublas"] * 1e6, "best_gbs": nbytes / best_t / 1e9,
            "default_over_best": med[default] / best_t,
        }  # fmt: skip
    return summary


def run(args: argparse.Namespace) -> int:
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("bench gemv: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    try:
        summary = sweep(args)
    except ValueError as e:
        print(f"bench gemv: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    sys.exit(run(p.parse_args()))
