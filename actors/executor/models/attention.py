"""Per-step attention context: where this step's K/V go and how each layer attends.

Theory of operation: the runner builds one AttentionContext per forward step from
the batch's slot tables. Entries with one new token (decode) are attended together
through a padded decode plan; entries with several new tokens (prefill / extend) go
through the extend plan. Both plans are built once and shared by every layer, so the
per-layer cost is the KV store plus one or two attention calls.

With a device row table (actors/executor/slot_table.py) the decode plan and the Triton
extend kernel's metadata read the entries' rows of that table instead of a padded
copy of their slot tables. Under the flashinfer backend one planned flashinfer
wrapper (`ctx.flashinfer`) attends every entry of the step: its decode wrapper when
all entries decode, else its prefill wrapper (a decode entry is an extend of one
token there). An all-decode step the runner gives to the Triton kernel instead
(`--decode-attention-backend`, runner.py) comes with a row decode plan and no wrapper.

Invariants: `out_slots[t]` is the slot of new token t; decode_rows and extend_rows
partition range(num_tokens) (either may be empty, then its plan is None); when
`flashinfer` is set both plans are None.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shunter.kernels.attention_decode import (
    DecodePlan,
    attention_decode,
    plan_decode,
    plan_decode_rows,
)
from shunter.kernels.attention_extend import (
    ExtendMeta,
    ExtendPlan,
    attention_extend,
    plan_extend,
)
from shunter.kernels.kv_store import kv_store
from shunter.kernels.page_layout import to_device


@dataclass(frozen=True)
class AttentionContext:
    k_buffers: list[torch.Tensor]  # per layer [num_slots, Hkv, D]
    v_buffers: list[torch.Tensor]
    out_slots: torch.Tensor  # [num_tokens] int64
    decode_plan: DecodePlan | None
    extend_plan: ExtendPlan | None
    # the decode and extend entries' token rows: slices when each kind is one run of
    # entries (the scheduler puts decodes after the prefill pieces), else [num] int64
    # indices; None if all or none
    decode_rows: torch.Tensor | slice | None
    extend_rows: torch.Tensor | slice | None
    # a planned flashinfer attention (kernels/attention_flashinfer.py) and which of its
    # wrappers runs: "decode", "prefill" (no cached prefix) or "extend"
    flashinfer: Any = None
    flashinfer_mode: str = "decode"

    @property
    def decode_only(self) -> bool:
        """Every entry is one token, attended by the decode kernels (not flashinfer)."""
        return self.flashinfer is None and self.extend_plan is None and self.decode_plan is not None


@dataclass(frozen=True)
class RowDecode:
    """The decode entries' rows of a device slot table (see the module docstring)."""

    table: torch.Tensor  # [num_rows + 1, width] int32
    rows: torch.Tensor  # [num_decode] int64, on the device
    lens: torch.Tensor  # [num_decode] int64, on the device
    max_len: int  # host bound on lens


def build_attention_context(
    k_buffers: list[torch.Tensor],
    v_buffers: list[torch.Tensor],
    num_new_tokens: list[int],
    seq_lens: list[int],
    slot_tables: list[torch.Tensor],
    *,
    device: torch.device,
    sliding_window: int | None = None,
    out_slots: torch.Tensor | None = None,
    row_decode: RowDecode | None = None,
    extend_meta: ExtendMeta | None = None,
) -> AttentionContext:
    """out_slots: the new tokens' slots already on the device (else gathered here);
    row_decode: read the decode entries' KV through a device row table; extend_meta:
    the extend entries' Triton metadata over that table (an ExtendMeta), else built
    from their slot tables."""
    if out_slots is None:
        out_slots = to_device(
            torch.cat(
                [
                    t[s - n : s]
                    for t, n, s in zip(slot_tables, num_new_tokens, seq_lens, strict=True)
                ]
            ),
            device,
        )
    dec = [i for i, n in enumerate(num_new_tokens) if n == 1]
    ext = [i for i, n in enumerate(num_new_tokens) if n != 1]
    decode_plan = extend_plan = None
    decode_rows = extend_rows = None
    if dec and row_decode is not None:
        r = row_decode
        decode_plan = plan_decode_rows(
            r.table, r.rows, r.lens, max_len=r.max_len, sliding_window=sliding_window
        )
    elif dec:
        decode_plan = plan_decode(
            [slot_tables[i][: seq_lens[i]] for i in dec],
            device=device,
            sliding_window=sliding_window,
        )
    if ext:
        extend_plan = plan_extend(
            [num_new_tokens[i] for i in ext],
            [seq_lens[i] for i in ext],
            [slot_tables[i][: seq_lens[i]] for i in ext],
            device=device,
            sliding_window=sliding_window,
            device_meta=extend_meta,
        )
    if dec and ext and _one_run(dec) and _one_run(ext):  # two runs of rows: slices
        num_dec, num_ext = len(dec), sum(num_new_tokens[i] for i in ext)
        if dec[0] == 0:
            decode_rows, extend_rows = slice(0, num_dec), slice(num_dec, num_dec + num_ext)
        else:
            extend_rows, decode_rows = slice(0, num_ext), slice(num_ext, num_ext + num_dec)
    elif dec and ext:
        starts = [0]
        for n in num_new_tokens:
            starts.append(starts[-1] + n)
        decode_rows = to_device(torch.tensor([starts[i] for i in dec], dtype=torch.int64), device)
        extend_rows = to_device(
            torch.cat([torch.arange(starts[i], starts[i + 1], dtype=torch.int64) for i in ext]),
            device,
        )
    return AttentionContext(
        k_buffers, v_buffers, out_slots, decode_plan, extend_plan, decode_rows, extend_rows
    )


def _one_run(indices: list[int]) -> bool:
    """Whether sorted entry indices are consecutive."""
    return indices[-1] - indices[0] == len(indices) - 1


def paged_attention(
    ctx: AttentionContext,
    layer_idx: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    stored: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D] -> [T, H, D], written into `out` ([T, H, D],
    last axis contiguous) when given. Stores k, v first unless the caller has (`stored`:
    kernels/rope_kv_store.py)."""
    kc, vc = ctx.k_buffers[layer_idx], ctx.v_buffers[layer_idx]
    if not stored:
        kv_store(kc, vc, ctx.out_slots, k, v)
    if ctx.flashinfer is not None:
        if ctx.flashinfer_mode == "decode":
            o = ctx.flashinfer.decode(q, kc, vc, scale)
        elif ctx.flashinfer_mode == "prefill":
            o = ctx.flashinfer.prefill(q, k, v, scale)
        else:
            o = ctx.flashinfer.extend(q, kc, vc, scale)
        return o if out is None else out.copy_(o)
    if ctx.extend_plan is None:
        return attention_decode(q, kc, vc, ctx.decode_plan, scale, out=out)
    if ctx.decode_plan is None:
        return attention_extend(q, k, v, kc, vc, ctx.extend_plan, scale, out=out)
    if out is None:
        out = torch.empty_like(q)
    dr, er = ctx.decode_rows, ctx.extend_rows
    if isinstance(dr, slice):  # views of q and out: no gather, no scatter
        attention_decode(q[dr], kc, vc, ctx.decode_plan, scale, out=out[dr])
        attention_extend(q[er], k[er], v[er], kc, vc, ctx.extend_plan, scale, out=out[er])
        return out
    out[dr] = attention_decode(q[dr], kc, vc, ctx.decode_plan, scale)
    out[er] = attention_extend(q[er], k[er], v[er], kc, vc, ctx.extend_plan, scale)
    return out
