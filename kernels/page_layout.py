"""Host-side paged-KV layout for the paged attention wrappers (flashinfer's
kv_indptr / kv_indices / kv_last_page_len and the ragged qo_indptr).

An entry with kv_len tokens owns ceil(kv_len / page_size) pages; its page ids are
the first slots of those pages in the executor's slot table, divided by page_size.
`kv_page_layout` and `extend_qo_indptr` are host int32 arrays built from lengths;
`kv_page_indices` gathers the page ids on the table's device with ops whose output
sizes are known on the host, so nothing waits for the device. `to_device` is how a
plan's host tensors reach a GPU: a plain copy from pageable memory waits for the work
queued before it (the forward in flight), so it goes through pinned memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def kv_page_layout(kv_lens: Sequence[int], page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Host int32 (kv_indptr [B+1], kv_last_page_len [B]) of entries with these KV
    lengths (each >= 1): entry b owns ceil(len_b / page_size) pages."""
    lens = torch.as_tensor(list(kv_lens), dtype=torch.int64)
    if page_size < 1 or (lens.numel() and int(lens.min()) < 1):
        raise ValueError(f"need page_size >= 1 and KV lengths >= 1 (page_size {page_size})")
    num_pages = (lens + page_size - 1) // page_size
    indptr = torch.zeros(lens.numel() + 1, dtype=torch.int32)
    torch.cumsum(num_pages, 0, out=indptr[1:])
    last = (lens - (num_pages - 1) * page_size).to(torch.int32)
    return indptr, last


def extend_qo_indptr(num_new_tokens: Sequence[int]) -> torch.Tensor:
    """Host int32 [B+1]: where each entry's new tokens start in the query rows."""
    indptr = torch.zeros(len(num_new_tokens) + 1, dtype=torch.int32)
    torch.cumsum(torch.as_tensor(list(num_new_tokens), dtype=torch.int64), 0, out=indptr[1:])
    return indptr


def kv_page_indices(
    table: torch.Tensor,
    rows: torch.Tensor,
    kv_lens: Sequence[int],
    page_size: int,
    stage: Callable[[list[torch.Tensor]], torch.Tensor] | None = None,
) -> torch.Tensor:
    """[nnz] int32 page ids on table's device: for entry b, the pages of slots
    table[rows[b], 0:kv_lens[b]:page_size], in order.

    table: [num_rows, max_ctx] int32/int64 token slots (a page's tokens sit in
    consecutive slots from a multiple of page_size); rows: [B] int on table's device.
    Only B-sized metadata crosses to the device and every output size comes from the
    host lengths, so no call waits for the device. stage: copies host int64 vectors
    to the device as one concatenation (the runner's pinned stager, so the copy is
    truly asynchronous); by default a plain non-blocking copy each."""
    pages = [(n + page_size - 1) // page_size for n in kv_lens]
    if len(pages) != rows.shape[0] or rows.device != table.device:
        raise ValueError(f"{len(pages)} kv lengths for rows {list(rows.shape)} on {rows.device}")
    nnz = sum(pages)
    if nnz == 0:
        return torch.empty(0, dtype=torch.int32, device=table.device)
    counts = torch.tensor(pages, dtype=torch.int64)
    first = torch.cumsum(counts, 0) - counts  # [B] host: each entry's first output index
    b = counts.shape[0]
    if stage is not None:
        both = stage([counts, first])
        counts, first = both[:b], both[b:]
    else:
        counts = counts.to(table.device, non_blocking=True)
        first = first.to(table.device, non_blocking=True)
    # per entry (row, first output index), repeated once per page of the entry
    per_entry = torch.stack([rows.to(torch.int64), first], 1)
    per_page = torch.repeat_interleave(per_entry, counts, dim=0, output_size=nnz)  # [nnz, 2]
    col = (torch.arange(nnz, dtype=torch.int64, device=table.device) - per_page[:, 1]) * page_size
    slots = table[per_page[:, 0], col]  # [nnz] first slot of each page
    return torch.div(slots, page_size, rounding_mode="floor").to(torch.int32)


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device: through pinned memory
    and an asynchronous copy on CUDA (the caching host allocator keeps the pinned
    block until the copy ran), a plain `.to` elsewhere."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type == "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def check_attention_operands(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """What the Triton attention kernels assume of their operands: q [..., H, D] with a
    contiguous dim axis; k_cache, v_cache [num_slots, Hkv, D], contiguous and alike; H a
    multiple of Hkv."""
    assert q.stride(-1) == 1, "attention needs q's dim axis contiguous"
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.stride() == v_cache.stride() and k_cache.shape[2] == q.shape[-1]
    assert q.shape[-2] % k_cache.shape[1] == 0


def new_output(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """Where an attention kernel writes its [..., H, D] result: `out` (checked to have
    q's shape and dtype and a contiguous last axis), else a new tensor like q."""
    if out is None:
        return torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    return out
