"""`shunter bench host-tier`: the host KV tier's copies (actors/executor/host_pool.py)
at a model's KV shape, beside a plain copy of the same bytes.

Theory of operation: it builds a device KV pool and a host pool for --model's layers,
KV heads and head size (bf16 on CUDA), then times --tokens tokens' worth of pages
spilled to the host and loaded back, for each host page layout in --layouts and each
copy path in --paths:

    runs        the host pages one ascending run (a pool handed out in order), the
                device pages descending (the device allocator reuses the most recently
                freed page first)
    runs-N      the host pages in runs of N with a gap of N after each (the host pool
                is twice the copy, so runs stay apart once a copy sorts its pages), the
                runs in random order; device as above
    scattered   half the host pool's pages at random, the device pages in random order
    sliced      host_pool._MIN_RUN_BYTES = 0: every run of host pages a slice per layer
    indexed     _MIN_RUN_BYTES = huge: every chunk gathered or scattered on the host

On CUDA each copy is timed from a synchronized start to its end on the stream (a load
returns before it has run); the best of --repeats is reported as milliseconds and
GB/s (K and V, every layer), and as a ratio to the plain copy: one contiguous block of
the same bytes between a pinned host tensor and the device, each way, timed the same
way, which is what the PCIe link gives. The last line is a JSON summary.

    shunter bench host-tier [--model llama-3.1-8b] [--tokens 8192] [--page-size 1]
        [--layouts runs,runs-32,scattered] [--paths sliced,indexed] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

LAYOUTS = ("runs", "scattered")
PATHS = {"sliced": 0, "indexed": 1 << 60}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from shunter.ops.bench_gpu_model import MODELS

    p.add_argument("--model", default="llama-3.1-8b", choices=sorted(MODELS))
    p.add_argument("--tokens", type=int, default=8192, help="tokens copied each way")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"of {', '.join(LAYOUTS)}")
    p.add_argument("--paths", default=",".join(PATHS), help=f"of {', '.join(PATHS)}")
    p.add_argument("--repeats", type=int, default=5, help="copies timed (best is reported)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)


def _names(text: str, allowed, what: str) -> list[str]:
    out = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in out if t not in allowed and not (what == "layouts" and _run_length(t))]
    if bad or not out:
        raise ValueError(f"{what} {bad or text!r}: choose from {', '.join(allowed)}")
    return out


def _run_length(layout: str) -> int:
    """N of a "runs-N" layout (N >= 1), else 0."""
    n = layout.removeprefix("runs-")
    return int(n) if n != layout and n.isdigit() and int(n) > 0 else 0


def _pages(layout: str, num_pages: int, g: torch.Generator) -> tuple[list[int], list[int]]:
    """(device pages, host pages) of one copy, pair by pair."""
    if layout == "runs":
        return list(range(num_pages - 1, -1, -1)), list(range(num_pages))
    if n := _run_length(layout):
        starts = torch.randperm((num_pages + n - 1) // n, generator=g).tolist()
        host = [p for r in starts for p in range(2 * r * n, 2 * r * n + n)][:num_pages]
        return list(range(num_pages - 1, -1, -1)), host
    return (torch.randperm(num_pages, generator=g).tolist(),
            torch.randperm(2 * num_pages, generator=g)[:num_pages].tolist())  # fmt: skip


def _best_ms(fn, device: torch.device, repeats: int) -> float:
    """Best of `repeats` timings of fn() (after one untimed call), in ms, to the end of
    its work on the current stream."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda *_: None)
    fn()
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, (time.perf_counter() - t0) * 1e3)
    return best


def measure(args: argparse.Namespace) -> dict:
    from shunter.actors.executor import host_pool as hp
    from shunter.actors.executor.kv_pool import KVPool
    from shunter.actors.executor.models.config import from_hf_dict
    from shunter.ops.bench_gpu_model import MODELS

    layouts = _names(args.layouts, LAYOUTS, "layouts")
    paths = _names(args.paths, PATHS, "paths")
    if args.tokens < args.page_size or args.page_size < 1 or args.repeats < 1:
        raise ValueError("need --page-size >= 1, --tokens >= --page-size, --repeats >= 1")
    device = torch.device(args.device)
    cfg = from_hf_dict(MODELS[args.model])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    num_pages = args.tokens // args.page_size
    pool = KVPool(cfg, num_pages, page_size=args.page_size, dtype=dtype, device=device)
    longest = max((_run_length(x) for x in layouts), default=0)
    host = hp.HostKVPool(2 * (num_pages + longest), like=pool)  # room for runs-N's gaps
    nbytes = pool.k_all.nbytes + pool.v_all.nbytes  # every page moves once per copy
    g = torch.Generator().manual_seed(args.seed)

    plain = _plain_ms(nbytes, device, args.repeats)
    rows, saved = [], hp._MIN_RUN_BYTES
    try:
        for layout in layouts:
            dev_pages, host_pages = _pages(layout, num_pages, g)
            for path in paths:
                hp._MIN_RUN_BYTES = PATHS[path]
                spill = _best_ms(lambda d=dev_pages, h=host_pages: host.spill(pool, d, h),
                                 device, args.repeats)  # fmt: skip
                load = _best_ms(lambda d=dev_pages, h=host_pages: host.load(pool, h, d),
                                device, args.repeats)  # fmt: skip
                rows.append({"layout": layout, "path": path, "spill_ms": spill, "load_ms": load,
                             "spill_frac": plain["to_host"] / spill,
                             "load_frac": plain["to_device"] / load})  # fmt: skip
    finally:
        hp._MIN_RUN_BYTES = saved
    return {"model": args.model, "device": str(device), "device_name": _device_name(device),
            "tokens": num_pages * args.page_size, "page_size": args.page_size,
            "bytes": nbytes, "pinned": host.pinned, "plain_ms": plain, "copies": rows}  # fmt: skip


def _plain_ms(nbytes: int, device: torch.device, repeats: int) -> dict[str, float]:
    """ms of one contiguous copy of `nbytes` each way between pinned host memory (on
    CUDA) and `device`."""
    on_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return {"to_host": _best_ms(lambda: on_host.copy_(on_device, non_blocking=True), device,
                                repeats),
            "to_device": _best_ms(lambda: on_device.copy_(on_host, non_blocking=True), device,
                                  repeats)}  # fmt: skip


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _gbs(nbytes: int, ms: float) -> str:
    return f"{nbytes / ms / 1e6:,.1f} GB/s"


def run(args: argparse.Namespace) -> int:
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench host-tier: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    try:
        s = measure(args)
    except ValueError as e:
        print(f"bench host-tier: {e}", file=sys.stderr)
        return 2
    n = s["bytes"]
    print(f"{s['device_name']}, {s['model']}, {s['tokens']} tokens ({n / 1e9:.2f} GB of K and "
          f"V), page size {s['page_size']}, host pool pinned: {s['pinned']}")  # fmt: skip
    print(f"plain copy: to host {s['plain_ms']['to_host']:.2f} ms "
          f"({_gbs(n, s['plain_ms']['to_host'])}), to device {s['plain_ms']['to_device']:.2f} "
          f"ms ({_gbs(n, s['plain_ms']['to_device'])})")  # fmt: skip
    for r in s["copies"]:
        print(f"{r['layout']:>9} {r['path']:>7}: spill {r['spill_ms']:8.2f} ms "
              f"({_gbs(n, r['spill_ms'])}, {r['spill_frac']:.2f} of plain)  load "
              f"{r['load_ms']:8.2f} ms ({_gbs(n, r['load_ms'])}, {r['load_frac']:.2f} of plain)")  # fmt: skip
    print(json.dumps(s))
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    sys.exit(run(p.parse_args()))
