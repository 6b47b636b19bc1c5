"""Extend steps of `shunter bench executor --extend P+N,...`: one step of N new tokens on
a row whose first P tokens are already in the KV pool, as the first step of a request
whose prompt hit the prefix cache for P tokens (P = 0 is a plain prefill of N).

Theory of operation: per shape, each run closes every row, computes P random tokens on
a new row (untimed, then synchronized), and times one step of N random tokens on that
row to a synchronized device (the core reads the sampled token back, so the step's
wall time is real). The first run warms up and is not counted. Reported: the median
and best ms, the host ms from the best run's start to the model's first launch, and
the step's floor on a GPU: the larger of the bytes it must read (every weight once,
the P + N tokens' keys and values) over the measured copy bandwidth, and its FLOPs
(the dense layers for N tokens, attention of N queries over P + N keys) over the
measured matmul rate. Under --kernel-profile-bs extend each shape also gets one
profiled step (device time per kernel and the step's idle gaps) and, under
--prefill-host-profile, the host's functions before the model (ops/bench_profile.py).

Invariants: leaves the driver with no open rows; the sampled tokens are not checked.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from tqdm import tqdm

from shunter.actors.executor.models.config import ModelConfig
from shunter.ops.bench_gpu_driver import Driver, random_prompts, sync
from shunter.ops.bench_gpu_model import decode_step_bytes, prefill_flops
from shunter.ops.bench_profile import prepare_step


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'2048+32,0+32' -> [(2048, 32), (0, 32)]: (cached prefix, new tokens) pairs."""
    shapes = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        prefix, plus, new = part.partition("+")
        if not plus or not prefix.isdigit() or not new.isdigit() or int(new) < 1:
            raise ValueError(f"--extend wants PREFIX+NEW pairs with NEW >= 1, got {part!r}")
        shapes.append((int(prefix), int(new)))
    return shapes


def time_extend(driver: Driver, prefix: list[int], new: list[int], repeats: int) -> dict:
    """{runs_ms: every timed run in order, median_ms, best_ms, host_ms: the best run's
    host time before the model's first launch, None when the model was not entered
    (a step replayed from piecewise graphs)}."""
    runs, host, entered = [], {}, [None]

    def mark(_module, _args) -> None:
        entered[0] = time.perf_counter()

    hook = driver.core.runner.model.register_forward_pre_hook(mark)
    try:
        for i in tqdm(range(repeats + 1), desc=f"extend {len(prefix)}+{len(new)}", unit="run",
                      file=sys.stderr, leave=False):  # fmt: skip
            step = prepare_step(driver, new, prefix)
            entered[0] = None
            t0 = time.perf_counter()
            step()
            sync(driver)
            ms = (time.perf_counter() - t0) * 1e3
            if i:  # the first run warms up
                runs.append(ms)
                host[ms] = None if entered[0] is None else (entered[0] - t0) * 1e3
    finally:
        hook.remove()
        driver.close_all()
    best = min(runs)
    return {"runs_ms": [round(r, 3) for r in runs], "median_ms": statistics.median(runs),
            "best_ms": best, "host_ms": host[best]}  # fmt: skip


def floor_ms(c: ModelConfig, prefix: int, new: int, dtype_bytes: int, s: dict) -> float | None:
    """The step's lower bound from the measured ceilings in `s` (None without them)."""
    if not s.get("copy_gbs") or not s.get("matmul_tflops"):
        return None
    nbytes = decode_step_bytes(c, [prefix + new], dtype_bytes)
    flops = prefill_flops(c, new) + 4.0 * c.num_layers * c.num_heads * c.head_dim * new * prefix
    return max(nbytes / (s["copy_gbs"] * 1e6), flops / (s["matmul_tflops"] * 1e9))


def measure_extend(driver: Driver, args: argparse.Namespace, mcfg: ModelConfig, s: dict,
                   dtype_bytes: int, *, profile: bool) -> None:  # fmt: skip
    """Time every --extend shape, print a line each and put the figures into `s` under
    extend_{P}+{N} (with the kernel profile under `profile`), and its median alone under
    extend_{P}+{N}_ms, a figure `shunter bench ab --metric` can compare."""
    for prefix_len, new_len in parse_shapes(args.extend):
        prefix, new = random_prompts(2, max(prefix_len, new_len), driver.core.vocab_size,
                                     args.seed + 11)  # fmt: skip
        prefix, new = prefix[:prefix_len], new[:new_len]
        fig = time_extend(driver, prefix, new, args.repeats)
        key = f"extend_{prefix_len}+{new_len}"
        floor = floor_ms(mcfg, prefix_len, new_len, dtype_bytes, s)
        host = ("piecewise graphs" if fig["host_ms"] is None
                else f"{fig['host_ms']:.2f} ms on the host before the model")  # fmt: skip
        line = (f"extend {new_len} tokens over {prefix_len} cached: median {fig['median_ms']:.2f}"
                f" ms, best {fig['best_ms']:.2f} ms ({host})")  # fmt: skip
        if floor:
            fig["floor_ms"], fig["frac_of_floor"] = floor, floor / fig["best_ms"]
            line += f", floor {floor:.2f} ms ({fig['frac_of_floor']:.0%} of it)"
        print(line, flush=True)
        if profile:
            from shunter.ops.bench_profile import format_idle, format_rows, prefill_profile

            fig["kernel_profile"], fig["idle"] = prefill_profile(driver, new, prefix=prefix)
            print(f"extend {prefix_len}+{new_len}, one step profiled:\n"
                  + format_rows(fig["kernel_profile"], 1) + "\n" + format_idle(fig["idle"]),
                  flush=True)  # fmt: skip
        if getattr(args, "prefill_host_profile", 0):
            from shunter.ops.bench_profile import format_host_profile, host_profile

            fig["host_profile"] = host_profile(driver, new, args.prefill_host_profile, prefix)
            print(f"extend {prefix_len}+{new_len}, the host until the model (cProfile):\n"
                  + format_host_profile(fig["host_profile"]), flush=True)  # fmt: skip
        s[key] = fig
        s[f"{key}_ms"] = fig["median_ms"]
