"""`shunter bench executor --device cuda`: the executor on a GPU against its ceilings and HF.

Theory of operation
    ForwardBatch messages go straight into an ExecutorCore made by build.py's
    `build_core` (the executor actor's own path: CUDA graphs and attention backend as
    configured), driven by bench_gpu_driver.Driver, which hands out rows and pages like a scheduler
    that never runs short. The model is a dummy Llama-3.1-8B (a directory with only
    config.json, seeded random weights) unless --model-path names an HF directory.
    Figures, one printed line each:
      1. HBM copy bandwidth (device-to-device copy of 4 GiB, best of 5) and the bf16
         matmul rate (8192^3, best of 5): the measured ceilings.
      2. bs=1 decode after a --bs1-prompt-len prompt: ms/step, tok/s, and the fraction
         of the roofline copy_bw / `decode_step_bytes` (weights the step reads + KV).
      3. decode throughput at each other batch size B: B prompts of --decode-prompt-len
         prefilled in batches of --token-budget tokens, then --decode-steps steps timed;
         tok/s = B * steps / time, with its roofline fraction too.
      4. prefill of one --prefill-len prompt (best of --repeats; bench_gpu_prefill.py):
         tok/s and MFU, model FLOPs (`prefill_flops`) / time against the datasheet
         peak and against the measured matmul rate; that run's host time before the
         model's first launch (the device idles meanwhile: batch building, checks,
         staging); every run's time in order, with the clocks under --prefill-clocks.
      4b. under --extend P+N,...: one step of N new tokens over P cached ones
         (bench_gpu_extend.py), as a request's first step after a prefix-cache hit:
         median and best ms against the step's byte and FLOP floor.
      5. HF transformers `generate` on the same weights (bench_gpu_hf.py) at bs=1 and at
         the batch sizes <= 64 (--hf-new-tokens each): decode tok/s and our ratio.
      6. offline: --offline-requests random requests of --offline-input-len tokens, each
         decoded to --offline-output-len outputs by bench_gpu_driver.offline_run (an
         in-bench continuous batcher, not the scheduler actor): output tok/s.
    The JSON summary (figures and the config used) is the last stdout line; --out
    writes it too. On a CPU (device "cpu", e.g. the tiny model in tests) the ceilings
    are skipped and everything else runs the same way.

Invariants: every timed region starts and ends on a synchronized device; each decode
step returns its tokens to the host (the core does), so per-step wall time is real.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

import torch
from tqdm import tqdm

from shunter.actors.executor.models.config import ModelConfig
from shunter.ops import bench_settings, bench_stub
from shunter.ops.bench_gpu_driver import GREEDY, Driver, offline_run, random_prompts
from shunter.ops.bench_gpu_extend import parse_shapes
from shunter.ops.bench_gpu_model import (
    MODELS,
    decode_step_bytes,
    kv_bytes_per_token,
    write_model_dir,
)
from shunter.ops.bench_gpu_prefill import measure_prefill

GPU_DEFAULTS = dict(dtype="bfloat16", prefill_len=8192, decode_prompt_len=1024, decode_steps=256,
                    batch_sizes="1,64,256", repeats=3)  # fmt: skip
QUICK = dict(prefill_len=1024, decode_prompt_len=128, decode_steps=16, batch_sizes="1,8",
             repeats=1, bs1_prompt_len=32, hf_new_tokens=16, offline_requests=16,
             offline_input_len=128, offline_output_len=32)  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options only the device mode reads (bench_executor adds the shared ones)."""
    g = p.add_argument_group("device mode (--device cuda)")
    g.add_argument("--model", default="llama-3.1-8b", choices=sorted(MODELS),
                   help="dummy-weight model to build when --model-path is not given")  # fmt: skip
    g.add_argument("--attention-backend", default="auto",
                   choices=("auto", "torch", "triton", "flashinfer"))  # fmt: skip
    g.add_argument("--decode-attention-backend", default="auto",
                   choices=("auto", "triton", "flashinfer"),
                   help="decode kernels under flashinfer (auto: triton for small batches)")  # fmt: skip
    g.add_argument("--disable-cuda-graph", action="store_true")
    g.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        help="decode steps one at a time (default: step N+1 submitted first)",
    )
    g.add_argument("--cuda-graph-max-bs", type=int, default=None)
    g.add_argument("--enable-piecewise-cuda-graph", action="store_true",
                   help="prefill, extend and mixed steps from piecewise graphs")  # fmt: skip
    g.add_argument("--piecewise-cuda-graph-max-tokens", type=int, default=None)
    g.add_argument("--token-budget", type=int, default=8192, help="prefill tokens per batch")
    g.add_argument("--prefill-pause", type=float, default=0.0, metavar="SECONDS",
                   help="idle device time before each timed prefill (default 0: back to back)")  # fmt: skip
    g.add_argument("--prefill-host-profile", type=int, default=0, metavar="TOP",
                   help="profile one more prefill's host time before the model (cProfile) "
                        "and print its TOP functions by cumulative time")  # fmt: skip
    g.add_argument("--prefill-clocks", action="store_true",
                   help="read the GPU's SM clock and power after each timed prefill "
                        "(nvidia-smi, a few tens of ms between runs)")  # fmt: skip
    g.add_argument("--bs1-prompt-len", type=int, default=128)
    g.add_argument("--hf-new-tokens", type=int, default=128, help="HF generate's new tokens")
    g.add_argument("--offline-requests", type=int, default=256)
    g.add_argument("--offline-input-len", type=int, default=1024)
    g.add_argument("--offline-output-len", type=int, default=1024)
    g.add_argument("--offline-max-running", type=int, default=256)
    g.add_argument(
        "--kernel-profile",
        type=int,
        default=0,
        metavar="STEPS",
        help="also profile STEPS decode steps: device time per kernel",
    )
    g.add_argument("--kernel-profile-bs", default="1",
                   help="comma-separated batch sizes --kernel-profile profiles; the entry "
                        "'prefill' profiles one --prefill-len prefill instead, 'extend' "
                        "one step of each --extend shape")  # fmt: skip
    g.add_argument("--extend", default="", metavar="P+N,...",
                   help="also time a step of N new tokens over P cached ones for each pair, "
                        "e.g. 2048+32 (bench_gpu_extend.py)")  # fmt: skip
    g.add_argument("--temperature", type=float, default=0.0,
                   help="sampling of every row (default 0: greedy)")  # fmt: skip
    g.add_argument("--top-p", type=float, default=1.0, help="sampling of every row")
    g.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    g = p.add_argument_group("both modes")
    g.add_argument("--set", action="append", default=[], metavar="MODULE.CONSTANT=VALUE",
                   help="change a module constant before the run, e.g. "
                        "kernels.linear.SKINNY_MAX_ROWS=0 (repeatable; bench_settings.py)")  # fmt: skip
    g.add_argument("--out", default=None, help="also write the JSON summary here")


def fill_defaults(args: argparse.Namespace) -> None:
    for k, v in GPU_DEFAULTS.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)


# ---- measuring ---------------------------------------------------------------------------


def _say(msg: str) -> None:
    print(msg, flush=True)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _best_ms(fn, reps: int = 5) -> float:
    """Best CUDA-event milliseconds of `fn` over `reps` runs after one warm-up."""
    fn()
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


def ceilings(dev: torch.device) -> dict:
    """Copy bandwidth (GB/s, bytes read + written, 4 GiB) and bf16 matmul TFLOP/s (8192^3)."""
    return {"copy_gbs": _copy_gbs(dev), "matmul_tflops": _matmul_tflops(dev)}


def _copy_gbs(dev: torch.device) -> float:
    src = torch.ones(1 << 30, dtype=torch.float32, device=dev)  # 4 GiB
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _best_ms(lambda: dst.copy_(src)) / 1e6


def _matmul_tflops(dev: torch.device, n: int = 8192) -> float:
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    return 2 * n**3 / _best_ms(lambda: torch.matmul(a, b)) / 1e9


def bench_decode(driver: Driver, prompts: list[list[int]], steps: int, budget: int,
                 desc: str, overlap: bool = True) -> tuple[float, list[list[int]]]:  # fmt: skip
    """(seconds of `steps` timed decode steps, each row's tokens) after prefilling the
    prompts and one untimed decode step. overlap: steps submitted back to back (the
    overlap scheduler's pattern), else one at a time."""
    dev = driver.core.runner.device
    driver.close_all()
    rows, first = driver.prefill(prompts, budget)
    seqs = [[t] for t in first]
    for s, t in zip(seqs, driver.decode(rows), strict=True):
        s.append(t)
    _sync(dev)
    t0 = time.perf_counter()
    if overlap:
        for s, more in zip(seqs, driver.decode_overlapped(rows, steps), strict=True):
            s += more
    else:
        for _ in tqdm(range(steps), desc=desc, file=sys.stderr, leave=False):
            for s, t in zip(seqs, driver.decode(rows), strict=True):
                s.append(t)
    _sync(dev)
    dt = time.perf_counter() - t0
    driver.close_all()
    return dt, seqs


def roofline_frac(c: ModelConfig, tok_s: float, bs: int, prompt_len: int, steps: int,
                  copy_gbs: float | None, dtype_bytes: int) -> float | None:  # fmt: skip
    """Measured tok/s over copy_bw * B / bytes of the mean timed step (its context:
    prompt + the first sampled token + the warm-up step + half the timed steps)."""
    if not copy_gbs:
        return None
    mean_ctx = prompt_len + 2 + (steps - 1) / 2
    nbytes = decode_step_bytes(c, [1] * bs, dtype_bytes)
    nbytes += kv_bytes_per_token(c, dtype_bytes) * bs * (mean_ctx - 1)
    return tok_s / (bs * copy_gbs * 1e9 / nbytes)


# ---- the run -------------------------------------------------------------------------------


def _sizes(args: argparse.Namespace, batch_sizes: list[int]) -> dict:
    """Context length, KV tokens and rows that every phase fits in (one pool for all)."""
    bs1_ctx = args.bs1_prompt_len + args.decode_steps + 2
    thr_ctx = args.decode_prompt_len + args.decode_steps + 2
    off_ctx = args.offline_input_len + args.offline_output_len
    off_rows = min(args.offline_requests, args.offline_max_running)
    max_rows = max(*batch_sizes, off_rows, 1)
    ext_ctx = max((p + n for p, n in parse_shapes(getattr(args, "extend", ""))), default=0)
    ctx = max(args.prefill_len, bs1_ctx, thr_ctx, off_ctx, ext_ctx) + args.page_size
    tokens = max(args.prefill_len, bs1_ctx, max(batch_sizes) * thr_ctx, off_rows * off_ctx,
                 ext_ctx)  # fmt: skip
    return {"context_length": ctx, "max_total_tokens": tokens + args.page_size * (max_rows + 1),
            "max_num_rows": max_rows}  # fmt: skip


def _model(args: argparse.Namespace, tmp: str) -> tuple[pathlib.Path, dict, bool]:
    """(model directory, its config.json dict, whether weights are dummy)."""
    if args.model_path:
        path = pathlib.Path(args.model_path)
        return path, json.loads((path / "config.json").read_text()), False
    config = MODELS[args.model]
    return write_model_dir(pathlib.Path(tmp) / args.model, config), config, True


def build(args: argparse.Namespace, model_dir: pathlib.Path, dummy: bool, sizes: dict):
    from shunter.actors.executor.build import build_core
    from shunter.actors.executor.config import ExecutorConfig

    # the start-up warm-up stays: without it a first mixed step (the offline run's)
    # could compile a flashinfer kernel inside a timed region
    cfg = ExecutorConfig(
        model_path=str(model_dir), load_format="dummy" if dummy else "auto", device=args.device,
        dtype=args.dtype, page_size=args.page_size, seed=args.seed,
        weight_format=args.weight_format, attention_backend=args.attention_backend,
        decode_attention_backend=args.decode_attention_backend,
        cuda_graph_max_bs=args.cuda_graph_max_bs, disable_cuda_graph=args.disable_cuda_graph,
        piecewise_cuda_graph=args.enable_piecewise_cuda_graph,
        piecewise_cuda_graph_max_tokens=args.piecewise_cuda_graph_max_tokens,
        **sizes,
    )  # fmt: skip
    return build_core(cfg), cfg


def run(args: argparse.Namespace) -> int:
    fill_defaults(args)
    batch_sizes = [int(b) for b in str(args.batch_sizes).split(",") if b.strip()]
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("bench executor: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    if not batch_sizes or min(batch_sizes) < 1 or args.decode_steps < 1:
        print("bench executor: batch sizes and --decode-steps must be >= 1", file=sys.stderr)
        return 2
    try:
        parse_shapes(args.extend)
    except ValueError as e:
        print(f"bench executor: {e}", file=sys.stderr)
        return 2
    settings = bench_settings.apply_or_report(args.set, "bench executor")
    if settings is None:
        return 2
    try:
        stubbed = bench_stub.groups()
    except ValueError as e:
        print(f"bench executor: {e}", file=sys.stderr)
        return 2
    if stubbed and not args.skip_hf:
        print("bench executor: a stubbed step (ops.bench_stub.STUB) samples meaningless"
              " tokens; add --skip-hf", file=sys.stderr)  # fmt: skip
        return 2
    bench_stub.apply()
    s: dict = {}
    if dev.type == "cuda":
        s.update(ceilings(dev))
        _say(f"ceilings: copy {s['copy_gbs']:.0f} GB/s, bf16 matmul {s['matmul_tflops']:.0f} TFLOP/s"
             f" ({torch.cuda.get_device_name(dev)})")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, config_dict, dummy = _model(args, tmp)
        sizes = _sizes(args, batch_sizes)
        t0 = time.perf_counter()
        core, cfg = build(args, model_dir, dummy, sizes)
    _say(f"ours: loaded in {time.perf_counter() - t0:.1f} s ({args.dtype}, {dev})")
    import msgspec

    s["config"] = {**msgspec.to_builtins(cfg), "model": args.model_path or args.model,
                   "torch": torch.__version__, "device_name": _device_name(dev),
                   "attention_backend_used": getattr(core.runner, "backend", None),
                   "num_pages": core.num_pages, "temperature": args.temperature,
                   "top_p": args.top_p, "settings": settings, "stubbed": stubbed}  # fmt: skip
    params = msgspec.structs.replace(GREEDY, temperature=args.temperature, top_p=args.top_p)
    driver = Driver(core, params=params)
    mcfg = core.runner.config
    nb = torch.empty(0, dtype=core.runner.dtype).element_size()
    vocab, steps, copy_gbs = core.vocab_size, args.decode_steps, s.get("copy_gbs")
    prompts_by_bs: dict[int, list[list[int]]] = {}

    for bs in batch_sizes:
        plen = args.bs1_prompt_len if bs == 1 else args.decode_prompt_len
        prompts_by_bs[bs] = random_prompts(bs, plen, vocab, args.seed + bs)
        overlap = not getattr(args, "disable_overlap_schedule", False)
        dt, seqs = bench_decode(driver, prompts_by_bs[bs], steps, args.token_budget,
                                f"decode bs={bs}", overlap)  # fmt: skip
        if bs == 1 and overlap:  # the same steps one at a time: what the overlap hides
            dt1, _ = bench_decode(driver, prompts_by_bs[bs], steps, args.token_budget, "bs=1")
            s["decode_tok_s_bs1_no_overlap"] = steps / dt1
        tok_s = bs * steps / dt
        s[f"decode_tok_s_bs{bs}"], s[f"decode_ms_bs{bs}"] = tok_s, dt / steps * 1e3
        frac = roofline_frac(mcfg, tok_s, bs, plen, steps, copy_gbs, nb)
        s[f"decode_bs{bs}_roofline_frac"] = frac
        if bs == 1 and params.temperature == 0.0:  # HF's greedy tokens are compared
            s["bs1_tokens"] = seqs[0]
        _say(f"decode bs={bs} ({plen}-token prompts, {steps} steps): {tok_s:.1f} tok/s, "
             f"{dt / steps * 1e3:.2f} ms/step" + (f", {frac:.1%} of roofline" if frac else "")
             + (f"; one step at a time {s['decode_tok_s_bs1_no_overlap']:.1f} tok/s"
                if bs == 1 and "decode_tok_s_bs1_no_overlap" in s else ""))  # fmt: skip

    profiled = [b.strip() for b in str(args.kernel_profile_bs).split(",") if b.strip()]
    if getattr(args, "kernel_profile", 0):
        from shunter.ops.bench_profile import format_rows, kernel_profile

        for bs in [int(b) for b in profiled if b not in ("prefill", "extend")]:
            plen = args.bs1_prompt_len if bs == 1 else args.decode_prompt_len
            prompts = prompts_by_bs.get(bs) or random_prompts(bs, plen, vocab, args.seed + bs)
            kp = kernel_profile(driver, prompts, args.kernel_profile, args.token_budget)
            s[f"bs{bs}_kernel_profile"] = kp
            _say(f"bs={bs} decode, {args.kernel_profile} steps profiled:\n"
                 + format_rows(kp, args.kernel_profile))  # fmt: skip
    if getattr(args, "extend", ""):
        from shunter.ops.bench_gpu_extend import measure_extend

        profile = bool(getattr(args, "kernel_profile", 0)) and "extend" in profiled
        measure_extend(driver, args, mcfg, s, nb, profile=profile)
    (prompt,) = random_prompts(1, args.prefill_len, vocab, args.seed)
    profile = bool(getattr(args, "kernel_profile", 0)) and "prefill" in profiled
    measure_prefill(driver, args, mcfg, prompt, s, profile=profile)

    if not args.skip_hf:
        from shunter.ops.bench_gpu_hf import compare_hf

        hf_sizes = [b for b in batch_sizes if b <= 64]
        s.update(compare_hf(config_dict, core.runner.model, s, prompts_by_bs, hf_sizes,
                            args.hf_new_tokens, _say))  # fmt: skip
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    if args.offline_requests > 0:
        s.update(bench_offline(driver, args, vocab))
    s.pop("bs1_tokens", None)
    out = json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in s.items()})
    if args.out:
        pathlib.Path(args.out).write_text(out + "\n")
    print(out)
    return 0


def bench_offline(driver: Driver, args: argparse.Namespace, vocab: int) -> dict:
    prompts = random_prompts(args.offline_requests, args.offline_input_len, vocab, args.seed + 7)
    driver.close_all()
    res = offline_run(driver, prompts, args.offline_output_len, args.token_budget,
                      args.offline_max_running, progress=True)  # fmt: skip
    num_out = sum(len(o) for o in res.outputs)
    tok_s = num_out / res.elapsed_s
    _say(f"offline {len(prompts)} x {args.offline_input_len} in / {args.offline_output_len} out: "
         f"{tok_s:.0f} output tok/s, {res.elapsed_s:.1f} s, {res.num_steps} steps")  # fmt: skip
    return {"offline_output_tok_s": tok_s, "offline_s": res.elapsed_s,
            "offline_steps": res.num_steps}  # fmt: skip


def _device_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"


if __name__ == "__main__":
    # python -m shunter.ops.bench_gpu DIR [MODEL]: a dummy model directory a server can run
    # (`shunter serve --model-path DIR --load-format dummy`)
    out = write_model_dir(pathlib.Path(sys.argv[1]), MODELS[sys.argv[2] if len(sys.argv) > 2
                          else "llama-3.1-8b"], tokenizer=True)  # fmt: skip
    print(out)
