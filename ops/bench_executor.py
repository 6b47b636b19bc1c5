"""`shunter bench executor`: model forward speed through ExecutorCore, beside HF transformers.

No server and no bus: ForwardBatch messages go straight into an ExecutorCore (the
same code path the executor actor runs, sampling included, greedy), and HF
transformers runs the same weights (loaded from the same GGUF, dequantized to the same
dtype) with the same thread count and the same prompt ids. Measures, each ours then
HF's in the same run:

  1. prefill: one prompt of --prefill-len tokens (best of --repeats) -> tok/s;
  2. decode at each batch size B of --batch-sizes: B prompts of --decode-prompt-len
     tokens are prefilled, then --decode-steps steps are timed; tok/s is the total,
     B * steps / (time between the first and the last decode step's token), as in
     the CPU anchor measurements. HF's loop is a plain greedy loop over its
     KV cache (model(next_ids, cache=...)), which is generate() without its
     per-step overhead, so the ratio does not flatter us. The engines alternate step
     by step (prefill: run by run), so load from other work on the machine hits both.

Prints a line per figure, then a JSON summary as the LAST line (keys prefill_tok_s,
decode_tok_s_bs{B}, hf_*, *_vs_hf ratios, and core_overhead_ms_bs{B}: the per-step
time outside the model runner: planning, staging, sampling). --profile prints where our decode
step's time goes (cProfile, largest batch).

--device cuda (or cuda:N) runs the device mode instead (ops/bench_gpu.py: dummy Llama-3.1-8B,
ceilings, roofline and MFU, HF generate, an offline batch); the options shared with it
default per device (CPU_DEFAULTS here, GPU_DEFAULTS there).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pathlib
import pstats
import sys
import time

import torch
from tqdm import tqdm

from shunter.bus.messages import LAST_SAMPLED, ForwardBatch, RowOpen, SamplingParams
from shunter.ops import bench_gpu, bench_settings

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=1 << 20)


# defaults of the options the device mode shares, on a CPU (ops/bench_gpu.py: on a GPU)
CPU_DEFAULTS = dict(dtype="float32", prefill_len=512, decode_prompt_len=128, decode_steps=32,
                    batch_sizes="1,8,32", repeats=3)  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu",
                   help="cpu (this module), or cuda / cuda:N (ops/bench_gpu.py)")  # fmt: skip
    p.add_argument("--model-path", default=None, help="model (default: SmolLM2-135M GGUF)")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"))
    p.add_argument("--threads", type=int, default=2, help="torch threads for both engines")
    p.add_argument(
        "--weight-format", default="none", choices=("none", "bf16", "int8", "int4"),
        help="our projection weights' format (HF keeps --dtype)",
    )  # fmt: skip
    p.add_argument("--prefill-len", type=int, default=None)
    p.add_argument("--decode-prompt-len", type=int, default=None)
    p.add_argument(
        "--decode-steps", type=int, default=None, help="timed decode steps per batch size"
    )
    p.add_argument("--batch-sizes", default=None, help="comma-separated decode batch sizes")
    p.add_argument("--repeats", type=int, default=None, help="prefill runs (best is reported)")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--skip-hf", action="store_true", help="only our engine (no ratios)")
    p.add_argument("--profile", action="store_true", help="cProfile our largest decode batch")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt ids")
    bench_gpu.add_arguments(p)


def _say(msg: str) -> None:
    print(msg, flush=True)


class Ours:
    """Drives an ExecutorCore with hand-built ForwardBatch messages."""

    def __init__(self, args: argparse.Namespace, max_tokens: int) -> None:
        from shunter.actors.executor.actor import build_core
        from shunter.actors.executor.config import ExecutorConfig

        cfg = ExecutorConfig(
            model_path=args.model_path, dtype=args.dtype, device="cpu", num_threads=args.threads,
            page_size=args.page_size, max_total_tokens=max_tokens, load_progress=True,
            weight_format=args.weight_format,
        )  # fmt: skip
        self.core = build_core(cfg)
        self.ps = args.page_size
        self.step_id = 0
        self.next_page = 0
        self.row_pages: dict[int, int] = {}
        self.row_len: dict[int, int] = {}
        self._pending_closes: list[int] = []
        # Time inside the model runner, so the core's own share of a step shows apart.
        self.forward_s = 0.0
        self.core_overhead_s = 0.0
        forward = self.core.runner.forward

        def timed_forward(inp):
            t0 = time.perf_counter()
            try:
                return forward(inp)
            finally:
                self.forward_s += time.perf_counter() - t0

        self.core.runner.forward = timed_forward

    def _send(self, batch: ForwardBatch) -> list[int]:
        (res,) = self.core.handle(batch)
        if res.error is not None:
            raise RuntimeError(f"benchmark batch failed: {res.error}")
        self.step_id += 1
        return res.token_ids

    def _pages_for(self, row: int, upto: int) -> list[int]:
        need = -(-upto // self.ps) - self.row_pages.get(row, 0)
        new = list(range(self.next_page, self.next_page + need))
        self.next_page += need
        self.row_pages[row] = self.row_pages.get(row, 0) + need
        return new

    def reset(self) -> None:
        """Close every row and start handing out pages from 0 again."""
        closes = list(self.row_len)
        self.row_pages.clear()
        self.row_len.clear()
        self.next_page = 0
        self._pending_closes = closes

    def prefill(self, prompts: list[list[int]], rows: list[int]) -> list[int]:
        """One batch opening `rows` and computing their whole prompts."""
        new_pages, num_new_pages = [], []
        for r, p in zip(rows, prompts):
            pg = self._pages_for(r, len(p))
            new_pages += pg
            num_new_pages.append(len(pg))
            self.row_len[r] = len(p)
        batch = ForwardBatch(
            step_id=self.step_id, closes=self._pending_closes,
            opens=[RowOpen(r, f"bench-{r}", [], 0, GREEDY, r) for r in rows], rows=rows,
            num_new_tokens=[len(p) for p in prompts], start_pos=[0] * len(rows),
            input_ids=[t for p in prompts for t in p], new_pages=new_pages,
            num_new_pages=num_new_pages, sample=[True] * len(rows),
        )  # fmt: skip
        self._pending_closes = []
        return self._send(batch)

    def decode(self, rows: list[int]) -> list[int]:
        new_pages, num_new_pages, starts = [], [], []
        for r in rows:
            pg = self._pages_for(r, self.row_len[r] + 1)
            new_pages += pg
            num_new_pages.append(len(pg))
            starts.append(self.row_len[r])
            self.row_len[r] += 1
        batch = ForwardBatch(
            step_id=self.step_id, rows=rows, num_new_tokens=[1] * len(rows), start_pos=starts,
            input_ids=[LAST_SAMPLED] * len(rows), new_pages=new_pages,
            num_new_pages=num_new_pages, sample=[True] * len(rows),
        )  # fmt: skip
        return self._send(batch)


class HF:
    """HF transformers on the same GGUF, a plain greedy loop over its KV cache."""

    def __init__(self, args: argparse.Namespace) -> None:
        from transformers import AutoModelForCausalLM

        from shunter.actors.model_files import resolve_model

        src = resolve_model(args.model_path)
        dtype = getattr(torch, args.dtype)
        if src.kind == "gguf":
            p = pathlib.Path(src.path)
            self.model = AutoModelForCausalLM.from_pretrained(
                str(p.parent), gguf_file=p.name, dtype=dtype
            )
        else:
            self.model = AutoModelForCausalLM.from_pretrained(src.path, dtype=dtype)
        self.model.eval()

    @staticmethod
    def _cache_of(out):
        c = getattr(out, "cache", None)
        return c if c is not None else out.past_key_values

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]]):
        # logits_to_keep=1: only the last position's logits, as generate() does (and we do).
        out = self.model(torch.tensor(prompts), use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].argmax(-1, keepdim=True), self._cache_of(out)

    @torch.inference_mode()
    def decode(self, next_ids, cache):
        out = self.model(next_ids, cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].argmax(-1, keepdim=True), self._cache_of(out)


def _random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def bench_prefill(ours: Ours, hf: HF | None, prompt: list[int], repeats: int) -> dict:
    best_ours = best_hf = float("inf")
    for i in tqdm(range(repeats + 1), desc="prefill", unit="run", file=sys.stderr):
        ours.reset()
        t0 = time.perf_counter()
        ours.prefill([prompt], [0])
        dt = time.perf_counter() - t0
        if hf is not None:
            t0 = time.perf_counter()
            hf.prefill([prompt])
            dt_hf = time.perf_counter() - t0
        if i == 0:
            continue  # warm-up
        best_ours = min(best_ours, dt)
        if hf is not None:
            best_hf = min(best_hf, dt_hf)
    out = {"prefill_tok_s": len(prompt) / best_ours}
    if hf is not None:
        out["hf_prefill_tok_s"] = len(prompt) / best_hf
    return out


def bench_decode(
    ours: Ours, hf: HF | None, prompts: list[list[int]], steps: int, profile: bool
) -> tuple[float, float | None, list, list]:
    """(our time, HF's time, our tokens, HF's tokens) of `steps` decode steps. The two
    engines alternate step by step, so a machine shared with other work slows both
    alike and their ratio stays meaningful. HF's prefill runs the batch at once (same
    length prompts, no padding); ours in batches of ~1024 tokens."""
    ours.reset()
    rows = list(range(len(prompts)))
    chunk = max(1, 1024 // len(prompts[0]))
    first: list[int] = []
    for i in range(0, len(rows), chunk):
        first += ours.prefill(prompts[i : i + chunk], rows[i : i + chunk])
    seqs = [[t] for t in first]
    seqs_hf: list[list[int]] = []
    if hf is not None:
        nxt, cache = hf.prefill(prompts)
        seqs_hf = [[t] for t in nxt.squeeze(1).tolist()]
    # One untimed step each first: one-time costs (allocations, lazy init) stay out.
    for s, t in zip(seqs, ours.decode(rows)):
        s.append(t)
    if hf is not None:
        nxt, cache = hf.decode(nxt, cache)
        for s, t in zip(seqs_hf, nxt.squeeze(1).tolist()):
            s.append(t)
    prof = cProfile.Profile() if profile else None
    dt = dt_hf = 0.0
    ours.forward_s = 0.0
    for _ in tqdm(range(steps), desc=f"decode bs={len(rows)}", file=sys.stderr, leave=False):
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        toks = ours.decode(rows)
        if prof:
            prof.disable()
        dt += time.perf_counter() - t0
        for s, t in zip(seqs, toks):
            s.append(t)
        if hf is not None:
            t0 = time.perf_counter()
            nxt, cache = hf.decode(nxt, cache)
            dt_hf += time.perf_counter() - t0
            for s, t in zip(seqs_hf, nxt.squeeze(1).tolist()):
                s.append(t)
    if prof:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
        print(buf.getvalue(), file=sys.stderr)
    ours.core_overhead_s = dt - ours.forward_s  # planning, staging, sampling, messages
    return dt, (dt_hf if hf is not None else None), seqs, seqs_hf


def run(args: argparse.Namespace) -> int:
    if args.device != "cpu":
        return bench_gpu.run(args)
    settings = bench_settings.apply_or_report(args.set, "bench executor")
    if settings is None:
        return 2
    for k, v in CPU_DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    batch_sizes = [int(b) for b in str(args.batch_sizes).split(",") if b.strip()]
    if not batch_sizes or min(batch_sizes) < 1 or args.decode_steps < 1 or args.prefill_len < 1:
        print("bench executor: batch sizes, --decode-steps and --prefill-len must be >= 1",
              file=sys.stderr)  # fmt: skip
        return 2
    torch.set_num_threads(args.threads)
    max_tokens = max(
        args.prefill_len, max(batch_sizes) * (args.decode_prompt_len + args.decode_steps + 2)
    )
    max_tokens += args.page_size * (max(batch_sizes) + 1)
    t0 = time.perf_counter()
    ours = Ours(args, max_tokens)
    _say(f"ours: loaded in {time.perf_counter() - t0:.1f} s ({args.dtype}, {args.threads} threads)")
    hf = None
    if not args.skip_hf:
        t0 = time.perf_counter()
        hf = HF(args)
        _say(f"hf:   loaded in {time.perf_counter() - t0:.1f} s")
    vocab = ours.core.vocab_size
    summary: dict = {"dtype": args.dtype, "threads": args.threads, "decode_steps": args.decode_steps,
                     "prefill_len": args.prefill_len, "decode_prompt_len": args.decode_prompt_len,
                     "settings": settings}  # fmt: skip

    (prompt,) = _random_prompts(1, args.prefill_len, vocab, args.seed)
    summary.update(bench_prefill(ours, hf, prompt, args.repeats))
    line = f"prefill {args.prefill_len} tokens: ours {summary['prefill_tok_s']:.0f} tok/s"
    if hf is not None:
        summary["prefill_vs_hf"] = summary["prefill_tok_s"] / summary["hf_prefill_tok_s"]
        line += f", hf {summary['hf_prefill_tok_s']:.0f} tok/s, x{summary['prefill_vs_hf']:.2f}"
    _say(line)

    for bs in batch_sizes:
        prompts = _random_prompts(bs, args.decode_prompt_len, vocab, args.seed + bs)
        profile = args.profile and bs == max(batch_sizes)
        dt, dt_hf, seqs, seqs_hf = bench_decode(ours, hf, prompts, args.decode_steps, profile)
        key = f"decode_tok_s_bs{bs}"
        summary[key] = bs * args.decode_steps / dt
        overhead_ms = ours.core_overhead_s / args.decode_steps * 1e3
        summary[f"core_overhead_ms_bs{bs}"] = overhead_ms
        line = (f"decode bs={bs}: ours {summary[key]:.1f} tok/s ({dt / args.decode_steps * 1e3:.1f}"
                f" ms/step, {overhead_ms:.2f} ms outside the model runner)")  # fmt: skip
        if dt_hf is not None:
            summary[f"hf_{key}"] = bs * args.decode_steps / dt_hf
            summary[f"decode_bs{bs}_vs_hf"] = summary[key] / summary[f"hf_{key}"]
            # Same weights, same greedy rule: the first tokens should agree (float noise
            # may flip a near-tie later on random prompts).
            agree = sum(a[:4] == b[:4] for a, b in zip(seqs, seqs_hf))
            summary[f"decode_bs{bs}_first4_agree"] = agree / bs
            line += (f", hf {summary[f'hf_{key}']:.1f} tok/s, x{summary[f'decode_bs{bs}_vs_hf']:.2f}"
                     f" (first 4 tokens agree in {agree}/{bs} rows)")  # fmt: skip
        _say(line)
    out = json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in summary.items()})
    if args.out:
        pathlib.Path(args.out).write_text(out + "\n")
    print(out)
    return 0
