"""Where a decode entry's keys fall among the split-KV programs, and how the splits'
partial results are merged: the helpers kernels/attention_decode_triton.py's split
kernel shares with its merge, and the merge kernel.

Theory of operation: an entry's kv_len keys are divided evenly, in whole BLOCK_N
blocks, over the launch's num_splits splits (`split_keys`), cut to a sliding window;
the splits with keys are a contiguous run (`active_splits`). Each writes a float32
partial output and its log-sum-exp; a merge weighs the partials by exp(lse - max)
(`merge_partials` for one KV head's query heads inside a split program, or
`decode_merge_kernel`, one program per entry and query head, as a second launch).
A split with no keys wrote nothing and is never read.
"""

from __future__ import annotations

import triton
import triton.language as tl

from shunter.kernels.pdl import pdl_enter


@triton.jit
def split_keys(kv_len, split, num_splits, window, HAS_WINDOW: tl.constexpr,
                BLOCK_N: tl.constexpr):  # fmt: skip
    """[start, end) of the keys split(s) `split` (a scalar or a vector) attend: an
    entry's own keys divided evenly, in whole blocks, over the splits, cut to the window."""
    chunk = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, kv_len)
    if HAS_WINDOW:
        start = tl.maximum(start, kv_len - window)
    return start, end


@triton.jit
def active_splits(kv_len, num_splits, window, HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
    """[lo, hi): the splits `split_keys` gives keys to (a contiguous run)."""
    chunk = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    hi = tl.cdiv(kv_len, chunk)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(kv_len - window, 0) // chunk
    return lo, hi


@triton.jit
def merge_partials(mid_o_ptr, mid_lse_ptr, row0, lo, hi, gm, d, dm,
                    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """[G, D] merge of splits lo..hi-1's partials (rows row0 + split, [G]), read past
    L1 (other programs wrote them)."""
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for sp in range(lo, hi):
        row = row0 + sp
        lse = tl.load(mid_lse_ptr + row, mask=gm, other=0.0, cache_modifier=".cg")
        o = tl.load(mid_o_ptr + row[:, None] * BLOCK_D + d[None, :],
                    mask=gm[:, None] & dm[None, :], other=0.0, cache_modifier=".cg")  # fmt: skip
        m_new = tl.maximum(m, lse)
        alpha = tl.exp(m - m_new)
        w = tl.exp(lse - m_new)
        acc = acc * alpha[:, None] + o * w[:, None]
        den = den * alpha + w
        m = m_new
    return acc / tl.where(gm, den, 1.0)[:, None]


@triton.jit(do_not_specialize=["num_splits"])
def decode_merge_kernel(
    mid_o_ptr,
    mid_lse_ptr,
    lens_ptr,
    out_ptr,
    out_b_stride,
    out_h_stride,
    num_heads,
    num_splits,
    head_dim,
    window,
    HAS_WINDOW: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    # the splits stage 1 gave keys to (the same ranges); the others wrote nothing
    kv_len = tl.load(lens_ptr + b).to(tl.int32)
    start, end = split_keys(kv_len, sp, num_splits, window, HAS_WINDOW, BLOCK_N)
    sm = (sp < num_splits) & (start < end)
    row = (b * num_heads + h) * num_splits + sp  # [S]
    lse = tl.load(mid_lse_ptr + row, mask=sm, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(sm, tl.exp(lse - m), 0.0)  # skipped splits weigh 0
    o = tl.load(mid_o_ptr + row[:, None] * BLOCK_D + d[None, :], mask=sm[:, None], other=0.0)
    o = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(
        out_ptr + b * out_b_stride + h * out_h_stride + d,
        o.to(out_ptr.dtype.element_ty),
        mask=d < head_dim,
    )
