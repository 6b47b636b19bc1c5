"""Paged decode attention: one new query token per entry over that entry's cached KV.

Theory of operation: `plan_decode` turns the entries' slot tables into a padded
[B, max_len] gather index and a [B, 1, 1, max_len] key mask once per step; every layer
reuses that plan. `attention_decode` gathers each layer's K/V through the index and
runs one batched SDPA (grouped-query heads share their KV head, no KV copy per query
head). On CUDA the plan's index and lengths go to the device and no mask is built:
`attention_decode` hands CUDA queries to the split-KV Triton kernel of
kernels/attention_decode_triton.py (imported on first use), which cuts the padding
by kv_lens and applies the plan's sliding window itself.

A plan can also read a row table instead of a padded index: `plan_decode_rows` takes
a [num_rows, width] table of token slots that lives on the device (the executor
keeps one, updating only new tokens' slots per step), the rows of the step's entries
and their lengths; nothing is padded or copied per step, and the plan's tensors keep
their addresses, which is what a CUDA graph replays. The torch path gathers the rows
it needs from the table (one index_select); the Triton kernel reads it directly.

`attention_decode_rope_store` is a decode layer's rope, KV store and attention as one
op: it takes the step's unrotated q|k heads and v, and on CUDA hands them to the Triton
kernel, which rotates and stores as it attends (no separate rope + store launch) when
`FUSE_ROPE_STORE` is on; otherwise, and off CUDA, it is `rope_kv_store` then
`attention_decode`.

Invariants: the query of entry b sits at position kv_lens[b] - 1 and its own K/V are
already in the pool (stored before attention; by the op itself in the fused form);
padding indices point at slot 0 and are masked out. In a row plan,
table[rows[b], :kv_lens[b]] are entry b's slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shunter.kernels.page_layout import to_device
from shunter.kernels.rope_kv_store import rope_kv_store

# Decode layers rotate and store inside the attention kernel: one launch fewer a layer,
# but on an H200 (8B, bs 1 and 64, graphs under PDL) no faster, so off (BENCHMARKS.md).
FUSE_ROPE_STORE = False


@dataclass(frozen=True)
class DecodePlan:
    # [B, max_len] int64 slots padded with 0; in a row plan the [num_rows, width] table
    kv_indices: torch.Tensor
    mask: torch.Tensor | None  # [B, 1, 1, max_len] bool, True = attended; None = all
    kv_lens: torch.Tensor  # [B] int64 (int32 allowed in a row plan)
    sliding_window: int | None = None  # the window the mask holds (the kernel reads this)
    rows: torch.Tensor | None = None  # [B] int64: entry b reads kv_indices[rows[b]]
    max_len: int | None = None  # host bound on kv_lens (a row plan's split count uses it)


@dataclass(frozen=True)
class RopeStore:
    """What the fused decode kernel rotates and stores: the new tokens' unrotated k and
    v ([B, Hkv, D] views of the qkv projection), the rope table and their slots."""

    k: torch.Tensor
    v: torch.Tensor
    cos_sin_cache: torch.Tensor  # [max_pos, D] float32: cos | sin (kernels/rope.py)
    slots: torch.Tensor  # [B] int64


def plan_decode_rows(
    table: torch.Tensor,
    rows: torch.Tensor,
    kv_lens: torch.Tensor,
    *,
    max_len: int,
    sliding_window: int | None = None,
) -> DecodePlan:
    """A plan over a row table (see the module docstring). table: [num_rows, width]
    int32/int64 slots; rows: [B] int64 and kv_lens: [B] on the table's device; max_len:
    a host bound on kv_lens (<= width). Builds nothing on the device."""
    if not 1 <= max_len <= table.shape[1]:
        raise ValueError(f"max_len {max_len} outside [1, {table.shape[1]}]")
    return DecodePlan(table, None, kv_lens, sliding_window, rows=rows, max_len=max_len)


def plan_decode(
    slot_tables: list[torch.Tensor],
    *,
    device: torch.device | str = "cpu",
    sliding_window: int | None = None,
    build_mask: bool | None = None,
) -> DecodePlan:
    """slot_tables: per entry [seq_len] int64 slots of tokens 0..seq_len-1.
    build_mask: whether the SDPA mask is built; by default only off CUDA (the Triton
    kernel does not read it)."""
    if not slot_tables:
        raise ValueError("plan_decode needs at least one entry")
    lens = torch.tensor([t.shape[0] for t in slot_tables], dtype=torch.int64)
    if int(lens.min()) < 1:
        raise ValueError("a decode entry needs at least its own token in the KV")
    idx = torch.nn.utils.rnn.pad_sequence(slot_tables, batch_first=True, padding_value=0)
    pos = torch.arange(idx.shape[1], dtype=torch.int64)
    mask = pos[None, :] < lens[:, None]  # [B, max_len]
    if sliding_window is not None:
        mask &= pos[None, :] > (lens[:, None] - 1 - sliding_window)
    if build_mask is None:
        build_mask = torch.device(device).type != "cuda"
    needed = build_mask and (sliding_window is not None or int(lens.min()) != idx.shape[1])
    return DecodePlan(
        kv_indices=to_device(idx, device),
        mask=mask[:, None, None, :].to(device) if needed else None,
        kv_lens=to_device(lens, device),
        sliding_window=sliding_window,
    )


def attention_decode_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_tables: list[torch.Tensor],
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Entry by entry, explicit softmax(q k^T * scale) v in float32."""
    num_heads = q.shape[1]
    out = torch.empty_like(q)
    for b, slots in enumerate(slot_tables):
        k = k_cache[slots].float()  # [L, Hkv, D]
        v = v_cache[slots].float()
        if sliding_window is not None:
            k, v = k[-sliding_window:], v[-sliding_window:]
        rep = num_heads // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)  # [L, H, D]
        v = v.repeat_interleave(rep, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b].float(), k) * scale
        out[b] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v).to(q.dtype)
    return out


def attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: DecodePlan,
    scale: float,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [B, H, D]; k_cache, v_cache: [num_slots, Hkv, D] -> [B, H, D], written into
    `out` ([B, H, D], last axis contiguous) when given."""
    if q.is_cuda:
        from shunter.kernels.attention_decode_triton import attention_decode_triton

        return attention_decode_triton(
            q, k_cache, v_cache, plan, scale, sliding_window=plan.sliding_window, out=out
        )
    o = attention_decode_torch(q, k_cache, v_cache, plan, scale)
    return o if out is None else out.copy_(o)


def attention_decode_rope_store(
    qk: torch.Tensor,  # [B, H + Hkv, D] unrotated q | k heads, last axis contiguous
    v: torch.Tensor,  # [B, Hkv, D]
    rope: tuple[torch.Tensor, torch.Tensor],  # rope_gather's operands
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [B] int64: the new tokens' slots
    num_q_heads: int,
    plan: DecodePlan,
    scale: float,
) -> torch.Tensor:
    """Rope on q and k at each entry's last position, k and v stored at slots, then
    decode attention: [B, H, D]. On CUDA qk may be rotated in place."""
    if qk.is_cuda and FUSE_ROPE_STORE:
        from shunter.kernels.attention_decode_triton import attention_decode_triton

        rs = RopeStore(qk[:, num_q_heads:], v, rope[1], slots)
        return attention_decode_triton(qk[:, :num_q_heads], k_cache, v_cache, plan, scale,
                                       sliding_window=plan.sliding_window, rope_store=rs)  # fmt: skip
    qk = rope_kv_store(qk, v, rope, k_cache, v_cache, slots, num_q_heads)
    return attention_decode(qk[:, :num_q_heads], k_cache, v_cache, plan, scale)


def attention_decode_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: DecodePlan,
    scale: float,
) -> torch.Tensor:
    """The SDPA path of `attention_decode` (any device; needs the plan's mask)."""
    if plan.rows is not None:
        plan = _gather_rows(plan)
    bsz, num_heads, head_dim = q.shape
    bsz_l = plan.kv_indices.shape
    flat = plan.kv_indices.view(-1)
    # index_select, not advanced indexing: far cheaper for small gathers on the CPU
    k = k_cache.index_select(0, flat).view(*bsz_l, *k_cache.shape[1:]).transpose(1, 2)
    v = v_cache.index_select(0, flat).view(*bsz_l, *v_cache.shape[1:]).transpose(1, 2)
    # k, v: [B, Hkv, L, D]
    if k.dtype != torch.float32 and k.device.type == "cpu":
        k, v = k.float(), v.float()  # torch's reduced-precision CPU attention is far slower
    # Query heads h of one KV head are consecutive (h // group), so the group becomes the
    # query-length axis: [B, Hkv, group, D] attends over [B, Hkv, L, D] with no KV repeat.
    num_kv_heads = k.shape[1]
    qg = q.reshape(bsz, num_kv_heads, num_heads // num_kv_heads, head_dim).to(k.dtype)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=plan.mask, scale=scale)
    return out.reshape(bsz, num_heads, head_dim).to(q.dtype)  # [B, H, D]


def _gather_rows(plan: DecodePlan) -> DecodePlan:
    """A row plan as a padded one: the entries' rows cut to max_len, and their mask."""
    assert plan.max_len is not None
    idx = plan.kv_indices.index_select(0, plan.rows)[:, : plan.max_len].long()
    pos = torch.arange(plan.max_len, device=idx.device)
    lens = plan.kv_lens.long()
    mask = pos[None, :] < lens[:, None]
    if plan.sliding_window is not None:
        mask &= pos[None, :] > (lens[:, None] - 1 - plan.sliding_window)
    idx = torch.where(mask, idx, 0)  # table cells past a row's length may hold stale slots
    return DecodePlan(idx, mask[:, None, None, :], lens, plan.sliding_window)
