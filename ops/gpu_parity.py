"""GPU parity: greedy decoding through the executor core against HF transformers with
the same weights, over every engine variant (CUDA graphs, attention backend, overlap).

Theory of operation
-------------------
A seeded dummy-weight transformers Llama ("small", or Llama-3.1-8B's shapes) is the
reference. Its config.json is written to a directory, `build_core` loads that config
with dummy weights, and HF's parameters are copied over ours in place
(`load_weights`), so CUDA graphs captured while building stay valid. `drive` then
plays the scheduler: it opens one row per prompt, staggered one forward apart (so
forwards mix a prefill with decodes and decode batches take every size from 1 to the
number of prompts, which are not all graph buckets), hands out pages in a shuffled
order, closes each row the forward after its last sample, and reads results either
step by step or pipelined (`core.submit` before the previous result is read, inputs
LAST_SAMPLED, then `core.flush`). Each row asks for its top-2 raw logprobs, which
give our own top-1/top-2 margin at every step.

Two ways to compare a run with a reference run:
- free running: exact token equality, except that the first divergence may fall
  where the reference's top-1/top-2 margin is below a tie threshold; after it the
  contexts differ and the rest of that prompt is not compared;
- teacher forced (the decode inputs are the reference's tokens): every step compares
  our argmax with the reference token at the same context, and a disagreement is
  allowed only where the reference's margin is below the threshold.

Thresholds (logit units; log-softmax keeps differences, so logprob margins are logit
margins):
- float32: TIE_FP32 = 1e-4. Our kernels and HF's differ only in summation order, a
  few fp32 roundings (2^-24 relative) per layer; logits of these models are O(10),
  so the two disagree by ~1e-5 at most. A margin under 1e-4 is a tie.
- bfloat16: tie when margin <= TIE_BF16_ULPS * u * max(1, |top-1 logit|), with
  u = 2^-8 the bf16 unit roundoff and TIE_BF16_ULPS = 8, i.e. 4 to 8 bf16 ulps of the
  top-1 logit. The logits are bf16 GEMM outputs (so margins come in whole ulps, and
  exact ties, margin 0, are common), and the hidden state that feeds that GEMM
  carries a few more bf16 roundings per layer that HF and we place differently
  (fused residual add + norm in fp32, rope, the attention's bf16 probabilities).
  Measured on the CPU path (small shape, teacher forced, 192 steps): our margins
  differ from HF's by at most 0.125 (4 ulps at logits of 4-6; threshold there 0.13),
  and every flip fell at an HF margin of 0 or 1 ulp.

Run on a CUDA machine: python -m shunter.ops.gpu_parity [--kinds small,8b] [--steps 64]
Exit status 1 if any comparison fails.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import pathlib
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from shunter.bus.messages import LAST_SAMPLED, ForwardBatch, RowOpen, SamplingParams, StepResult
from shunter.kernels.attention_flashinfer import flashinfer_available

TIE_FP32 = 1e-4
BF16_UNIT_ROUNDOFF = 2.0**-8
TIE_BF16_ULPS = 8
BACKENDS = ("triton", "flashinfer")
# Prompts of different lengths. Staggered, the decode batch holds all of them for most
# steps: 5 and 3 rows, which replay padded to the capture buckets 8 and 4.
PROMPT_LENS = {"small": [37, 5, 120, 64, 17], "8b": [29, 83, 7]}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
# Llama-3.1-8B (all 32 layers) and a small model of the same family
SHAPES: dict[str, dict] = {
    "small": dict(vocab_size=8192, hidden_size=512, intermediate_size=1408,
                  num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                  max_position_embeddings=4096),
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
               num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               max_position_embeddings=131072, rms_norm_eps=1e-5,
               rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}),
}  # fmt: skip


def bf16_tie(top1_logit: float) -> float:
    """The largest top-1/top-2 margin a bf16 rounding difference can flip (see above)."""
    return TIE_BF16_ULPS * BF16_UNIT_ROUNDOFF * max(1.0, abs(top1_logit))


# ---- the reference --------------------------------------------------------------


def build_hf(kind: str, dtype: torch.dtype, device: str, seed: int = 0):
    """(model, config): a seeded dummy-weight transformers Llama with norms away from 1
    (so their weights matter), in eval mode on `device`."""
    import transformers

    cfg = transformers.LlamaConfig(
        **SHAPES[kind], initializer_range=0.05, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.LlamaForCausalLM._from_config(
            cfg, attn_implementation="sdpa", dtype=dtype
        )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    return model.eval().requires_grad_(False), cfg


@dataclass
class Run:
    """Per prompt: greedy tokens, and per step (top-1 logit or logprob, top-2 margin)."""

    tokens: list[list[int]]
    top1: list[list[float]]
    margins: list[list[float]]
    raw: list[list[StepResult]] = field(default_factory=list)


@torch.inference_mode()
def hf_greedy(model, prompts: Sequence[Sequence[int]], num_steps: int) -> Run:
    """HF's greedy decoding, one full forward per step (no KV cache, so no cache-path
    rounding of its own); logits in float32."""
    device = next(model.parameters()).device
    run = Run([], [], [])
    for prompt in prompts:
        ids = torch.tensor([list(prompt)], device=device)
        top2 = []
        for _ in range(num_steps):
            logits = model(ids, logits_to_keep=1).logits[0, -1].float()  # [vocab]
            top2.append(logits.topk(2))
            ids = torch.cat([ids, top2[-1].indices[:1].view(1, 1)], 1)
        vals = torch.stack([t.values for t in top2]).tolist()  # [num_steps, 2]
        run.tokens.append(ids[0, len(prompt) :].tolist())
        run.top1.append([v[0] for v in vals])
        run.margins.append([v[0] - v[1] for v in vals])
    return run


def random_prompts(vocab_size: int, lens: Sequence[int], seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lens]


# ---- our engine -----------------------------------------------------------------


@contextlib.contextmanager
def skip_dummy_init() -> Iterator[None]:
    """Leave the dummy model's parameters uninitialised while it loads (their values
    are replaced by HF's right after; the 8B shape's seeded init takes tens of
    seconds on the host)."""
    from shunter.actors.executor import loader

    saved = loader.init_dummy_weights
    loader.init_dummy_weights = lambda model, seed: None
    try:
        yield
    finally:
        loader.init_dummy_weights = saved


def build_engine(hf_model, hf_cfg, model_dir: pathlib.Path, *, dtype: torch.dtype,
                 device: str, backend: str, graphs: bool, page_size: int = 16,
                 max_total_tokens: int = 4096, context_length: int = 1024,
                 max_bs: int = 8, fast_init: bool = False):  # fmt: skip
    """An ExecutorCore from `build_core` holding HF's weights (copied in place); with
    `graphs`, decode graphs and piecewise graphs of the prefills (piecewise_graph.py)."""
    from shunter.actors.executor.build import build_core
    from shunter.actors.executor.config import ExecutorConfig

    hf_cfg.save_pretrained(model_dir)  # config.json: what load_format "dummy" reads
    config = ExecutorConfig(
        model_path=str(model_dir), load_format="dummy", device=device,
        dtype=DTYPE_NAMES[dtype], page_size=page_size, max_total_tokens=max_total_tokens,
        context_length=context_length, max_num_rows=2 * max_bs, load_progress=False,
        attention_backend=backend, disable_cuda_graph=not graphs, cuda_graph_max_bs=max_bs,
        piecewise_cuda_graph=graphs,
    )  # fmt: skip
    with skip_dummy_init() if fast_init else contextlib.nullcontext():
        core = build_core(config)
    core.runner.model.load_weights(hf_model.named_parameters())
    return core


def drive(core, prompts: Sequence[Sequence[int]], num_steps: int | Sequence[int], *,
          overlap: bool, teacher: Sequence[Sequence[int]] | None = None,
          seed: int = 0) -> Run:  # fmt: skip
    """Greedy decoding of every prompt through `core` as the scheduler would drive it
    (see the module docstring); prompt b runs num_steps[b] steps. With `teacher`,
    decode inputs are teacher[b][i - 1] instead of LAST_SAMPLED."""
    n = len(prompts)
    steps = [num_steps] * n if isinstance(num_steps, int) else list(num_steps)
    rows = [2 * b + 1 for b in range(n)]  # sparse row ids
    ps = core.page_size
    free = torch.randperm(core.num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    num_pages = [0] * n
    greedy = SamplingParams(temperature=0.0, max_new_tokens=max(steps), ignore_eos=True,
                            return_logprob=True, top_logprobs_num=2)  # fmt: skip
    results: list[StepResult] = []
    num_forwards = max(b + s for b, s in enumerate(steps))
    for f in range(num_forwards + 1):  # the last batch only closes rows
        opens, closes = [], [rows[b] for b in range(n) if f == b + steps[b]]
        ents, starts, ids, new_pages, nnp = [], [], [], [], []
        for b in range(n):
            i = f - b  # this forward samples row b's i-th token
            if not 0 <= i < steps[b]:
                continue
            if i == 0:
                opens.append(RowOpen(rows[b], f"p{b}", [], 0, greedy, seed + b))
                toks, start = list(prompts[b]), 0
            else:
                toks = [teacher[b][i - 1] if teacher else LAST_SAMPLED]
                start = len(prompts[b]) + i - 1
            need = -(-(start + len(toks)) // ps) - num_pages[b]
            new_pages += [free.pop() for _ in range(need)]
            num_pages[b] += need
            ents.append(b), starts.append(start), nnp.append(need)
            ids += toks
        batch = ForwardBatch(
            step_id=f, opens=opens, closes=closes, rows=[rows[b] for b in ents],
            num_new_tokens=[1 if f > b else len(prompts[b]) for b in ents], start_pos=starts,
            input_ids=ids, new_pages=new_pages, num_new_pages=nnp, sample=[True] * len(ents),
        )  # fmt: skip
        results += _submit(core, batch) if overlap else _step(core, batch)
    if overlap:
        results += core.flush()
    return _collect(results, rows, num_forwards + 1)


def runs_with_setting(module, name: str, values: Sequence, hf_model, hf_cfg,
                      model_dir: pathlib.Path, prompts: Sequence[Sequence[int]], num_steps: int,
                      *, dtype: torch.dtype, graphs: bool, backend: str = "triton") -> list[Run]:  # fmt: skip
    """An engine on CUDA and an overlapped greedy `drive` for each value of the module
    constant `module.name` (restored afterwards): the runs, in the order of `values`."""
    saved, runs = getattr(module, name), []
    try:
        for i, value in enumerate(values):
            setattr(module, name, value)
            core = build_engine(hf_model, hf_cfg, model_dir / f"m{i}", dtype=dtype, device="cuda",
                                backend=backend, graphs=graphs)  # fmt: skip
            runs.append(drive(core, prompts, num_steps, overlap=True))
            del core
    finally:
        setattr(module, name, saved)
    return runs


def _submit(core, batch: ForwardBatch) -> list[StepResult]:
    if not hasattr(core, "submit"):
        raise NotImplementedError("this ExecutorCore has no submit/flush (overlap) API")
    return list(core.submit(batch))


def _step(core, batch: ForwardBatch) -> list[StepResult]:
    res = core.step(batch)
    return list(res) if isinstance(res, list) else [res]


def _collect(results: list[StepResult], rows: list[int], num_batches: int) -> Run:
    assert sorted(r.step_id for r in results) == list(range(num_batches)), "lost results"
    errors = [r.error for r in results if r.error]
    assert not errors, errors
    by_row = {r: i for i, r in enumerate(rows)}
    run = Run([[] for _ in rows], [[] for _ in rows], [[] for _ in rows])
    for res in sorted(results, key=lambda r: r.step_id):
        for row, tok, top in zip(res.rows, res.token_ids, res.top_logprobs, strict=True):
            b = by_row[row]
            run.tokens[b].append(tok)
            run.top1[b].append(top[0].logprob)
            run.margins[b].append(top[0].logprob - top[1].logprob)
    return run


# ---- comparisons ----------------------------------------------------------------


def tie_threshold(dtype: torch.dtype, ref: Run, b: int, i: int, scale: float | None) -> float:
    """The tie threshold at prompt b, step i; `scale` stands for the top-1 logit when
    the reference run has only logprobs (our engine reports logprobs, not logits)."""
    if dtype == torch.float32:
        return TIE_FP32
    return bf16_tie(ref.top1[b][i] if scale is None else scale)


def check_free(ours: Run, ref: Run, dtype: torch.dtype, scale: float | None = None) -> list[str]:
    """Problems of a free-running comparison: a divergence where the reference's
    margin is above the tie threshold (nothing after a prompt's first divergence)."""
    problems = []
    for b, (o, r) in enumerate(zip(ours.tokens, ref.tokens, strict=True)):
        i = next((i for i, (x, y) in enumerate(zip(o, r)) if x != y), None)
        if len(o) != len(r):
            problems.append(f"prompt {b}: {len(o)} tokens, reference {len(r)}")
        elif i is not None and ref.margins[b][i] > tie_threshold(dtype, ref, b, i, scale):
            problems.append(f"prompt {b} step {i}: {o[i]} != {r[i]}, "
                            f"reference margin {ref.margins[b][i]:.4g}")  # fmt: skip
    return problems


def check_teacher(ours: Run, ref: Run, dtype: torch.dtype) -> list[str]:
    """Problems of a teacher-forced comparison: any step whose argmax disagrees with
    the reference token where the reference's margin is above the tie threshold."""
    problems = []
    for b, (o, r) in enumerate(zip(ours.tokens, ref.tokens, strict=True)):
        for i, (x, y) in enumerate(zip(o, r, strict=True)):
            if x != y and ref.margins[b][i] > tie_threshold(dtype, ref, b, i, None):
                problems.append(f"prompt {b} step {i}: {x} != {y}, "
                                f"reference margin {ref.margins[b][i]:.4g}")  # fmt: skip
    return problems


@torch.inference_mode()
def teacher_argmax(model, prompts: Sequence[Sequence[int]],
                   tokens: Sequence[Sequence[int]]) -> list[list[int]]:  # fmt: skip
    """Per prompt, `model`'s argmax at every step of `tokens` fed as the context (one
    forward over prompt + tokens[:-1] each)."""
    device = next(model.parameters()).device
    out = []
    for prompt, toks in zip(prompts, tokens, strict=True):
        ids = torch.tensor([[*prompt, *toks[:-1]]], device=device)
        logits = model(ids, logits_to_keep=len(toks)).logits[0]  # [len(toks), vocab]
        out.append(logits.float().argmax(-1).tolist())
    return out


def agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> float:
    """Share of steps where two token lists of the same prompts agree."""
    pairs = [(x, y) for p, q in zip(a, b, strict=True) for x, y in zip(p, q, strict=True)]
    return sum(x == y for x, y in pairs) / max(len(pairs), 1)


def num_agree(ours: Run, ref: Run) -> tuple[int, int]:
    pairs = [(x, y) for o, r in zip(ours.tokens, ref.tokens) for x, y in zip(o, r)]
    return sum(x == y for x, y in pairs), len(pairs)


# ---- the table ------------------------------------------------------------------


def parity_rows(kind: str, dtype: torch.dtype, num_steps: int,
                device: str = "cuda") -> Iterator[dict]:  # fmt: skip
    """One row per (backend, graphs, overlap): free running in float32, teacher forced
    in bfloat16, against HF. A backend that refuses the dtype gives a "skipped" row.
    `same_as_eager`: the run equals the backend's graphs-off, overlap-off run bit for
    bit (tokens and logprobs), which tells whether padded graph replay rounds alike."""
    hf, cfg = build_hf(kind, dtype, device)
    prompts = random_prompts(cfg.vocab_size, PROMPT_LENS[kind])
    ref = hf_greedy(hf, prompts, num_steps)
    teacher = ref.tokens if dtype == torch.bfloat16 else None
    backends = [b for b in BACKENDS if b != "flashinfer" or flashinfer_available()]
    eager: dict[str, Run] = {}
    for backend, graphs in itertools.product(backends, (False, True)):
        row = dict(kind=kind, dtype=DTYPE_NAMES[dtype], backend=backend, graphs=graphs,
                   mode="teacher" if teacher else "free", agree=0, total=0, skipped=None)  # fmt: skip
        try:
            with tempfile.TemporaryDirectory() as d:
                core = build_engine(hf, cfg, pathlib.Path(d), dtype=dtype, device=device,
                                    backend=backend, graphs=graphs, fast_init=kind == "8b")  # fmt: skip
        except (ValueError, NotImplementedError) as e:
            yield dict(row, overlap=None, skipped=str(e), problems=[])
            continue
        for overlap in (False, True):
            ours = drive(core, prompts, num_steps, overlap=overlap, teacher=teacher)
            base = eager.setdefault(backend, ours)
            check = check_teacher if teacher else check_free
            agree, total = num_agree(ours, ref)
            yield dict(row, overlap=overlap, agree=agree, total=total,
                       problems=check(ours, ref, dtype),
                       same_as_eager=same_run(ours, base))  # fmt: skip
        del core
        gc.collect()
        torch.cuda.empty_cache()


def same_run(a: Run, b: Run) -> bool:
    return a.tokens == b.tokens and a.top1 == b.top1 and a.margins == b.margins


def _verdict(r: dict) -> str:
    if r["skipped"]:
        return "skipped: " + r["skipped"]
    return "ok" if not r["problems"] else "FAIL " + "; ".join(r["problems"][:3])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kinds", default="small,8b", help="comma-separated: small, 8b")
    ap.add_argument("--steps", type=int, default=64, help="greedy steps per prompt")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_parity needs a CUDA device", file=sys.stderr)
        return 2
    ok = True
    print(f"{'model':6} {'dtype':9} {'backend':10} {'graphs':6} {'overlap':7} {'mode':8} "
          f"{'agree':>9} {'=eager':6} verdict")  # fmt: skip
    for kind in args.kinds.split(","):
        for dtype in (torch.float32, torch.bfloat16):
            for r in parity_rows(kind, dtype, args.steps):
                ok &= not r["problems"]
                print(f"{r['kind']:6} {r['dtype']:9} {r['backend']:10} {r['graphs']!s:6} "
                      f"{r['overlap']!s:7} {r['mode']:8} {r['agree']:>4}/{r['total']:<4} "
                      f"{r.get('same_as_eager', '')!s:6} {_verdict(r)}", flush=True)  # fmt: skip
            gc.collect()
            torch.cuda.empty_cache()
    print("ALL OK" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
