"""Paged decode attention as Triton kernels, split-KV (flash-decoding) for long
contexts: the GPU path of kernels/attention_decode.py.

Theory of operation: stage 1 runs one program per (entry, KV head, split); it takes
the entry's query heads that share that KV head (GQA group, padded to 16 rows for
the tensor-core dot), walks its split of the entry's KV in blocks of BLOCK_N token
slots gathered through the plan's slot index (a padded [B, max_len] index, or row
rows[b] of a row table; any page size: a slot is read per token, each row one
contiguous Hkv*D run), and keeps an online softmax. With one split it writes the
output directly; otherwise it writes a float32 partial output and its log-sum-exp,
and stage 2 (one program per entry and query head) merges the splits; both stages'
split arithmetic lives in kernels/attention_decode_merge_triton.py. The number of
splits is chosen on the host from the plan's length bound (no device sync) to give
the GPU about four programs per multiprocessor; each entry divides its own kv_len
over them (read on the device), so a captured step balances whatever lengths it
replays with.

With `MERGE_IN_SPLIT` the merge runs inside stage 1 instead, with no second launch:
each split with keys writes its partial, then takes a ticket from its (entry, KV
head)'s counter (an atomic add that releases its stores); the split that draws the
last ticket reads the others' partials (its acquire makes them visible) and writes
the output, then puts the counter back to 0 for the next launch. An entry whose keys
fit one split writes its output directly either way. Off until measured faster.

With a `RopeStore` (kernels/attention_decode.py's `attention_decode_rope_store`) the
query arrives unrotated: every program rotates its query heads at the entry's last
position (kv_len - 1) as it loads them, and the split holding that position first
rotates the entry's new key, stores it and the new value at the token's slot, and
then reads them back through the slot index like any other key (a CTA barrier orders
its threads' stores before its loads). That replaces the rope + KV store kernel of a
decode layer; the rounding is that kernel's (rotation in float32, rounded to the
activation dtype, then cast to the pool's).

Both kernels launch with programmatic dependent launch on Hopper (kernels/pdl.py).

Invariants: the plan's kv_lens[b] >= 1 and its first kv_lens[b] index cells are valid
slots (the runner checks before the step); a split with no keys (past the entry's
length, or before its window) writes nothing, and the merge, which recomputes the same
ranges from kv_lens, reads only the others. A captured step splits by the table's
width, so for a short context most splits are empty: they cost a program start, not a
store and a load. Scores and the softmax are float32; P is rounded to V's dtype for
the second dot (the usual flash-attention trade, inside the bf16 tolerance).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from shunter.kernels.attention_decode import DecodePlan, RopeStore
from shunter.kernels.attention_decode_merge_triton import (
    active_splits,
    decode_merge_kernel,
    merge_partials,
    split_keys,
)
from shunter.kernels.page_layout import check_attention_operands, new_output
from shunter.kernels.pdl import pdl_args, pdl_enter, use_pdl

MIN_KEYS_PER_SPLIT = 256
# The last split of each (entry, KV head) merges, with no merge kernel; measured no
# faster in an 8B step on an H200 (BENCHMARKS.md), so off.
MERGE_IN_SPLIT = False
# Measured on an H200 (one entry of 131072 keys, 8 KV heads): 2 programs per SM reached
# 54% of the copy bandwidth, 4 reached 89%, 8 and 16 fewer (79%, 55%).
PROGRAMS_PER_SM = 4
# Triton 3.6's CPU interpreter computes bf16/fp16 dots wrongly (it reads the operands'
# bits as integers); interpreted runs take the dots in float32 instead. Compiled
# kernels keep the operands' dtype.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def fix_interpreter_loop_bounds() -> None:
    """Under TRITON_INTERPRET=1, Triton 3.6 turns a loaded scalar used as a `range`
    bound into an int with int(array of shape (1,)), which numpy >= 2.4 rejects. Take
    the one element instead. No effect on compiled kernels."""
    from triton.runtime import interpreter

    if getattr(interpreter, "_shunter_index_fixed", False):
        return
    patch = interpreter._patch_lang_tensor

    def patched(tensor, scope):  # type: ignore[no-untyped-def]
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    interpreter._shunter_index_fixed = True


if INTERPRETED:
    fix_interpreter_loop_bounds()


@triton.jit(do_not_specialize=["num_splits"])
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    idx_ptr,
    rows_ptr,
    lens_ptr,
    out_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    ticket_ptr,
    new_k_ptr,
    new_v_ptr,
    new_slot_ptr,
    cs_ptr,
    q_b_stride,
    q_h_stride,
    new_k_b_stride,
    new_k_h_stride,
    new_v_b_stride,
    new_v_h_stride,
    cs_row_stride,
    out_b_stride,
    out_h_stride,
    cache_slot_stride,
    cache_head_stride,
    idx_b_stride,
    num_splits,
    scale,
    head_dim,
    group,
    window,
    HAS_WINDOW: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    DIRECT: tl.constexpr,
    MERGE_IN_SPLIT: tl.constexpr,
    ROPE_STORE: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    kv_len = tl.load(lens_ptr + b).to(tl.int32)
    if HAS_ROWS:
        idx_row = tl.load(rows_ptr + b).to(tl.int64)
    else:
        idx_row = b
    start, end = split_keys(kv_len, split, num_splits, window, HAS_WINDOW, BLOCK_N)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gm = g < group
    dm = d < head_dim
    heads = kvh * group + g  # [G] query heads of this KV head
    q_rows = q_ptr + b * q_b_stride + heads[:, None] * q_h_stride
    q = tl.load(q_rows + d[None, :], mask=gm[:, None] & dm[None, :], other=0.0)  # [G, D]
    kv_base = kvh.to(tl.int64) * cache_head_stride
    if ROPE_STORE:  # rotate q at position kv_len - 1; the last split stores the new k, v
        half = head_dim // 2
        first = d < half
        partner = tl.where(first, d + half, d - half)  # the other half's element
        cs_row = cs_ptr + (kv_len - 1).to(tl.int64) * cs_row_stride + tl.where(first, d, partner)
        cos = tl.load(cs_row, mask=dm, other=0.0)
        sin = tl.load(cs_row + half, mask=dm, other=0.0)
        sin = tl.where(first, -sin, sin)
        q_p = tl.load(q_rows + partner[None, :], mask=gm[:, None] & dm[None, :], other=0.0)
        q = (q.to(tl.float32) * cos[None, :] + q_p.to(tl.float32) * sin[None, :]).to(q.dtype)
        lo, hi = active_splits(kv_len, num_splits, window, HAS_WINDOW, BLOCK_N)
        if split == hi - 1:
            k_row = new_k_ptr + b * new_k_b_stride + kvh * new_k_h_stride
            k_new = tl.load(k_row + d, mask=dm, other=0.0)
            k_p = tl.load(k_row + partner, mask=dm, other=0.0)
            k_new = (k_new.to(tl.float32) * cos + k_p.to(tl.float32) * sin).to(k_new.dtype)
            v_row = new_v_ptr + b * new_v_b_stride + kvh * new_v_h_stride
            v_new = tl.load(v_row + d, mask=dm, other=0.0)
            slot = tl.load(new_slot_ptr + b).to(tl.int64)
            cell = slot * cache_slot_stride + kv_base + d
            tl.store(k_ptr + cell, k_new.to(k_ptr.dtype.element_ty), mask=dm)
            tl.store(v_ptr + cell, v_new.to(v_ptr.dtype.element_ty), mask=dm)
            tl.debug_barrier()  # the stores land before this program's loads read them
    q = q.to(k_ptr.dtype.element_ty)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    idx_base = idx_ptr + idx_row * idx_b_stride
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        nm = offs < end
        slots = tl.load(idx_base + offs, mask=nm, other=0).to(tl.int64)
        kv_off = slots[:, None] * cache_slot_stride + kv_base + d[None, :]  # [N, D]
        k = tl.load(k_ptr + kv_off, mask=nm[:, None] & dm[None, :], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(nm[None, :], s * scale, float("-inf"))  # [G, N]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_off, mask=nm[:, None] & dm[None, :], other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    om = gm[:, None] & dm[None, :]
    out_rows = out_ptr + b * out_b_stride + heads[:, None] * out_h_stride + d[None, :]
    if DIRECT:
        tl.store(out_rows, o.to(out_ptr.dtype.element_ty), mask=om)
    elif MERGE_IN_SPLIT:
        lo, hi = active_splits(kv_len, num_splits, window, HAS_WINDOW, BLOCK_N)
        if hi - lo == 1:  # the entry's only split with keys: no partial, no merge
            if start < end:
                tl.store(out_rows, o.to(out_ptr.dtype.element_ty), mask=om)
        elif start < end:
            row0 = (b * tl.num_programs(1) * group + heads) * num_splits  # [G]
            tl.store(mid_o_ptr + (row0 + split)[:, None] * BLOCK_D + d[None, :], o, mask=om)
            lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
            tl.store(mid_lse_ptr + row0 + split, lse, mask=gm)
            tl.debug_barrier()  # every thread's stores are issued before the release
            ticket = ticket_ptr + b * tl.num_programs(1) + kvh
            if tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu") == hi - lo - 1:
                merged = merge_partials(mid_o_ptr, mid_lse_ptr, row0, lo, hi, gm, d, dm,
                                         BLOCK_G, BLOCK_D)  # fmt: skip
                tl.store(out_rows, merged.to(out_ptr.dtype.element_ty), mask=om)
                tl.atomic_xchg(ticket, 0, sem="relaxed", scope="gpu")  # ready for the next launch
    elif start < end:  # a split with no keys writes nothing: the merge skips it
        row = (b * tl.num_programs(1) * group + heads) * num_splits + split  # [G] in [B*H*S]
        tl.store(mid_o_ptr + row[:, None] * BLOCK_D + d[None, :], o, mask=om)
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(mid_lse_ptr + row, lse, mask=gm)


_TICKETS: dict[torch.device, torch.Tensor] = {}


def _tickets(device: torch.device, n: int) -> torch.Tensor:
    """[>= n] int32 zeros on `device`, one counter per (entry, KV head), shared by every
    launch (each launch leaves its counters at 0). Made before a graph captures it."""
    t = _TICKETS.get(device)
    if t is None or t.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("decode attention: run once before capturing a larger batch")
        t = _TICKETS[device] = torch.zeros(max(n, 1 << 14), dtype=torch.int32, device=device)
    return t


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a few splits, so that the merge is exercised


def choose_num_splits(batch: int, num_kv_heads: int, max_len: int, num_sms: int) -> int:
    """Splits per (entry, KV head): up to PROGRAMS_PER_SM programs per multiprocessor
    (rounded down, so a batch that already fills the GPU is not split), no split
    shorter than MIN_KEYS_PER_SPLIT keys."""
    want = PROGRAMS_PER_SM * num_sms // max(batch * num_kv_heads, 1)
    return max(1, min(want, triton.cdiv(max_len, MIN_KEYS_PER_SPLIT)))


def merge_width(num_splits: int, num_kv_heads: int, device: torch.device) -> int:
    """The merge's block of splits: wide enough for the most splits any launch on this
    device and model is given (or `num_splits`, if more), so that it is one build of the
    merge kernel, not one per power of two a step's lengths lead to."""
    return max(_widest_merge(num_kv_heads, device), triton.next_power_of_2(num_splits))


@functools.cache
def _widest_merge(num_kv_heads: int, device: torch.device) -> int:
    """next_power_of_2 of the most splits any launch on `device` gets (once per model:
    merge_width runs for every eager decode attention)."""
    return triton.next_power_of_2(choose_num_splits(1, num_kv_heads, 1 << 30, _num_sms(device)))


def attention_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: DecodePlan,
    scale: float,
    *,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    merge_in_split: bool | None = None,
    rope_store: RopeStore | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [B, H, D]; k_cache, v_cache: [num_slots, Hkv, D] -> [B, H, D].
    `plan` from `plan_decode` (its kv_indices and kv_lens on q's device); its mask is
    not read: padding is cut by kv_lens and the window by `sliding_window`.
    merge_in_split: None takes MERGE_IN_SPLIT. rope_store: q is unrotated, and the new
    token's k and v are rotated / stored here (the module docstring). out: [B, H, D]
    (last axis contiguous) to write into, else a new tensor."""
    bsz, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    check_attention_operands(q, k_cache, v_cache)
    idx = plan.kv_indices
    has_rows = plan.rows is not None
    assert idx.stride(-1) == 1 and idx.device == q.device
    if has_rows:
        assert plan.rows.shape[0] == bsz and plan.max_len is not None
    else:
        assert idx.shape[0] == bsz
    out = new_output(q, out)
    if bsz == 0:
        return out
    group = num_heads // num_kv_heads
    max_len = plan.max_len if has_rows else idx.shape[1]
    if num_splits is None:
        num_splits = choose_num_splits(bsz, num_kv_heads, max_len, _num_sms(q.device))
    block_n = 64
    chunk = triton.cdiv(triton.cdiv(max_len, num_splits), block_n) * block_n
    num_splits = triton.cdiv(max_len, chunk)  # no split that even the longest entry leaves empty
    block_d = max(triton.next_power_of_2(head_dim), 16)
    direct = num_splits == 1
    in_split = MERGE_IN_SPLIT if merge_in_split is None else merge_in_split
    pdl = use_pdl(q)
    tickets = _tickets(q.device, bsz * num_kv_heads) if in_split and not direct else plan.kv_lens
    rs = rope_store
    if rs is not None:
        assert rs.k.shape == (bsz, num_kv_heads, head_dim) and rs.v.shape == rs.k.shape
        assert rs.k.stride(-1) == 1 and rs.v.stride(-1) == 1
        assert rs.slots.shape == (bsz,) and rs.cos_sin_cache.dtype == torch.float32
        assert rs.cos_sin_cache.shape[-1] == head_dim and head_dim % 2 == 0
    if direct:
        mid_o = mid_lse = out  # unused
    else:
        mid_o = torch.empty(
            (bsz * num_heads * num_splits, block_d), dtype=torch.float32, device=q.device
        )
        mid_lse = torch.empty((bsz * num_heads * num_splits,), dtype=torch.float32, device=q.device)
    _decode_split_kernel[(bsz, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        idx,
        plan.rows if has_rows else plan.kv_lens,  # unread without rows
        plan.kv_lens,
        out,
        mid_o,
        mid_lse,
        tickets,
        rs.k if rs else q,  # unread without a RopeStore
        rs.v if rs else q,
        rs.slots if rs else plan.kv_lens,
        rs.cos_sin_cache if rs else q,
        q.stride(0),
        q.stride(1),
        rs.k.stride(0) if rs else 0,
        rs.k.stride(1) if rs else 0,
        rs.v.stride(0) if rs else 0,
        rs.v.stride(1) if rs else 0,
        rs.cos_sin_cache.stride(0) if rs else 0,
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        idx.stride(0),
        num_splits,
        scale,
        head_dim,
        group,
        sliding_window or 0,
        HAS_WINDOW=sliding_window is not None,
        HAS_ROWS=has_rows,
        DIRECT=direct,
        MERGE_IN_SPLIT=in_split,
        ROPE_STORE=rs is not None,
        IEEE=k_cache.dtype == torch.float32 or INTERPRETED,
        UPCAST=INTERPRETED,
        BLOCK_G=max(triton.next_power_of_2(group), 16),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        num_warps=4,
        **pdl_args(pdl),
    )
    if not direct and not in_split:
        decode_merge_kernel[(bsz, num_heads)](
            mid_o,
            mid_lse,
            plan.kv_lens,
            out,
            out.stride(0),
            out.stride(1),
            num_heads,
            num_splits,
            head_dim,
            sliding_window or 0,
            HAS_WINDOW=sliding_window is not None,
            BLOCK_N=block_n,
            BLOCK_S=merge_width(num_splits, num_kv_heads, q.device),
            BLOCK_D=block_d,
            **pdl_args(pdl),
        )
    return out
