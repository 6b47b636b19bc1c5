"""The device copy of the executor's row slot tables, and pinned host staging.

Theory of operation
-------------------
The executor core keeps, per mirror row, the flat KV slot of every token position on
the host. A GPU step should not re-send whole tables: `DeviceSlotTable` keeps a
[num_rows + 1, width] int32 copy on the device and `update(inp)` writes only what a
step changed: every slot of a row that just opened (`ForwardInput.fresh`: its cached
prefix too), and the new tokens' slots of the others. Decode attention then reads
rows of this table by index (kernels/attention_decode.py `plan_decode_rows`), so a
decode step's device inputs are five short vectors, which is what a CUDA graph
replays. The last row is the padding row: its first cell is the pool's padding slot,
so padded graph entries (length 1) read and write only that slot.

Host-to-device copies come from pinned memory with non_blocking=True (a copy from
pageable memory may wait for the device). `PinnedStager` owns a small ring of pinned
buffers; a buffer is reused only after the event recorded behind its last copy has
completed, so the host may run a step or two ahead of the device without overwriting
data the device has not read yet. A staging larger than the buffers grows every
buffer of the ring at once, so a long prefill pays for pinned allocations once, not
again on each of the next `RING` long prefills as their turn comes round.

`device_tensor` (and kernels/page_layout.py's `to_device`) move one small host list
(or tensor) the same way, through a pinned copy, for index vectors outside the stager.

Host vectors come from Python lists of ints (a ForwardBatch's fields): `long_tensor`
builds an int64 tensor from one through an `array` buffer, about nine times faster than
torch.tensor on a list (an 8,192-token prefill stages four such lists).

Invariants: after `update(inp)`, table[row_ids[b], :seq_lens[b]] equals
slot_tables[b][:seq_lens[b]] for every entry b; the padding row's first cell is
`pad_slot`; no method synchronizes the device except to recycle a staging buffer
whose copy is still queued (at most once per `RING` uses).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

from shunter.kernels.page_layout import to_device

RING = 8  # staging buffers; the host runs at most this many copies ahead of the device
# Batches of up to this many entries write their rows' cells as slices (a long prefill:
# one slice copy, no 8k-element index vectors); larger ones in one scatter.
SLICE_MAX_ENTRIES = 8
_ONE_ZERO = torch.zeros(1, dtype=torch.int64)


def long_tensor(values: Sequence[int]) -> torch.Tensor:
    """torch.tensor(values, dtype=torch.int64) for a list of Python ints, built through
    an array buffer (which the tensor keeps alive)."""
    if not values:
        return torch.zeros(0, dtype=torch.int64)
    return torch.frombuffer(array("q", values), dtype=torch.int64)


class PinnedStager:
    """Copies host int64 vectors to the device through a ring of pinned buffers."""

    def __init__(self, device: torch.device, *, min_elems: int = 1 << 12) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._bufs = [self._alloc(min_elems) for _ in range(RING)]
        self._events: list[torch.cuda.Event | None] = [None] * RING
        self._next = 0

    def _alloc(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.int64, pin_memory=self.pinned)

    def _grow(self, n: int) -> None:
        """Every ring buffer to at least n elements, without waiting: a replaced buffer
        whose copy is still queued stays with torch's pinned allocator, which reuses a
        block only after the copies recorded on it have run."""
        for j, b in enumerate(self._bufs):
            if b.numel() < n:
                self._bufs[j] = self._alloc(n)
                self._events[j] = None  # nothing queued reads the new one

    @property
    def capacity(self) -> int:
        """Elements the smallest ring buffer holds."""
        return min(b.numel() for b in self._bufs)

    def stage(self, parts: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        """The concatenation of `parts` (host int64 vectors) on the device, in `out`
        (a device int64 tensor of that many elements) when given."""
        total = sum(p.numel() for p in parts)
        if not self.pinned:  # CPU: nothing to stage
            flat = torch.cat(parts) if len(parts) != 1 else parts[0].reshape(-1)
            if out is None:
                return flat.clone()
            return out.copy_(flat)
        i = self._next
        self._next = (i + 1) % RING
        ev = self._events[i]
        if ev is not None:
            ev.synchronize()  # its last copy must have been read before the buffer is reused
        if self._bufs[i].numel() < total:
            self._grow(max(total, 2 * self._bufs[i].numel()))
        buf = self._bufs[i][:total]
        torch.cat([p.reshape(-1) for p in parts], out=buf)
        if out is None:
            out = torch.empty(total, dtype=torch.int64, device=self.device)
        out.copy_(buf, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self._events[i] = ev
        return out

    def stage_views(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each host int64 vector of `parts` on the device, all in one copy, as views
        that start on 16-byte boundaries: Triton builds a kernel once per alignment of
        its pointer arguments, so a view at an odd offset would cost the step a build
        of its own (a second or more) the first time its parity came round."""
        padded: list[torch.Tensor] = []
        spans: list[tuple[int, int]] = []
        at = 0
        for p in parts:
            n = p.numel()
            padded.append(p.reshape(-1))
            if n % 2:
                padded.append(_ONE_ZERO)
            spans.append((at, n))
            at += n + n % 2
        dev = self.stage(padded)
        return [dev[a : a + n] for a, n in spans]


class DeviceSlotTable:
    """See the module docstring."""

    def __init__(self, num_rows: int, width: int, *, pad_slot: int, device: torch.device) -> None:
        if num_rows < 1 or width < 1:
            raise ValueError(f"a slot table needs rows and width, got {num_rows} x {width}")
        self.num_rows = num_rows
        self.width = width
        self.pad_row = num_rows
        self.pad_slot = pad_slot
        self.device = device
        self.table = torch.zeros(num_rows + 1, width, dtype=torch.int32, device=device)
        self.table[self.pad_row, 0] = pad_slot
        self.stager = PinnedStager(device)

    @property
    def nbytes(self) -> int:
        return self.table.numel() * self.table.element_size()

    def update(
        self,
        row_ids: list[int],
        fresh: list[bool],
        num_new_tokens: list[int],
        seq_lens: list[int],
        slot_tables: list[torch.Tensor],
        out_slots: torch.Tensor | None = None,
    ) -> None:
        """Write what this step changed (see the module docstring). out_slots: the new
        tokens' slots [sum(num_new_tokens)] on the host, when the caller has them (an
        all-decode step then needs no per-entry work)."""
        n = len(row_ids)
        if out_slots is not None and out_slots.shape[0] == n and not any(fresh):
            self.check(row_ids, seq_lens)
            pos = long_tensor(seq_lens) - 1
            dev = self.stager.stage([long_tensor(row_ids), pos, out_slots.long()])
            self.write(dev[:n], dev[n : 2 * n], dev[2 * n :])
            return
        rows: list[int] = []
        starts: list[int] = []
        slots: list[torch.Tensor] = []
        for r, f, n, s, st in zip(row_ids, fresh, num_new_tokens, seq_lens, slot_tables,
                                  strict=True):  # fmt: skip
            if not 0 <= r < self.num_rows or s > self.width:
                raise ValueError(f"row {r} / length {s} outside the {self.num_rows} x "
                                 f"{self.width} slot table")  # fmt: skip
            lo = 0 if f else s - n
            rows.append(r)
            starts.append(lo)
            slots.append(st[lo:s])
        counts = long_tensor([t.shape[0] for t in slots])
        num = int(counts.sum())
        if num == 0:
            return
        if len(rows) <= SLICE_MAX_ENTRIES:  # a slice per entry: only the slots travel
            dev = self.stager.stage([torch.cat(slots).long()])
            off = 0
            for r, lo, st in zip(rows, starts, slots, strict=True):
                self.table[r, lo : lo + st.shape[0]].copy_(dev[off : off + st.shape[0]])
                off += st.shape[0]
            return
        if num == len(rows):  # one cell per entry (decode): no expansion
            row_of, pos_of = long_tensor(rows), long_tensor(starts)
        else:
            row_of = torch.repeat_interleave(long_tensor(rows), counts)
            first = torch.cumsum(counts, 0) - counts
            pos_of = torch.arange(num) - torch.repeat_interleave(first - long_tensor(starts),
                                                                 counts)  # fmt: skip
        dev = self.stager.stage([row_of, pos_of, torch.cat(slots).long()])
        self.write(dev[:num], dev[num : 2 * num], dev[2 * num :])

    def check(self, row_ids: list[int], seq_lens: list[int]) -> None:
        """ValueError unless every row and length fits the table (an index past it
        would fault on the device)."""
        if max(row_ids) >= self.num_rows or min(row_ids) < 0 or max(seq_lens) > self.width:
            raise ValueError(f"a row or length outside the {self.num_rows} x "
                             f"{self.width} slot table")  # fmt: skip

    def write(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """table[rows[i], positions[i]] = slots[i]; all three int64 on the table's device."""
        self.table[rows, positions] = slots.to(torch.int32)


def device_tensor(
    values: Sequence, device: torch.device, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype) on `device`, as to_device moves it."""
    return to_device(torch.tensor(values, dtype=dtype), device)
