"""The prefill figures of `shunter bench executor --device cuda` (bench_gpu.py's item 4):
one whole-prompt prefill, best of --repeats, its tok/s, TFLOP/s and MFU, the host's
share before the model, every run's time in order (with the GPU's clocks and power
after each under --prefill-clocks), a profiled step under --kernel-profile-bs
prefill, and under --prefill-host-profile the host's functions before the model
(both profiles are ops/bench_profile.py's).

Theory of operation: each run closes every row, synchronizes, optionally idles
(--prefill-pause), then times one prefill of the prompt through the bench's Driver
to a synchronized device. The first run warms up and is not counted. A forward
pre-hook on the model marks when the step reached it, so the best run's host time
(batch building, checks, staging: the device idles meanwhile) is reported beside it.
"""

from __future__ import annotations

import argparse
import sys
import time

from tqdm import tqdm

from shunter.actors.executor.models.config import ModelConfig
from shunter.ops import gpu_clocks
from shunter.ops.bench_gpu_driver import Driver, sync
from shunter.ops.bench_gpu_model import H200_PEAK_BF16_FLOPS, prefill_flops


def bench_prefill(driver: Driver, prompt: list[int], repeats: int, pause: float = 0.0,
                  clocks: bool = False) -> tuple[float, float, list[dict]]:  # fmt: skip
    """(best seconds of one whole-prompt prefill (one batch) over `repeats` runs, the
    host seconds of that run from its start to the model's first launch: the time the
    device idles before the step, spent building, checking and staging the batch;
    every timed run in order: {ms}, with the GPU's clocks, power and temperature read
    just after it when `clocks`, which puts a few tens of ms between runs).
    `pause` seconds of idle device before each run: back to back (0) the runs heat the
    chip and its clocks fall within a run; a pause measures a prefill that arrives at
    a rested device, as one does between bursts of serving."""
    dev = driver.core.runner.device
    best, host, entered, runs = float("inf"), 0.0, [0.0], []

    def mark(_module, _args) -> None:
        entered[0] = time.perf_counter()

    hook = driver.core.runner.model.register_forward_pre_hook(mark)
    try:
        for i in tqdm(range(repeats + 1), desc="prefill", unit="run", file=sys.stderr,
                      leave=False):  # fmt: skip
            driver.close_all()
            sync(driver)
            if pause > 0:
                time.sleep(pause)
            t0 = time.perf_counter()
            driver.prefill([prompt], len(prompt))
            sync(driver)
            dt = time.perf_counter() - t0
            if not i:  # the first run warms up
                continue
            runs.append({"ms": round(dt * 1e3, 3)})
            if clocks and dev.type == "cuda":
                runs[-1].update(gpu_clocks.read(dev.index or 0) or {})
            if dt < best:
                best, host = dt, entered[0] - t0
    finally:
        hook.remove()
    driver.close_all()
    return best, host, runs


def _run_text(run: dict) -> str:
    """'201.3 ms' or, with clocks read, '201.3 ms @ 1755 MHz 690 W'."""
    text = f"{run['ms']:.1f} ms"
    if "sm_mhz" in run:
        text += f" @ {run['sm_mhz']:.0f} MHz {run['power_w']:.0f} W"
    return text


def measure_prefill(driver: Driver, args: argparse.Namespace, mcfg: ModelConfig,
                    prompt: list[int], s: dict, *, profile: bool) -> None:  # fmt: skip
    """Time the prefill of `prompt` (bench_gpu's arguments), print its lines and put its
    figures into the summary `s` (which holds the ceilings on a GPU)."""
    dev = driver.core.runner.device
    dt, host_s, runs = bench_prefill(driver, prompt, args.repeats, args.prefill_pause,
                                     getattr(args, "prefill_clocks", False))  # fmt: skip
    s["prefill_pause_s"], s["prefill_runs"] = args.prefill_pause, runs
    flops = prefill_flops(mcfg, len(prompt))
    s["prefill_tok_s"], s["prefill_tflops"] = len(prompt) / dt, flops / dt / 1e12
    s["prefill_host_ms"] = host_s * 1e3
    pause = f" ({args.prefill_pause:g} s idle before each run)" if args.prefill_pause else ""
    line = (f"prefill {len(prompt)} tokens: {s['prefill_tok_s']:.0f} tok/s, "
            f"{s['prefill_tflops']:.0f} TFLOP/s{pause}, {host_s * 1e3:.2f} ms on the host "
            "before the model")  # fmt: skip
    if dev.type == "cuda":
        s["prefill_mfu"] = flops / dt / H200_PEAK_BF16_FLOPS
        s["prefill_frac_of_matmul"] = s["prefill_tflops"] / s["matmul_tflops"]
        line += (f", MFU {s['prefill_mfu']:.1%} of {H200_PEAK_BF16_FLOPS / 1e12:.1f} TFLOP/s, "
                 f"{s['prefill_frac_of_matmul']:.1%} of the measured matmul")  # fmt: skip
    print(line + "\nprefill runs in order: " + ", ".join(_run_text(r) for r in runs), flush=True)
    if getattr(args, "prefill_host_profile", 0):
        from shunter.ops.bench_profile import format_host_profile, host_profile

        s["prefill_host_profile"] = host_profile(driver, prompt, args.prefill_host_profile)
        print(f"prefill of {len(prompt)} tokens, the host until the model (cProfile):\n"
              + format_host_profile(s["prefill_host_profile"]), flush=True)  # fmt: skip
    if profile:
        from shunter.ops.bench_profile import format_idle, format_rows, prefill_profile

        kp, s["prefill_idle"] = prefill_profile(driver, prompt)
        s["prefill_kernel_profile"] = kp
        print(f"prefill of {len(prompt)} tokens, one step profiled:\n" + format_rows(kp, 1)
              + "\n" + format_idle(s["prefill_idle"]), flush=True)  # fmt: skip
