"""GPU check: the Triton kernels at real shapes against their torch references, and
their speed against the measured HBM copy bandwidth. (The model on the GPU against HF
transformers, over every engine variant, is ops/gpu_parity.py.)

Theory of operation: two parts, each adding to one JSON report. (1) A large
device-to-device copy gives the bandwidth ceiling (bytes read + written over time).
(2) Each kernel runs on random bf16 data at Llama-3-8B shapes; its output is compared
with the `<op>_ref` (or float64 SDPA) under a stated bf16 tolerance, then it and the
torch path of the same op are timed (median of CUDA-event timings, L2 flushed before
each repetition); the bytes each kernel must move give its achieved bandwidth.

Run on a CUDA machine: python -m shunter.ops.gpu_check [--out report.json] [--quick].
Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from shunter.kernels.attention_decode import attention_decode_torch, plan_decode
from shunter.kernels.attention_decode_triton import attention_decode_triton
from shunter.kernels.attention_extend import attention_extend_torch, extend_meta, plan_extend
from shunter.kernels.attention_extend_triton import attention_extend_triton
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
    copy_gbs: float,
    num_new: list[int],
    seq_lens: list[int],
    launch: tuple | None = None,
    split: bool | None = None,
) -> dict:
    scale = HEAD_DIM**-0.5
    tables, num_slots = _paged_tables(seq_lens, 16)
    kc, vc = _rand(num_slots, NUM_KV, HEAD_DIM), _rand(num_slots, NUM_KV, HEAD_DIM)
    q = _rand(sum(num_new), NUM_HEADS, HEAD_DIM)
    plan = plan_extend(num_new, seq_lens, tables, device=DEV, build_masks=True)
    meta = extend_meta(plan, DEV)
    new_slots = torch.cat([t[s - n :] for t, n, s in zip(tables, num_new, seq_lens, strict=True)])
    kn, vn = kc[new_slots], vc[new_slots]  # the new tokens' K/V, for the torch path
    out = attention_extend_triton(q, None, None, kc, vc, meta, scale, launch=launch, split=split)
    n0, s0 = num_new[0], seq_lens[0]
    rows = torch.arange(0, n0, 97, device=DEV)  # float64 reference on every 97th row
    err = rel_err(out[rows], _sdpa64(q[rows], kc, vc, tables[0], s0 - n0 + rows, scale))
    pairs = sum(n * (s - n) + n * (n + 1) / 2 for n, s in zip(num_new, seq_lens, strict=True))
    nbytes = q.numel() * 4 + sum(seq_lens) * 2 * NUM_KV * HEAD_DIM * 2
    name = "extend page16" + (" M{}/N{}/w{}/s{}".format(*launch) if launch else "")
    name += {None: "", True: " split", False: " per-head"}[split]
    t_torch = (
        bench_ms(lambda: attention_extend_torch(q, kn, vn, kc, vc, plan, scale), 10)
        if not launch and split is None
        else 0
    )
    return _row(name, f"{len(num_new)}x new{n0} seq{s0}", err, TOL_ATTENTION, nbytes,
                bench_ms(lambda: attention_extend_triton(q, None, None, kc, vc, meta, scale,
                                                         launch=launch, split=split), 20),
                t_torch, copy_gbs, flops=4 * NUM_HEADS * HEAD_DIM * pairs)  # fmt: skip


def kernel_checks(copy_gbs: float, quick: bool) -> list[dict]:
    rows = _check_norm_act(copy_gbs) + _check_rope_kv(copy_gbs)
    decode_cases = [(64, 4096, 16), (64, 4096, 1), (1, 131072, 16), (256, 1024, 16)]
    for bsz, length, page in decode_cases[: 2 if quick else None]:
        rows.append(_check_decode(copy_gbs, bsz, length, page))
    rows.append(_check_extend(copy_gbs, [4096] * 4, [4096] * 4))
    rows.append(_check_extend(copy_gbs, [512] * 4, [16384] * 4))
    for split in (False, True):  # a short extend over a long prefix: both kernels
        rows.append(_check_extend(copy_gbs, [32], [2080], split=split))
        rows.append(_check_extend(copy_gbs, [64] * 4, [4160] * 4, split=split))
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="write the JSON report here")
    ap.add_argument("--quick", action="store_true", help="fewer decode shapes")
    ap.add_argument("--sweep", action="store_true", help="also time other launch shapes")
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
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    ok = all(r["ok"] for r in report["kernels"])
    print("ALL OK" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
