"""Paged extend (prefill) attention as one Triton kernel: the GPU path of
kernels/attention_extend.py.

Theory of operation: one program per (block of BLOCK_M new tokens, entry, query
head). The block's queries are at positions prefix + i; the program walks the
entry's keys 0 .. min(seq_len, prefix + end of block) - 1 (keys past the block's last
query are never read), gathering each block of BLOCK_N keys through the entry's row
of the metadata's slot table (ExtendMeta: a padded copy, or the runner's row table),
masks k_pos > q_pos (and keys outside the sliding window), and keeps an online softmax
in float32. The new tokens' K/V were stored in the pool before the call, so the
cached prefix and the new tokens are read the same way. A step of a few new tokens
per entry leaves most of the GPU idle here (one program per query head walking the
whole prefix); `attention_extend_triton` hands those to the GQA-packed
split-KV kernel of kernels/attention_extend_split_triton.py (up to its
SPLIT_MAX_NEW_TOKENS).

Invariants: rows of q are the entries' new tokens concatenated in entry order;
num_new[e] >= 1 and seq_len[e] >= num_new[e] (`plan_extend` checks); each query sees
at least its own key, so every output row has a positive softmax denominator.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shunter.kernels.attention_decode_triton import INTERPRETED, fix_interpreter_loop_bounds
from shunter.kernels.attention_extend import ExtendMeta, ExtendPlan, extend_meta
from shunter.kernels.page_layout import check_attention_operands, new_output

if INTERPRETED:
    fix_interpreter_loop_bounds()


@triton.jit
def _attend(
    q, m_i, l_i, acc, k_ptr, v_ptr, table_row, kv_base, n0, kv_end, q_pos, d, dm,
    cache_slot_stride, scale, window,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One block of BLOCK_N keys into the running softmax (m_i, l_i, acc). CAUSAL
    masks keys past each query and past kv_end; without it every key is allowed."""
    offs = n0 + tl.arange(0, BLOCK_N)
    nm = offs < kv_end
    slots = tl.load(table_row + offs, mask=nm, other=0).to(tl.int64)
    kv_off = slots[:, None] * cache_slot_stride + kv_base + d[None, :]  # [N, D]
    k = tl.load(k_ptr + kv_off, mask=nm[:, None] & dm[None, :], other=0.0)
    v = tl.load(v_ptr + kv_off, mask=nm[:, None] & dm[None, :], other=0.0)
    if UPCAST:
        k, v = k.to(tl.float32), v.to(tl.float32)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    else:
        s = tl.dot(q, tl.trans(k)) * scale
    if CAUSAL:
        s = tl.where(nm[None, :] & (offs[None, :] <= q_pos[:, None]), s, float("-inf"))
    if HAS_WINDOW:
        s = tl.where(offs[None, :] > q_pos[:, None] - window, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing yet
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _extend_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    table_ptr,
    row_ptr,
    q_start_ptr,
    num_new_ptr,
    seq_len_ptr,
    q_tok_stride,
    q_head_stride,
    out_tok_stride,
    out_head_stride,
    cache_slot_stride,
    cache_head_stride,
    table_stride,
    scale,
    head_dim,
    group,
    window,
    HAS_WINDOW: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    mblk = tl.program_id(0)
    e = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2)
    num_new = tl.load(num_new_ptr + e)
    seq_len = tl.load(seq_len_ptr + e)
    q_start = tl.load(q_start_ptr + e).to(tl.int64)
    prefix = seq_len - num_new
    m_offs = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    mm = m_offs < num_new
    d = tl.arange(0, BLOCK_D)
    dm = d < head_dim
    rows = q_start + m_offs
    q = tl.load(
        q_ptr + rows[:, None] * q_tok_stride + h * q_head_stride + d[None, :],
        mask=mm[:, None] & dm[None, :],
        other=0.0,
    ).to(k_ptr.dtype.element_ty)  # [M, D]
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = prefix + m_offs  # [M]
    first_q = prefix + mblk * BLOCK_M
    # a block past the entry's new tokens reads nothing (end <= start)
    kv_end = tl.where(mblk * BLOCK_M < num_new, tl.minimum(seq_len, first_q + BLOCK_M), 0)
    kv_start = 0
    if HAS_WINDOW:
        kv_start = tl.maximum(first_q - window + 1, 0)
    # whole blocks of keys before the block's first query need no causal mask
    free_end = kv_start + tl.maximum(first_q - kv_start, 0) // BLOCK_N * BLOCK_N
    free_end = tl.minimum(free_end, kv_end)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_base = (h // group).to(tl.int64) * cache_head_stride
    table_row = table_ptr + tl.load(row_ptr + e).to(tl.int64) * table_stride
    for n0 in range(kv_start, free_end, BLOCK_N):
        m_i, l_i, acc = _attend(
            q, m_i, l_i, acc, k_ptr, v_ptr, table_row, kv_base, n0, kv_end, q_pos, d, dm,
            cache_slot_stride, scale, window, False, HAS_WINDOW, IEEE, UPCAST, BLOCK_N,
        )  # fmt: skip
    for n0 in range(free_end, kv_end, BLOCK_N):
        m_i, l_i, acc = _attend(
            q, m_i, l_i, acc, k_ptr, v_ptr, table_row, kv_base, n0, kv_end, q_pos, d, dm,
            cache_slot_stride, scale, window, True, HAS_WINDOW, IEEE, UPCAST, BLOCK_N,
        )  # fmt: skip
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + rows[:, None] * out_tok_stride + h * out_head_stride + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=mm[:, None] & dm[None, :],
    )


def extend_launch(max_num_new: int, block_d: int, elem_bytes: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): short extends get short query blocks
    (less padding); long 16-bit ones with heads up to 128 the block shape measured
    fastest on an H200 (128 x 128, 8 warps: 266 TFLOP/s on 4 x 4096 causal tokens at the
    8B head shape, 221 with 64 x 64 and 4 warps). A float32 pool with 128 x 128 blocks
    asked for 256 KiB of shared memory (the H200 has 227 KiB), so it keeps 64 x 64."""
    if max_num_new <= 16:
        return 16, 64, 4, 2
    if max_num_new <= 64 or elem_bytes > 2 or block_d > 128:
        return 64, 64, 4, 2
    return 128, 128, 8, 2


def attention_extend_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: ExtendPlan | ExtendMeta,
    scale: float,
    *,
    sliding_window: int | None = None,
    launch: tuple[int, int, int, int] | None = None,
    split: bool | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D] (this step's new tokens, already in the pool, so
    not read here); k_cache, v_cache: [num_slots, Hkv, D] -> [T, H, D].
    launch: (BLOCK_M, BLOCK_N, num_warps, num_stages), else chosen by `extend_launch`.
    split: whether the GQA-packed split-KV kernel (attention_extend_split_triton.py)
    runs instead; None: when no entry has more than its SPLIT_MAX_NEW_TOKENS new tokens
    and no `launch` is given. out: [T, H, D] (last axis contiguous) to write into, else
    a new tensor."""
    del k, v  # read back from the pool, where kv_store put them
    from shunter.kernels import attention_extend_split_triton as short

    meta = plan if isinstance(plan, ExtendMeta) else extend_meta(plan, q.device)
    if split is None:
        split = launch is None and meta.max_num_new <= short.SPLIT_MAX_NEW_TOKENS
    if split:
        return short.attention_extend_split_triton(
            q, k_cache, v_cache, meta, scale, sliding_window=sliding_window, out=out
        )
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    check_attention_operands(q, k_cache, v_cache)
    out = new_output(q, out)
    num_entries = meta.rows.shape[0]
    if num_tokens == 0 or num_entries == 0:
        return out
    block_d = max(triton.next_power_of_2(head_dim), 16)
    block_m, block_n, num_warps, num_stages = launch or extend_launch(
        meta.max_num_new, block_d, k_cache.element_size()
    )
    grid = (triton.cdiv(meta.max_num_new, block_m), num_entries, num_heads)
    _extend_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        meta.table,
        meta.rows,
        meta.q_starts,
        meta.num_new,
        meta.seq_lens,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        meta.table.stride(0),
        scale,
        head_dim,
        num_heads // num_kv_heads,
        sliding_window or 0,
        HAS_WINDOW=sliding_window is not None,
        IEEE=k_cache.dtype == torch.float32 or INTERPRETED,
        UPCAST=INTERPRETED,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
