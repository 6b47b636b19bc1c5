"""GPU check: the Triton kernels at real shapes against their torch references, their
speed against the measured HBM copy bandwidth, and the model forward on CUDA against
HF transformers with the same weights.

Theory of operation: three parts, each printing a table and adding to one JSON
report. (1) A large device-to-device copy gives the bandwidth ceiling (bytes read +
written over time). (2) Each kernel runs on random bf16 data at Llama-3-8B shapes;
its output is compared with the `<op>_ref` (or float64 SDPA) under a stated bf16
tolerance, then it and the torch path of the same op are timed (median of CUDA-event
timings, L2 flushed before each repetition); the bytes each kernel must move give
its achieved bandwidth. (3) Dummy-weight Llama models (a small one, and the 8B shape
with fewer layers) are built in transformers, copied into our LlamaForCausalLM, and
run through ModelRunner over a paged KV pool on CUDA, once on the wired path (each
op's CUDA dispatch: the Triton kernels) and once with the ops' torch paths swapped
into the model's modules (what CUDA ran before the dispatch). Decoding is teacher-
forced on HF's greedy tokens, so every step compares our argmax with HF's token at
the same context; a disagreement is reported with HF's top-2 logit margin there.

Run on a CUDA machine: python -m shunter.ops.gpu_check [--out report.json] [--quick].
Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import sys
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from shunter.actors.executor.kv_pool import KVPool
from shunter.actors.executor.models import attention as attn_mod
from shunter.actors.executor.models import llama as llama_mod
from shunter.actors.executor.models.config import ModelConfig, from_hf_dict
from shunter.actors.executor.runner import ForwardInput, ModelRunner
from shunter.kernels.attention_decode import attention_decode_torch, plan_decode
from shunter.kernels.attention_decode_triton import attention_decode_triton
from shunter.kernels.attention_extend import attention_extend_torch, plan_extend
from shunter.kernels.attention_extend_triton import attention_extend_triton, extend_meta
from shunter.kernels.kv_store import kv_store_ref, kv_store_torch
from shunter.kernels.kv_store_triton import kv_store_triton
from shunter.kernels.rmsnorm import (
    fused_add_rmsnorm_ref,
    fused_add_rmsnorm_torch,
    rmsnorm_ref,
    rmsnorm_torch,
)
from shunter.kernels.rmsnorm_triton import fused_add_rmsnorm_triton, rmsnorm_triton
from shunter.kernels.rope import (
    apply_rope_ref,
    rope_cos_sin_cache,
    rope_gather_torch,
    rope_rotate_torch,
)
from shunter.kernels.rope_triton import apply_rope_triton
from shunter.kernels.silu_mul import silu_mul_ref, silu_mul_torch
from shunter.kernels.silu_mul_triton import silu_mul_triton

DEV = torch.device("cuda")
BF16 = torch.bfloat16
# bf16 tolerances (max |out - ref| over max(1, |ref|) elementwise, i.e. rtol = atol)
TOL_ELEMENTWISE = 1.6e-2  # two bf16 ulps: rsqrt / exp may differ in the last bit
TOL_ATTENTION = 2e-2  # vs float64 SDPA; P rounded to bf16 before the second dot
# Llama-3-8B shapes
HIDDEN, INTER, NUM_HEADS, NUM_KV, HEAD_DIM = 4096, 14336, 32, 8, 128


def bench_ms(fn: Callable[[], object], reps: int = 50) -> float:
    """Median milliseconds of `fn` over `reps` CUDA-event timings after a warm-up,
    with a 256 MiB write before each to push its inputs out of L2."""
    flush = torch.empty(256 << 20, dtype=torch.int8, device=DEV)
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max(1, |ref|): 'atol = rtol' in one number."""
    o, r = out.double(), ref.double()
    if not torch.isfinite(o).all():
        return math.inf
    return float(((o - r).abs() / r.abs().clamp(min=1.0)).max())


def copy_bandwidth() -> float:
    """GB/s of a 2 GiB device-to-device copy, bytes read + written."""
    src = torch.randn(1 << 29, device=DEV)  # 2 GiB float32
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), reps=20)
    return 2 * src.numel() * 4 / ms / 1e6


def _rand(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.randn(*shape, device=DEV).to(dtype)


def _paged_tables(lens: list[int], page_size: int) -> tuple[list[torch.Tensor], int]:
    pages = [-(-n // page_size) for n in lens]
    perm = torch.randperm(sum(pages) + 1, device=DEV)
    tables, at = [], 0
    for n, p in zip(lens, pages, strict=True):
        slots = perm[at : at + p, None] * page_size + torch.arange(page_size, device=DEV)
        tables.append(slots.reshape(-1)[:n].contiguous())
        at += p
    return tables, (sum(pages) + 1) * page_size


def _sdpa64(q, kc, vc, slots, q_pos, scale):  # [n, H, D] in float64 over one entry's KV
    k = kc[slots].double().transpose(0, 1).repeat_interleave(q.shape[1] // kc.shape[1], 0)
    v = vc[slots].double().transpose(0, 1).repeat_interleave(q.shape[1] // kc.shape[1], 0)
    mask = torch.arange(slots.shape[0], device=DEV)[None, :] <= q_pos[:, None]
    o = F.scaled_dot_product_attention(
        q.double().transpose(0, 1), k, v, attn_mask=mask, scale=scale
    )
    return o.transpose(0, 1)


def _row(op, shape, err, tol, nbytes, t_triton, t_torch, copy_gbs, flops=0.0) -> dict:
    gbs = nbytes / t_triton / 1e6
    return dict(op=op, shape=shape, max_rel_err=err, tol=tol, ok=err <= tol,
                triton_us=t_triton * 1e3, torch_us=t_torch * 1e3, gbs=gbs,
                pct_copy_bw=100 * gbs / copy_gbs,
                tflops=flops / t_triton / 1e9 if flops else None)  # fmt: skip


def _check_norm_act(copy_gbs: float, t: int = 16384) -> list[dict]:
    x, res, w = _rand(t, HIDDEN), _rand(t, HIDDEN), _rand(HIDDEN)
    err = rel_err(rmsnorm_triton(x, w, 1e-5), rmsnorm_ref(x, w, 1e-5))
    rows = [_row("rmsnorm", f"{t}x{HIDDEN}", err, TOL_ELEMENTWISE, 2 * x.numel() * 2,
                 bench_ms(lambda: rmsnorm_triton(x, w, 1e-5)),
                 bench_ms(lambda: rmsnorm_torch(x, w, 1e-5)), copy_gbs)]  # fmt: skip
    xs = x.clone()
    y, s = fused_add_rmsnorm_triton(xs, res, w, 1e-5)
    wy, ws = fused_add_rmsnorm_ref(x.clone(), res, w, 1e-5)
    err = max(rel_err(y, wy), rel_err(s, ws))
    rows.append(_row("fused_add_rmsnorm", f"{t}x{HIDDEN}", err, TOL_ELEMENTWISE,
                     4 * x.numel() * 2, bench_ms(lambda: fused_add_rmsnorm_triton(xs, res, w, 1e-5)),
                     bench_ms(lambda: fused_add_rmsnorm_torch(xs, res, w, 1e-5)), copy_gbs))  # fmt: skip
    gu = _rand(t // 4, 2 * INTER)
    err = rel_err(silu_mul_triton(gu), silu_mul_ref(gu))
    rows.append(_row("silu_mul", f"{t // 4}x{2 * INTER}", err, TOL_ELEMENTWISE, gu.numel() * 3,
                     bench_ms(lambda: silu_mul_triton(gu)), bench_ms(lambda: silu_mul_torch(gu)),
                     copy_gbs))  # fmt: skip
    return rows


def _check_rope_kv(copy_gbs: float, t: int = 16384) -> list[dict]:
    q_size, kv_size = NUM_HEADS * HEAD_DIM, NUM_KV * HEAD_DIM
    qkv = _rand(t, q_size + 2 * kv_size)
    q = qkv[:, :q_size].view(t, NUM_HEADS, HEAD_DIM)
    k = qkv[:, q_size : q_size + kv_size].view(t, NUM_KV, HEAD_DIM)
    v = qkv[:, q_size + kv_size :].view(t, NUM_KV, HEAD_DIM)
    cs = rope_cos_sin_cache(HEAD_DIM, 131072, 500000.0).to(DEV)
    pos = torch.randint(0, 131072, (t,), device=DEV)
    wq, wk = apply_rope_ref(q, k, pos, cs)
    qc, kc = q.clone(), k.clone()
    apply_rope_triton(qc, kc, pos, cs)
    err = max(rel_err(qc, wq), rel_err(kc, wk))
    rows = [_row("rope (q+k, in place)", f"{t}x({NUM_HEADS}+{NUM_KV})x{HEAD_DIM}", err,
                 TOL_ELEMENTWISE, 2 * (q.numel() + k.numel()) * 2,
                 bench_ms(lambda: apply_rope_triton(q, k, pos, cs)),
                 bench_ms(lambda: _rope_torch(q, k, pos, cs)), copy_gbs)]  # fmt: skip
    kcache = torch.zeros(2 * t, NUM_KV, HEAD_DIM, dtype=BF16, device=DEV)
    vcache = torch.zeros_like(kcache)
    slots = torch.randperm(2 * t, device=DEV)[:t]
    kv_store_triton(kcache, vcache, slots, k, v)
    wkc, wvc = torch.zeros_like(kcache), torch.zeros_like(vcache)
    kv_store_ref(wkc, wvc, slots, k, v)
    err = 0.0 if torch.equal(kcache, wkc) and torch.equal(vcache, wvc) else math.inf
    rows.append(_row("kv_store", f"{t}x{NUM_KV}x{HEAD_DIM}", err, 0.0, 4 * k.numel() * 2,
                     bench_ms(lambda: kv_store_triton(kcache, vcache, slots, k, v)),
                     bench_ms(lambda: kv_store_torch(kcache, vcache, slots, k, v)), copy_gbs))  # fmt: skip
    return rows


def _check_decode(
    copy_gbs: float, bsz: int, length: int, page: int, num_splits: int | None = None
) -> dict:
    scale = HEAD_DIM**-0.5
    tables, num_slots = _paged_tables([length] * bsz, page)
    kc, vc = _rand(num_slots, NUM_KV, HEAD_DIM), _rand(num_slots, NUM_KV, HEAD_DIM)
    q = _rand(bsz, NUM_HEADS, HEAD_DIM)
    plan = plan_decode(tables, device=DEV, build_mask=True)  # the mask for the torch path
    out = attention_decode_triton(q, kc, vc, plan, scale, num_splits=num_splits)
    last = torch.tensor([length - 1], device=DEV)
    err = max(rel_err(out[b : b + 1], _sdpa64(q[b : b + 1], kc, vc, tables[b], last, scale))
              for b in range(0, bsz, max(1, bsz // 4)))  # fmt: skip
    nbytes = bsz * length * (2 * NUM_KV * HEAD_DIM * 2 + 8)  # K, V and the slot index
    name = f"decode page{page}" + (f" splits={num_splits}" if num_splits else "")
    t_torch = (
        bench_ms(lambda: attention_decode_torch(q, kc, vc, plan, scale), 10)
        if not num_splits
        else 0
    )
    return _row(name, f"B{bsz} L{length}", err, TOL_ATTENTION, nbytes,
                bench_ms(lambda: attention_decode_triton(q, kc, vc, plan, scale,
                                                         num_splits=num_splits), reps=30),
                t_torch, copy_gbs)  # fmt: skip


def _check_extend(
    copy_gbs: float, num_new: list[int], seq_lens: list[int], launch: tuple | None = None
) -> dict:
    scale = HEAD_DIM**-0.5
    tables, num_slots = _paged_tables(seq_lens, 16)
    kc, vc = _rand(num_slots, NUM_KV, HEAD_DIM), _rand(num_slots, NUM_KV, HEAD_DIM)
    q = _rand(sum(num_new), NUM_HEADS, HEAD_DIM)
    plan = plan_extend(num_new, seq_lens, tables, device=DEV, build_masks=True)
    meta = extend_meta(plan, DEV)
    new_slots = torch.cat([t[s - n :] for t, n, s in zip(tables, num_new, seq_lens, strict=True)])
    kn, vn = kc[new_slots], vc[new_slots]  # the new tokens' K/V, for the torch path
    out = attention_extend_triton(q, None, None, kc, vc, meta, scale, launch=launch)
    n0, s0 = num_new[0], seq_lens[0]
    rows = torch.arange(0, n0, 97, device=DEV)  # float64 reference on every 97th row
    err = rel_err(out[rows], _sdpa64(q[rows], kc, vc, tables[0], s0 - n0 + rows, scale))
    pairs = sum(n * (s - n) + n * (n + 1) / 2 for n, s in zip(num_new, seq_lens, strict=True))
    nbytes = q.numel() * 4 + sum(seq_lens) * 2 * NUM_KV * HEAD_DIM * 2
    name = "extend page16" + (" M{}/N{}/w{}/s{}".format(*launch) if launch else "")
    t_torch = (
        bench_ms(lambda: attention_extend_torch(q, kn, vn, kc, vc, plan, scale), 10)
        if not launch
        else 0
    )
    return _row(name, f"{len(num_new)}x new{n0} seq{s0}", err, TOL_ATTENTION, nbytes,
                bench_ms(lambda: attention_extend_triton(q, None, None, kc, vc, meta, scale,
                                                         launch=launch), 20),
                t_torch, copy_gbs, flops=4 * NUM_HEADS * HEAD_DIM * pairs)  # fmt: skip


def kernel_checks(copy_gbs: float, quick: bool) -> list[dict]:
    rows = _check_norm_act(copy_gbs) + _check_rope_kv(copy_gbs)
    decode_cases = [(64, 4096, 16), (64, 4096, 1), (1, 131072, 16), (256, 1024, 16)]
    for bsz, length, page in decode_cases[: 2 if quick else None]:
        rows.append(_check_decode(copy_gbs, bsz, length, page))
    rows.append(_check_extend(copy_gbs, [4096] * 4, [4096] * 4))
    rows.append(_check_extend(copy_gbs, [512] * 4, [16384] * 4))
    return rows


def launch_sweep(copy_gbs: float) -> list[dict]:
    """Split counts for one long decode, block shapes for long extends."""
    rows = [_check_decode(copy_gbs, 1, 131072, 16, n) for n in (66, 132, 264, 528)]
    for launch in [(64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 4, 3),
                   (128, 128, 8, 2), (64, 128, 4, 2), (128, 32, 4, 3)]:  # fmt: skip
        rows.append(_check_extend(copy_gbs, [4096] * 4, [4096] * 4, launch))
        rows.append(_check_extend(copy_gbs, [512] * 4, [16384] * 4, launch))
    return rows


def _rope_torch(q, k, pos, cs):  # the torch rope of the model's CPU path, on CUDA tensors
    cos, sin = rope_gather_torch(cs, pos)
    return rope_rotate_torch(q, cos, sin), rope_rotate_torch(k, cos, sin)


@contextlib.contextmanager
def torch_path() -> Iterator[None]:
    """Swap the ops' torch paths into the model's modules (what CUDA ran before the
    dispatch to the Triton kernels); the plans then build their SDPA masks. Restores
    the dispatching ops after."""
    swaps = [
        (llama_mod, "rmsnorm", rmsnorm_torch),
        (llama_mod, "fused_add_rmsnorm", fused_add_rmsnorm_torch),
        (llama_mod, "silu_mul", silu_mul_torch),
        (llama_mod, "rope_gather", rope_gather_torch),
        (llama_mod, "rope_rotate", rope_rotate_torch),
        (attn_mod, "kv_store", kv_store_torch),
        (attn_mod, "attention_decode", attention_decode_torch),
        (attn_mod, "attention_extend", attention_extend_torch),
        (attn_mod, "plan_decode", functools.partial(plan_decode, build_mask=True)),
        (attn_mod, "plan_extend", functools.partial(plan_extend, build_masks=True)),
    ]
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in swaps]
    for mod, name, fn in swaps:
        setattr(mod, name, fn)
    try:
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def build_empty_model(config: ModelConfig, dtype: torch.dtype) -> llama_mod.LlamaForCausalLM:
    """Our model with uninitialised parameters on the GPU (the loader's own helper needs
    structlog, which the device image lacks)."""
    prev = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype)
        with torch.device("meta"):
            model = llama_mod.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(prev)
    return model.to_empty(device=DEV).eval().requires_grad_(False)


def hf_llama(kind: str, dtype: torch.dtype):
    """A seeded dummy-weight transformers Llama on the GPU: "small" (4 layers, hidden
    512, GQA 8/2) or "8b" (Llama-3.1-8B's shapes and rope scaling, 2 layers)."""
    import transformers

    if kind == "small":
        kw = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)  # fmt: skip
    else:
        kw = dict(vocab_size=128256, hidden_size=HIDDEN, intermediate_size=INTER,
                  num_hidden_layers=2, num_attention_heads=NUM_HEADS, num_key_value_heads=NUM_KV,
                  max_position_embeddings=131072, rms_norm_eps=1e-5,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192})  # fmt: skip
    cfg = transformers.LlamaConfig(
        **kw, initializer_range=0.05, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(DEV):
        model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")
    with torch.no_grad():  # norms away from 1, so their weights matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    return model.to(dtype).eval(), cfg


@torch.inference_mode()
def hf_greedy(model, prompts: list[list[int]], num_steps: int):
    """Per entry: HF's greedy tokens and its [num_steps, vocab] float32 logits
    (a full forward per step: no cache, so no cache-path differences)."""
    tokens, logits = [], []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=DEV)
        rows = []
        for _ in range(num_steps):
            row = model(ids).logits[0, -1].float()
            rows.append(row)
            ids = torch.cat([ids, row.argmax().view(1, 1)], 1)
        tokens.append(ids[0, len(prompt) :].tolist())
        logits.append(torch.stack(rows))
    return tokens, logits


@torch.inference_mode()
def ours_teacher_forced(runner, prompts, hf_tokens, page_size: int) -> list[torch.Tensor]:
    """Our logits per entry [num_steps, vocab], each step fed HF's previous token.
    Entry b starts b forwards late, so forwards mix prefills with decodes."""
    num_steps, num_entries = len(hf_tokens[0]), len(prompts)
    lens = [len(p) + num_steps for p in prompts]
    pages = [-(-n // page_size) for n in lens]
    perm = torch.randperm(runner.kv_pool.num_pages)[: sum(pages)]
    tables, at = [], 0
    for n in pages:
        tables.append((perm[at : at + n, None] * page_size + torch.arange(page_size)).reshape(-1))
        at += n
    out = [[None] * num_steps for _ in prompts]
    for f in range(num_steps + num_entries - 1):
        ents = [b for b in range(num_entries) if 0 <= f - b < num_steps]
        ids, prefix = [], []
        for b in ents:
            i = f - b
            ids.append(prompts[b] if i == 0 else [hf_tokens[b][i - 1]])
            prefix.append(0 if i == 0 else len(prompts[b]) + i - 1)
        logits = runner.forward(ForwardInput.build(ids, prefix, [tables[b] for b in ents]))
        for j, b in enumerate(ents):
            out[b][f - b] = logits[j]
    return [torch.stack(rows) for rows in out]


def compare(hf_tokens, hf_logits, ours) -> dict:
    """Greedy agreement of our argmax with HF's tokens; HF's top-2 margin where not."""
    num_agree = total = 0
    margins, max_diff = [], 0.0
    for toks, hl, ol in zip(hf_tokens, hf_logits, ours, strict=True):
        ref = torch.tensor(toks, device=DEV)
        agree = ol.argmax(-1) == ref
        num_agree += int(agree.sum())
        total += len(toks)
        max_diff = max(max_diff, float((ol - hl).abs().max()))
        top2 = hl.topk(2, -1).values
        margins += (top2[:, 0] - top2[:, 1])[~agree].tolist()
    # a flip is explained when HF's own top two were closer than our logits' deviation
    return dict(num_agree=num_agree, num_steps=total, max_logit_diff=max_diff,
                margins_at_flips=margins, ok=all(m <= 2 * max_diff for m in margins))  # fmt: skip


def model_checks(quick: bool, num_steps: int) -> list[dict]:
    rows = []
    cases = [("small", torch.float32), ("small", BF16)]
    cases += [] if quick else [("8b", torch.float32), ("8b", BF16)]
    gen = torch.Generator().manual_seed(1)
    for kind, dtype in cases:
        hf, cfg = hf_llama(kind, dtype)
        config = from_hf_dict(cfg.to_dict())
        model = build_empty_model(config, dtype)
        model.load_weights((n, t) for n, t in hf.state_dict().items())
        prompt_lens = [37, 5, 120, 64]
        prompts = [
            torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in prompt_lens
        ]
        hf_tokens, hf_logits = hf_greedy(hf, prompts, num_steps)
        del hf
        for path in ("torch ops", "wired"):
            timed = kind == "8b" and dtype == BF16  # + one decode step of 32 x 2048 context
            pool = KVPool(config, 4200 if timed else 256, page_size=16, dtype=dtype, device=DEV)
            runner = ModelRunner(model, pool)
            ctx = torch_path() if path == "torch ops" else contextlib.nullcontext()
            with ctx:
                ours = ours_teacher_forced(runner, prompts, hf_tokens, 16)
                step_ms = None
                if timed:
                    tabs = [
                        torch.arange(b * 2048, (b + 1) * 2048) % pool.num_slots for b in range(32)
                    ]
                    inp = ForwardInput.build([[1]] * 32, [2047] * 32, tabs)
                    step_ms = bench_ms(lambda inp=inp, r=runner: r.forward(inp), reps=20)
            res = compare(hf_tokens, hf_logits, ours)
            rows.append(dict(model=kind, dtype=str(dtype).split(".")[-1], path=path,
                             decode_step_ms_b32_ctx2048=step_ms, **res))  # fmt: skip
            del pool, runner
        del model
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="write the JSON report here")
    ap.add_argument("--quick", action="store_true", help="fewer shapes, no 8B-shape model")
    ap.add_argument("--sweep", action="store_true", help="also time other launch shapes")
    ap.add_argument("--steps", type=int, default=48, help="greedy steps per entry")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check needs a CUDA device", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(DEV)
    report: dict = dict(device=props.name, num_sms=props.multi_processor_count,
                        torch=torch.__version__)  # fmt: skip
    report["copy_gbs"] = copy_bandwidth()
    print(f"{props.name}: D2D copy {report['copy_gbs']:.0f} GB/s (read + write)", flush=True)
    report["kernels"] = kernel_checks(report["copy_gbs"], args.quick)
    if args.sweep:
        report["kernels"] += launch_sweep(report["copy_gbs"])
    print(f"{'op':36} {'shape':24} {'err':>9} {'tol':>7} {'triton us':>10} {'torch us':>10} "
          f"{'GB/s':>7} {'%copy':>6} {'TFLOP/s':>8}")  # fmt: skip
    for r in report["kernels"]:
        tf = f"{r['tflops']:8.1f}" if r["tflops"] else " " * 8
        print(f"{r['op']:36} {r['shape']:24} {r['max_rel_err']:9.2e} {r['tol']:7.1e} "
              f"{r['triton_us']:10.1f} {r['torch_us']:10.1f} {r['gbs']:7.0f} "
              f"{r['pct_copy_bw']:6.1f} {tf} {'ok' if r['ok'] else 'FAIL'}", flush=True)  # fmt: skip
    report["models"] = model_checks(args.quick, args.steps)
    for r in report["models"]:
        flips = ", ".join(f"{m:.3f}" for m in r["margins_at_flips"][:5])
        ms = r["decode_step_ms_b32_ctx2048"]
        print(f"model {r['model']:5} {r['dtype']:8} {r['path']:9}: greedy {r['num_agree']}/"
              f"{r['num_steps']} agree, max |dlogit| {r['max_logit_diff']:.3f}, "
              f"HF margins at flips [{flips}]" + (f", decode step {ms:.2f} ms" if ms else "")
              + f" {'ok' if r['ok'] else 'FAIL'}")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    ok = all(r["ok"] for r in report["kernels"]) and all(r["ok"] for r in report["models"])
    print("ALL OK" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
