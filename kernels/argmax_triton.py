"""Row argmax as two Triton kernels (the GPU path of kernels/argmax.py).

Theory of operation: stage 1 runs one program per (row, split); a split walks its
contiguous part of the row in blocks, each lane keeping the largest value it saw and
the first index holding it (replaced only by a strictly larger value, so ties keep
the earlier index), then writes the split's maximum and the smallest index among the
lanes holding it. Stage 2 runs one program per
row over its splits' pairs: the largest value, and among equal values the smallest
index. The number of splits gives the GPU a few programs per multiprocessor whatever
the batch size, each split at least one block long.

Invariants: rows have a contiguous last axis and no NaN (a NaN compares false both
ways; torch.argmax would return it); an all -inf row gives index 0, as torch.argmax.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

BLOCK = 2048  # logits per block of a split
PROGRAMS_PER_SM = 4


@triton.jit
def _argmax_split_kernel(x_ptr, val_ptr, idx_ptr, V, x_row_stride, chunk, num_splits,
                         BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    start = split * chunk
    end = tl.minimum(start + chunk, V)
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], -float("inf"), tl.float32)  # per lane: largest value seen
    best_idx = tl.zeros([BLOCK], tl.int32)  # and the first index holding it
    for off in range(start, end, BLOCK):
        cols = off + lanes
        v = tl.load(x_ptr + row * x_row_stride + cols, mask=cols < end, other=-float("inf"))
        take = v.to(tl.float32) > best
        best = tl.where(take, v.to(tl.float32), best)
        best_idx = tl.where(take, cols, best_idx)
    m = tl.max(best, 0)
    first = tl.min(tl.where(best == m, best_idx, 2147483647), 0)
    tl.store(val_ptr + row * num_splits + split, m)
    tl.store(idx_ptr + row * num_splits + split, first)


@triton.jit
def _argmax_merge_kernel(val_ptr, idx_ptr, out_ptr, num_splits, BLOCK_S: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    ok = s < num_splits
    v = tl.load(val_ptr + row * num_splits + s, mask=ok, other=-float("inf"))
    i = tl.load(idx_ptr + row * num_splits + s, mask=ok, other=0)
    m = tl.max(v, 0)
    big = 2147483647
    first = tl.min(tl.where(ok & (v == m), i, big), 0)
    tl.store(out_ptr + row, tl.where(first == big, 0, first).to(tl.int64))


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter
    return torch.cuda.get_device_properties(device).multi_processor_count


def _num_splits(rows: int, vocab: int, device: torch.device) -> int:
    want = max(1, (PROGRAMS_PER_SM * _num_sms(device)) // rows)
    return max(1, min(want, triton.cdiv(vocab, BLOCK), 256))


def argmax_triton(x: torch.Tensor, num_splits: int | None = None) -> torch.Tensor:
    """[B, V] -> [B] int64 index of each row's first maximum."""
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"argmax_triton compares in float32; {x.dtype} would lose ties")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(
            f"argmax_triton needs [B, V] with a contiguous last axis, got {list(x.shape)}"
        )
    b, v = x.shape
    out = torch.empty(b, dtype=torch.int64, device=x.device)
    if b == 0:
        return out
    if v == 0:
        raise ValueError("argmax of an empty row")
    s = num_splits or _num_splits(b, v, x.device)
    chunk = triton.cdiv(triton.cdiv(v, s), BLOCK) * BLOCK
    s = triton.cdiv(v, chunk)  # every split has at least one element
    vals = torch.empty(b, s, dtype=torch.float32, device=x.device)
    idx = torch.empty(b, s, dtype=torch.int32, device=x.device)
    _argmax_split_kernel[(b, s)](x, vals, idx, v, x.stride(0), chunk, s, BLOCK=BLOCK)
    _argmax_merge_kernel[(b,)](vals, idx, out, s, BLOCK_S=triton.next_power_of_2(s))
    return out
