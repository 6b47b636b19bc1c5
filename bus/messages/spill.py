"""Spill manager: host and disk tiers of the KV cache, keyed by content.

A key is a hash chain over page token ids (parent key, then the page's ids), so it does
not depend on where the page lives. The executor performs copies; the spill manager
owns the bookkeeping.
"""

from __future__ import annotations

from shunter.bus.messages.base import Msg


class SpillPages(Msg, tag="spill.request"):
    """Copy device pages to the host tier (write-through or before eviction)."""

    copy_id: int
    keys: list[int]
    device_pages: list[int]
    host_pages: list[int]


class PagesSpilled(Msg, tag="spill.done"):
    copy_id: int
    keys: list[int]
    ok: bool = True


class LoadPages(Msg, tag="spill.load"):
    """Copy host pages back into device pages (load-back or prefetch)."""

    copy_id: int
    keys: list[int]
    host_pages: list[int]
    device_pages: list[int]
    prefetch: bool = False


class PagesLoaded(Msg, tag="spill.loaded"):
    copy_id: int
    keys: list[int]
    ok: bool = True
