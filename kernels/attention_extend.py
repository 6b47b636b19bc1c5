"""Paged extend (prefill) attention: new tokens attend to the entry's cached prefix
and causally to each other.

Theory of operation: entry b has num_new[b] new tokens at positions
seq_len[b] - num_new[b] .. seq_len[b] - 1; new token i sees keys 0..prefix+i. An
entry without a cached prefix attends over its own new K/V directly (causal SDPA, no
gather); one with a prefix gathers its slot table from the pool (the new tokens' K/V
were stored first) and uses a [num_new, seq_len] mask built once in `plan_extend` and
shared by all layers. On CUDA no masks are built: the plan carries the device metadata
(ExtendMeta, built once per step) of the Triton kernel of
kernels/attention_extend_triton.py, and `attention_extend` hands CUDA queries to that
kernel, which applies the causal mask and the plan's sliding window itself. The
metadata's slot table is a padded copy of the plan's (`extend_meta`) or a runner's
device row table, which holds every row's slots already (`extend_meta_rows`).

Invariants: q, k, v rows are the entries' new tokens concatenated in entry order.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from shunter.kernels.page_layout import to_device


@dataclass(frozen=True)
class ExtendPlan:
    num_new_tokens: list[int]
    seq_lens: list[int]
    q_starts: list[int]  # first row of each entry in the concatenated tokens
    slot_tables: list[torch.Tensor]  # per entry [seq_len] int64
    masks: list[torch.Tensor | None]  # per entry [num_new, seq_len] bool, None = plain causal
    sliding_window: int | None = None
    device_meta: ExtendMeta | None = None  # for the Triton kernel (CUDA plans)


def _mask(
    num_new: int, seq_len: int, sliding_window: int | None, device: torch.device | str = "cpu"
) -> torch.Tensor:
    # [num_new, seq_len] bool, True = attended
    prefix = seq_len - num_new
    qpos = torch.arange(num_new, dtype=torch.int64, device=device)[:, None] + prefix
    kpos = torch.arange(seq_len, dtype=torch.int64, device=device)[None, :]
    mask = kpos <= qpos
    if sliding_window is not None:
        mask &= kpos > qpos - sliding_window
    return mask


def plan_extend(
    num_new_tokens: list[int],
    seq_lens: list[int],
    slot_tables: list[torch.Tensor],
    *,
    device: torch.device | str = "cpu",
    sliding_window: int | None = None,
    build_masks: bool | None = None,
    device_meta: ExtendMeta | None = None,
) -> ExtendPlan:
    """build_masks: whether the SDPA masks are built; by default only off CUDA, where
    the plan carries the Triton kernel's metadata instead: `device_meta` when the caller
    has it (an ExtendMeta over its device row table), else built from `slot_tables`."""
    on_cuda = torch.device(device).type == "cuda"
    if build_masks is None:
        build_masks = not on_cuda
    q_starts, masks, start = [], [], 0
    for n, s in zip(num_new_tokens, seq_lens, strict=True):
        if n < 1 or s < n:
            raise ValueError(f"bad extend entry: {n} new tokens, seq_len {s}")
        q_starts.append(start)
        start += n
        windowed = sliding_window is not None and s > sliding_window
        needed = build_masks and (s > n or windowed)
        masks.append(_mask(n, s, sliding_window).to(device) if needed else None)
    plan = ExtendPlan(list(num_new_tokens), list(seq_lens), q_starts, list(slot_tables), masks,
                      sliding_window, device_meta)  # fmt: skip
    if on_cuda and device_meta is None:
        plan = replace(plan, device_meta=extend_meta(plan, torch.device(device)))
    return plan


@dataclass(frozen=True)
class ExtendMeta:
    """The ExtendPlan as device tensors, shared by every layer of a step (see the
    module docstring)."""

    table: torch.Tensor  # [R, W] int32 slots; entry e's are row rows[e], from column 0
    rows: torch.Tensor  # [E] int64
    q_starts: torch.Tensor  # [E] int64
    num_new: torch.Tensor  # [E] int64
    seq_lens: torch.Tensor  # [E] int64
    max_num_new: int
    max_seq_len: int


def extend_meta(plan: ExtendPlan, device: torch.device) -> ExtendMeta:
    """A padded copy of the plan's slot tables and its lengths: two copies to `device`."""
    table = torch.nn.utils.rnn.pad_sequence(
        [t.to(device="cpu", dtype=torch.int32) for t in plan.slot_tables], batch_first=True
    )
    rows = list(range(len(plan.num_new_tokens)))
    fields = torch.tensor(extend_fields(rows, plan.num_new_tokens, plan.seq_lens))
    return extend_meta_rows(to_device(table, device), to_device(fields, device),
                            plan.num_new_tokens, plan.seq_lens)  # fmt: skip


def extend_fields(rows: list[int], num_new_tokens: list[int], seq_lens: list[int]) -> list[int]:
    """The flat int64 fields `extend_meta_rows` reads: four vectors (rows, q_starts,
    num_new, seq_lens), each padded to an even length so that, on a 16-byte boundary,
    all four start on one (Triton builds a kernel per alignment of its pointers)."""
    q_starts = [0]
    for n in num_new_tokens[:-1]:
        q_starts.append(q_starts[-1] + n)
    pad = [0] * (len(rows) % 2)
    return [*rows, *pad, *q_starts, *pad, *num_new_tokens, *pad, *seq_lens, *pad]


def extend_meta_rows(
    table: torch.Tensor, fields: torch.Tensor, num_new_tokens: list[int], seq_lens: list[int]
) -> ExtendMeta:
    """The metadata over a device row table, from `extend_fields` on the device."""
    num_entries = len(num_new_tokens)
    rows, q_starts, num_new, lens = fields.view(4, num_entries + num_entries % 2)[:, :num_entries]
    return ExtendMeta(table, rows, q_starts, num_new, lens, max(num_new_tokens), max(seq_lens))


def attention_extend_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_new_tokens: list[int],
    slot_tables: list[torch.Tensor],
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Explicit float32 softmax over the pool, entry by entry (K/V already stored)."""
    out = torch.empty_like(q)
    start = 0
    for n, slots in zip(num_new_tokens, slot_tables, strict=True):
        s = slots.shape[0]
        k = k_cache[slots].float()
        v = v_cache[slots].float()
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, 1)
        v = v.repeat_interleave(rep, 1)
        scores = torch.einsum("thd,lhd->htl", q[start : start + n].float(), k) * scale
        allowed = _mask(n, s, sliding_window, device=scores.device)
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        out[start : start + n] = torch.einsum("htl,lhd->thd", scores.softmax(-1), v).to(q.dtype)
        start += n
    return out


def attention_extend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: ExtendPlan,
    scale: float,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D] (this step's new tokens, already in the pool);
    k_cache, v_cache: [num_slots, Hkv, D] -> [T, H, D], written into `out` ([T, H, D],
    last axis contiguous) when given."""
    if q.is_cuda:
        from shunter.kernels.attention_extend_triton import attention_extend_triton

        meta = plan.device_meta if plan.device_meta is not None else plan
        return attention_extend_triton(
            q, k, v, k_cache, v_cache, meta, scale, sliding_window=plan.sliding_window, out=out
        )
    o = attention_extend_torch(q, k, v, k_cache, v_cache, plan, scale)
    return o if out is None else out.copy_(o)


def attention_extend_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: ExtendPlan,
    scale: float,
) -> torch.Tensor:
    """The SDPA path of `attention_extend` (any device; needs the plan's masks)."""
    num_heads = q.shape[1]
    gqa = k.shape[1] != num_heads
    out = torch.empty_like(q)
    # torch's reduced-precision CPU attention is far slower than float32
    upcast = q.dtype != torch.float32 and q.device.type == "cpu"
    for n, start, slots, mask in zip(
        plan.num_new_tokens, plan.q_starts, plan.slot_tables, plan.masks, strict=True
    ):
        qe = q[start : start + n].transpose(0, 1)[None]  # [1, H, n, D]
        if mask is None:
            ke = k[start : start + n].transpose(0, 1)[None]  # [1, Hkv, n, D]
            ve = v[start : start + n].transpose(0, 1)[None]
            if upcast:
                qe, ke, ve = qe.float(), ke.float(), ve.float()
            o = F.scaled_dot_product_attention(
                qe, ke, ve, is_causal=True, scale=scale, enable_gqa=gqa
            )
        else:
            ke = k_cache.index_select(0, slots).transpose(0, 1)[None]  # [1, Hkv, seq_len, D]
            ve = v_cache.index_select(0, slots).transpose(0, 1)[None]
            if upcast or (ke.dtype != torch.float32 and ke.device.type == "cpu"):
                qe, ke, ve = qe.float(), ke.float(), ve.float()
            o = F.scaled_dot_product_attention(
                qe.to(ke.dtype), ke, ve, attn_mask=mask, scale=scale, enable_gqa=gqa
            )
        out[start : start + n] = o[0].transpose(0, 1).to(q.dtype)
    return out
