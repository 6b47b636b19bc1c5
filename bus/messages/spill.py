"""Host tier of the KV cache: copies between the device pool and the host pool.

The cache manager owns the bookkeeping of both tiers (which host page holds which
tokens, which copies are in flight); the executor performs the copies and answers each
request with exactly one reply, in the order the requests came. A key is a page's
block hash (a chain over page token ids, bus/messages/cache.py), so it names the
content, not where the page lives.

A copy's pages stay put while it is in flight: the device pages a SpillPages reads are
not evicted before its PagesSpilled, and the device pages a LoadPages writes reach no
request before its PagesLoaded (the requests that match them get their Matched then).
"""

from __future__ import annotations

from shunter.bus.messages.base import Msg


class SpillPages(Msg, tag="spill.request"):
    """Copy device pages to host pages (a write-through backup of cached pages)."""

    copy_id: int
    keys: list[int]
    device_pages: list[int]
    host_pages: list[int]  # as many as device_pages; host_pages[i] gets device_pages[i]


class PagesSpilled(Msg, tag="spill.done"):
    copy_id: int
    keys: list[int]
    ok: bool = True
    error: str = ""  # why the copy failed, when ok is False


class LoadPages(Msg, tag="spill.load"):
    """Copy host pages back into device pages (a match reaching past the device tier)."""

    copy_id: int
    keys: list[int]
    host_pages: list[int]
    device_pages: list[int]  # as many as host_pages; device_pages[i] gets host_pages[i]
    prefetch: bool = False


class PagesLoaded(Msg, tag="spill.loaded"):
    copy_id: int
    keys: list[int]
    ok: bool = True
    error: str = ""
