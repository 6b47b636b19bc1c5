"""Short extends over long prefixes: paged extend attention with the GQA group's query
heads packed into one block and the keys split across programs (flash-decoding for a
few new tokens). A GPU path of kernels/attention_extend.py beside
kernels/attention_extend_triton.py, which `attention_extend_triton` hands steps whose
entries have at most SPLIT_MAX_NEW_TOKENS new tokens.

Theory of operation: a step of 32 new tokens over a 2,048-token prefix gives the
one-block-per-query-head kernel 32 programs (one per query head) that each walk all
2,080 keys: the GPU is mostly idle, and each KV head's keys are read once per query
head of its group. Here one program takes (entry, KV head, block of BLOCK_T new
tokens, split): its BLOCK_T x BLOCK_G rows are every (token, query head of the group)
pair, so a block of keys is loaded once for the whole group, and the block's keys
(0 .. its last query's position, cut to the sliding window of its first query) are
divided evenly, in whole BLOCK_N blocks, over the launch's num_splits programs. Each
split keeps an online softmax over its keys (the masks and the update are
attention_extend_triton's `_attend`) and writes its rows' normalized float32 output
and log-sum-exp; a split with no keys for a row writes output 0 and lse -inf. The
merge kernel (one program per token and query head) weighs the splits by
exp(lse - max), MERGE_SPLITS of them at a time. With one split the first kernel writes the output itself and there is
no merge. The number of splits is chosen on the host (the step's longest entry, no
device sync), as the decode kernel chooses it (`choose_num_splits`).

Invariants: those of attention_extend_triton (rows of q are the entries' new tokens in
entry order; each query sees at least its own key). Every (token, query head) row is
written by every split, so the merge reads no stale partial; the split holding a
query's own key has a finite lse, so the merge's denominator is positive.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shunter.kernels.attention_decode_triton import (
    INTERPRETED,
    _num_sms,
    choose_num_splits,
    fix_interpreter_loop_bounds,
)
from shunter.kernels.attention_extend_triton import ExtendMeta, _attend
from shunter.kernels.page_layout import check_attention_operands, new_output

if INTERPRETED:
    fix_interpreter_loop_bounds()

# Steps whose entries have at most this many new tokens take this kernel. 0 (none)
# until it has run on a GPU: checked against the references under the interpreter and
# compiled for sm_90 (254 registers, no spills), not yet timed; 64 is the bound meant
# (the 128-row block holds 32 tokens of a 4-head group, two blocks at most)
SPLIT_MAX_NEW_TOKENS = 0
# Splits the merge reads at a time (a fixed block: one build of the merge kernel)
MERGE_SPLITS = 16


@triton.jit(do_not_specialize=["num_splits"])
def _extend_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    mid_o_ptr,
    mid_lse_ptr,
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
    num_heads,
    num_kv_heads,
    num_splits,
    scale,
    head_dim,
    group,
    window,
    HAS_WINDOW: tl.constexpr,
    DIRECT: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    e = (pid // num_kv_heads).to(tl.int64)
    kvh = pid % num_kv_heads
    mblk = tl.program_id(1)
    split = tl.program_id(2)
    num_new = tl.load(num_new_ptr + e)
    seq_len = tl.load(seq_len_ptr + e)
    q_start = tl.load(q_start_ptr + e).to(tl.int64)
    prefix = seq_len - num_new
    r = tl.arange(0, BLOCK_T * BLOCK_G)
    tok = mblk * BLOCK_T + r // BLOCK_G  # [M] the row's new token
    g = r % BLOCK_G
    rm = (tok < num_new) & (g < group)
    h = kvh * group + g  # [M] its query head
    d = tl.arange(0, BLOCK_D)
    dm = d < head_dim
    rows = q_start + tok
    mask = rm[:, None] & dm[None, :]
    q = tl.load(
        q_ptr + rows[:, None] * q_tok_stride + h[:, None] * q_head_stride + d[None, :],
        mask=mask,
        other=0.0,
    ).to(k_ptr.dtype.element_ty)  # [M, D]
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = prefix + tok
    first_q = prefix + mblk * BLOCK_T
    # the block's keys (none for a block past the entry's new tokens), then this split's
    kv_end = tl.where(mblk * BLOCK_T < num_new, tl.minimum(seq_len, first_q + BLOCK_T), 0)
    kv_start = 0
    if HAS_WINDOW:
        kv_start = tl.maximum(first_q - window + 1, 0)
    span = tl.maximum(kv_end - kv_start, 0)
    chunk = tl.cdiv(tl.cdiv(span, num_splits), BLOCK_N) * BLOCK_N
    lo = kv_start + split * chunk
    hi = tl.minimum(lo + chunk, kv_end)
    # whole blocks of keys before the block's first query need no causal mask; a split
    # that ends before first_q ends on a block boundary
    free_end = tl.minimum(lo + tl.maximum(first_q - lo, 0) // BLOCK_N * BLOCK_N, hi)
    m_i = tl.full([BLOCK_T * BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_T * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_T * BLOCK_G, BLOCK_D], tl.float32)
    kv_base = kvh.to(tl.int64) * cache_head_stride
    table_row = table_ptr + tl.load(row_ptr + e).to(tl.int64) * table_stride
    for n0 in range(lo, free_end, BLOCK_N):
        m_i, l_i, acc = _attend(
            q, m_i, l_i, acc, k_ptr, v_ptr, table_row, kv_base, n0, hi, q_pos, d, dm,
            cache_slot_stride, scale, window, False, HAS_WINDOW, IEEE, UPCAST, BLOCK_N,
        )  # fmt: skip
    for n0 in range(free_end, hi, BLOCK_N):
        m_i, l_i, acc = _attend(
            q, m_i, l_i, acc, k_ptr, v_ptr, table_row, kv_base, n0, hi, q_pos, d, dm,
            cache_slot_stride, scale, window, True, HAS_WINDOW, IEEE, UPCAST, BLOCK_N,
        )  # fmt: skip
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if DIRECT:
        tl.store(
            out_ptr + rows[:, None] * out_tok_stride + h[:, None] * out_head_stride + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=mask,
        )
    else:
        mid = (rows * num_heads + h) * num_splits + split  # [M]
        tl.store(mid_o_ptr + mid[:, None] * BLOCK_D + d[None, :], o, mask=mask)
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(mid_lse_ptr + mid, lse, mask=rm)


@triton.jit(do_not_specialize=["num_splits"])
def _extend_merge_kernel(
    mid_o_ptr,
    mid_lse_ptr,
    out_ptr,
    out_tok_stride,
    out_head_stride,
    num_heads,
    num_splits,
    head_dim,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    row0 = (t * num_heads + h) * num_splits
    m = tl.full([1], float("-inf"), tl.float32)
    den = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):  # BLOCK_S splits at a time, rescaled as they come
        sp = s0 + tl.arange(0, BLOCK_S)
        lse = tl.load(mid_lse_ptr + row0 + sp, mask=sp < num_splits, other=float("-inf"))
        has = lse > float("-inf")  # splits with no keys for the row weigh 0
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.where(has, tl.exp(lse - m_safe), 0.0)
        o = tl.load(mid_o_ptr + (row0 + sp)[:, None] * BLOCK_D + d[None, :], mask=has[:, None],
                    other=0.0)  # fmt: skip
        alpha = tl.exp(m - m_safe)
        acc = acc * alpha + tl.sum(o * w[:, None], 0)
        den = den * alpha + tl.sum(w, 0)
        m = m_new
    o = acc / den
    tl.store(
        out_ptr + t * out_tok_stride + h * out_head_stride + d,
        o.to(out_ptr.dtype.element_ty),
        mask=d < head_dim,
    )


def split_launch(group: int, block_d: int, elem_bytes: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_G, num_warps): the group's heads padded to a power of two, and as
    many new tokens beside them as fill 128 rows (64 for float32 pools or heads over
    128, whose tiles would not fit shared memory), at least 16 rows for the dot. Not by
    the step's length: a short step pads its block (the kernel waits on memory, not the
    dot), and one shape per model is one build of the kernel, at warm-up."""
    block_g = triton.next_power_of_2(group)
    rows = 64 if elem_bytes > 2 or block_d > 128 else 128
    block_t = max(rows // block_g, triton.cdiv(16, block_g), 1)
    return block_t, block_g, 8 if block_t * block_g >= 128 else 4


def attention_extend_split_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: ExtendMeta,
    scale: float,
    *,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, H, D]; k_cache, v_cache: [num_slots, Hkv, D] (the new tokens' K/V already
    stored) -> [T, H, D] (into `out` when given). num_splits: splits of each block's
    keys, else chosen here."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    check_attention_operands(q, k_cache, v_cache)
    out = new_output(q, out)
    num_entries = meta.rows.shape[0]
    if num_tokens == 0 or num_entries == 0:
        return out
    group = num_heads // num_kv_heads
    block_d = max(triton.next_power_of_2(head_dim), 16)
    block_t, block_g, num_warps = split_launch(group, block_d, k_cache.element_size())
    num_blocks = triton.cdiv(meta.max_num_new, block_t)
    max_len = meta.max_seq_len
    block_n = 64
    if num_splits is None:
        num_splits = choose_num_splits(num_entries * num_blocks, num_kv_heads, max_len,
                                       _num_sms(q.device))  # fmt: skip
    num_splits = max(1, min(num_splits, triton.cdiv(max_len, block_n)))
    direct = num_splits == 1
    if direct:
        mid_o = mid_lse = out  # unused
    else:
        mid_o = torch.empty((num_tokens * num_heads * num_splits, block_d),
                            dtype=torch.float32, device=q.device)  # fmt: skip
        mid_lse = torch.empty((num_tokens * num_heads * num_splits,), dtype=torch.float32,
                              device=q.device)  # fmt: skip
    _extend_split_kernel[(num_entries * num_kv_heads, num_blocks, num_splits)](
        q,
        k_cache,
        v_cache,
        out,
        mid_o,
        mid_lse,
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
        num_heads,
        num_kv_heads,
        num_splits,
        scale,
        head_dim,
        group,
        sliding_window or 0,
        HAS_WINDOW=sliding_window is not None,
        DIRECT=direct,
        IEEE=k_cache.dtype == torch.float32 or INTERPRETED,
        UPCAST=INTERPRETED,
        BLOCK_T=block_t,
        BLOCK_G=block_g,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        num_warps=num_warps,
        num_stages=2,
    )
    if not direct:
        _extend_merge_kernel[(num_tokens, num_heads)](
            mid_o,
            mid_lse,
            out,
            out.stride(0),
            out.stride(1),
            num_heads,
            num_splits,
            head_dim,
            BLOCK_S=MERGE_SPLITS,
            BLOCK_D=block_d,
        )
    return out
