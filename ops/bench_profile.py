"""Where a decode (or prefill) step's device time goes: torch.profiler over a few steps.

Theory of operation: `kernel_profile` prefills `prompts` through a bench Driver, runs
warm-up decode steps, then profiles `steps` more (submitted back to back, as the
overlap scheduler sends them) with torch.profiler (CUDA activities on a GPU; kernels
inside replayed CUDA graphs are traced too), and folds the events into one row per
kernel name: calls, total and mean device time, share of the profiled time. The
names show which op each kernel belongs to (cuBLAS GEMMs, flashinfer/Triton
attention, the Triton norm/rope/activation kernels), so a step's gap to the
bandwidth roofline can be attributed. `prefill_profile` does the same for one
prefill of a whole prompt, and lays that step's kernels on a timeline (`idle_gaps`):
how long the device sat idle from the step's start to its last kernel, before the
first kernel, and in the largest gaps between kernels, named by their neighbours.
`host_profile` is the host's side of that head: cProfile over one prefill from the
step's start until the model is entered.

Invariants: leaves the driver with no open rows; the profiled steps' tokens are not
checked (the decode benchmark does that).
"""

from __future__ import annotations

import torch

from shunter.ops.bench_gpu_driver import Driver, Entry, sync


def kernel_profile(
    driver: Driver, prompts: list[list[int]], steps: int, budget: int, top: int = 25
) -> list[dict]:
    """Rows {name, calls, total_us, mean_us, share} of the `top` kernels by device time
    (host time on a CPU, where no device kernels exist)."""
    from torch.profiler import ProfilerActivity, profile

    dev = driver.core.runner.device
    on_cuda = dev.type == "cuda"
    driver.close_all()
    rows, _ = driver.prefill(prompts, budget)
    driver.decode_overlapped(rows, 3)  # warm: graphs replayed, allocator settled
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    if on_cuda:
        torch.cuda.synchronize(dev)
    with profile(activities=activities) as prof:
        driver.decode_overlapped(rows, steps)
        if on_cuda:
            torch.cuda.synchronize(dev)
    driver.close_all()
    return fold(prof.key_averages(), on_cuda, top)


def prefill_profile(
    driver: Driver, prompt: list[int], top: int = 25, prefix: list[int] | None = None
) -> tuple[list[dict], dict]:
    """`kernel_profile`'s rows for one prefill of the whole prompt (after a warm one),
    and `idle_gaps` of its timeline (empty on a CPU, which has no device kernels).
    With `prefix`, its tokens are computed first (untimed) on the step's row, so the
    profiled step is an extend of `prompt` over them."""
    from torch.profiler import ProfilerActivity, profile, record_function

    dev = driver.core.runner.device
    on_cuda = dev.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    step = prepare_step(driver, prompt, prefix)
    step()  # warm
    step = prepare_step(driver, prompt, prefix)
    with profile(activities=activities) as prof:
        with record_function(STEP):
            step()
        if on_cuda:
            torch.cuda.synchronize(dev)
    driver.close_all()
    idle: dict = {}
    if on_cuda:
        events = prof.events()
        marked = next(e for e in events if e.name == STEP)
        # the step's own range also shows on the device's track: not a kernel
        kernels = [(e.time_range.start, e.time_range.end, e.name) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.name != STEP]  # fmt: skip
        idle = idle_gaps(kernels, marked.time_range.start)
    return fold(prof.key_averages(), on_cuda, top), idle


def prepare_step(driver: Driver, prompt: list[int], prefix: list[int] | None = None):
    """Close every row, compute `prefix` (if any) on a new row, synchronize, and return
    the step to time: `prompt` as one batch, a prefill of a new row or, with a prefix,
    an extend of the prefix's row."""
    driver.close_all()
    if not prefix:
        sync(driver)
        return lambda: driver.prefill([prompt], len(prompt))
    (row,), _ = driver.prefill([prefix], len(prefix))
    sync(driver)
    return lambda: driver.step([Entry(row, prompt)])


def host_profile(
    driver: Driver, prompt: list[int], top: int, prefix: list[int] | None = None
) -> list[dict]:
    """One more prefill of `prompt` (an extend over `prefix` if given, as in
    `prefill_profile`) under cProfile from the step's start until the model is entered
    (the host's share before the device starts): the `top` functions by cumulative
    time, [{fn, calls, self_ms, cum_ms}] (cProfile's own overhead included, so only the
    ranking and the shares mean much)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()

    def stop(_module, _args) -> None:
        prof.disable()

    hook = driver.core.runner.model.register_forward_pre_hook(stop)
    try:
        step = prepare_step(driver, prompt, prefix)
        prof.enable()
        step()
        prof.disable()
        sync(driver)
    finally:
        hook.remove()
        driver.close_all()
    rows = []
    for (path, line, name), (_cc, calls, tt, ct, _callers) in pstats.Stats(prof).stats.items():
        if "disable" in name and "Profile" in name:
            continue  # the profiler's own stop
        fn = f"{path.rsplit('/', 1)[-1]}:{line}({name})" if path != "~" else name
        rows.append({"fn": fn, "calls": calls, "self_ms": tt * 1e3, "cum_ms": ct * 1e3})
    rows.sort(key=lambda r: -r["cum_ms"])
    return rows[:top]


def format_host_profile(rows: list[dict]) -> str:
    lines = ["  cum ms  self ms   calls  function"]
    lines += [f"{r['cum_ms']:8.3f} {r['self_ms']:8.3f} {r['calls']:7d}  {r['fn']}" for r in rows]
    return "\n".join(lines)


STEP = "bench.prefill_step"  # the profiled step's host range


def idle_gaps(kernels: list[tuple[float, float, str]], start: float, top: int = 8) -> dict:
    """Where the device idled in a step: kernels as (start, end, name) in µs on the
    host's clock, `start` the step's host start. {span_us: start to the last kernel's
    end, busy_us: the union of the kernels, idle_us, head_us: start to the first
    kernel, gaps: the `top` largest idle stretches between kernels as {us, after,
    before}, gap_count and gap_us: all stretches between kernels}."""
    if not kernels:
        return {"span_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "head_us": 0.0, "gaps": [],
                "gap_count": 0, "gap_us": 0.0}  # fmt: skip
    ks = sorted(kernels)
    busy, gaps = 0.0, []
    cur_s, cur_e, cur_name = ks[0]
    for s, e, name in ks[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append({"us": s - cur_e, "after": cur_name, "before": name})
            cur_s, cur_e, cur_name = s, e, name
        elif e > cur_e:
            cur_e, cur_name = e, name
    busy += cur_e - cur_s
    span = cur_e - start
    gaps.sort(key=lambda g: -g["us"])
    return {
        "span_us": span,
        "busy_us": busy,
        "idle_us": span - busy,
        "head_us": ks[0][0] - start,
        "gaps": gaps[:top],
        "gap_count": len(gaps),
        "gap_us": sum(g["us"] for g in gaps),
    }


def format_idle(idle: dict) -> str:
    """A few lines: span, busy, idle (head and between kernels), the largest gaps."""
    if not idle.get("span_us"):
        return "no device kernels traced"
    lines = [f"span {idle['span_us']:.0f} us, kernels busy {idle['busy_us']:.0f} us, idle "
             f"{idle['idle_us']:.0f} us: {idle['head_us']:.0f} before the first kernel, "
             f"{idle['gap_us']:.0f} in {idle['gap_count']} gaps between kernels"]  # fmt: skip
    for g in idle["gaps"]:
        lines.append(f"  {g['us']:8.1f} us after {g['after'][:50]} before {g['before'][:50]}")
    return "\n".join(lines)


def fold(averages, device_time: bool, top: int) -> list[dict]:
    """Rows of the profiler's per-name averages, largest total time first: device
    kernels by their own device time, or (on a CPU) ops by their own host time; at most
    `top` rows, the last of them summing the rest when there are more."""
    rows = []
    for e in averages:
        if e.key == STEP:  # a range this module marks, not an op or a kernel
            continue
        if device_time:
            if e.device_type == torch.autograd.DeviceType.CPU:
                continue  # host-side ops; their kernels are rows of their own
            total = e.self_device_time_total
        else:
            total = e.self_cpu_time_total
        if total > 0:
            rows.append({"name": e.key, "calls": e.count, "total_us": float(total)})
    grand = sum(r["total_us"] for r in rows) or 1.0
    rows.sort(key=lambda r: -r["total_us"])
    if len(rows) > top:  # the tail as one row, so that the shares add up to 1
        rest = rows[top - 1 :]
        rows[top - 1 :] = [{"name": f"({len(rest)} more)", "calls": sum(r["calls"] for r in rest),
                            "total_us": sum(r["total_us"] for r in rest)}]  # fmt: skip
    for r in rows:
        r["mean_us"] = r["total_us"] / max(r["calls"], 1)
        r["share"] = r["total_us"] / grand
    return rows


def format_rows(rows: list[dict], steps: int) -> str:
    """A table: share, device µs per step, calls per step, name."""
    lines = [f"{'share':>6} {'us/step':>9} {'calls/step':>10}  kernel"]
    for r in rows:
        lines.append(f"{r['share']:6.1%} {r['total_us'] / steps:9.1f} {r['calls'] / steps:10.1f}  "
                     f"{r['name'][:90]}")  # fmt: skip
    return "\n".join(lines)
