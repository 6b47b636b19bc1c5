"""Row indices: the executor's per-request slots, allocated and recycled here.

Invariants
    - A row is in exactly one place: free, held by a request, or closing (released by
      its request, its close not yet sent to the executor).
    - A closing row's close goes out with the next batch. The executor applies a
      batch's closes before its opens, so when no row is free a closing row may be
      opened again in that same batch (it is then both closed and opened there).
    - Allocation takes the smallest free row (a min-heap): deterministic, and it keeps
      the executor's live rows dense at the low end.
"""

from __future__ import annotations

import heapq

import msgspec


class RowStatistics(msgspec.Struct, frozen=True):
    max_rows: int
    num_free: int
    num_held: int
    num_closing: int


class RowAllocator:
    def __init__(self, max_rows: int) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows: must be >= 1, got {max_rows}")
        self.max_rows = max_rows
        self._free = list(range(max_rows))  # a valid heap already
        self._held: set[int] = set()
        self._closing: list[int] = []
        self._reopened: set[int] = set()  # closing rows opened again in the next batch

    @property
    def num_free(self) -> int:
        """Rows the next batch can open (free ones and closing ones not yet reopened)."""
        return len(self._free) + len(self._closing) - len(self._reopened)

    def alloc(self) -> int:
        if self._free:
            row = heapq.heappop(self._free)
        else:
            spare = [r for r in self._closing if r not in self._reopened]
            if not spare:
                raise RuntimeError("no free row (admission must respect max_running_requests)")
            row = min(spare)
            self._reopened.add(row)
        self._held.add(row)
        return row

    def release(self, row: int) -> None:
        """The request left its row; its close goes out with the next batch."""
        if row not in self._held:
            raise RuntimeError(f"row {row} released but not held")
        self._held.remove(row)
        self._closing.append(row)

    def take_closes(self) -> list[int]:
        """Closes for the batch being built; those rows become free for later batches."""
        closes, self._closing = self._closing, []
        for row in closes:
            if row not in self._reopened:
                heapq.heappush(self._free, row)
        self._reopened.clear()
        return closes

    def statistics(self) -> RowStatistics:
        return RowStatistics(self.max_rows, self.num_free, len(self._held), len(self._closing))
