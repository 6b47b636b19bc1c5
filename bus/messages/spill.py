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


# -- the file store below the host tier (--hicache-storage-backend file) ----------------
#
# A block is `block_tokens` consecutive tokens from a multiple of block_tokens, keyed by
# a hash chain over whole blocks (actors/cache_manager/store_tier.py), so its key names
# the prefix it ends, in any page layout. A block moves through host pages: it is written
# from the host pages of a backed-up prefix and read into host pages before a load.


class StorePages(Msg, tag="spill.to_store"):
    """Write blocks from host pages into the file store (one file per block). The host
    pages are not reused before the PagesStored."""

    copy_id: int
    keys: list[int]  # one per block
    host_pages: list[int]  # pages_per_block of them per key, in order


class PagesStored(Msg, tag="spill.stored"):
    copy_id: int
    keys: list[int]
    ok: bool = True
    error: str = ""


class FetchPages(Msg, tag="spill.from_store"):
    """Read blocks from the file store into host pages. The first block's first `skip`
    pages are not read (the tree holds them already); every other page is."""

    copy_id: int
    keys: list[int]
    skip: int
    host_pages: list[int]  # pages_per_block * len(keys) - skip of them, in order


class PagesFetched(Msg, tag="spill.fetched"):
    copy_id: int
    keys: list[int]
    ok: bool = True
    error: str = ""


class StoreListed(Msg, tag="spill.listed"):
    """The blocks the file store holds, listed by the cache manager's shell at start."""

    keys: list[int]


class ClearStore(Msg, tag="spill.clear_store"):
    """Empty the file store (POST /hicache/storage-backend/clear): every block file in
    its directory goes, those an earlier run or older weights left too. The device and
    host tiers keep what they hold. Answered by StoreCleared."""

    clear_id: str


class StoreCleared(Msg, tag="spill.store_cleared"):
    clear_id: str
    ok: bool = True
    num_blocks: int = 0  # blocks the cache manager knew of and forgot
    reason: str = ""  # why not, when ok is False


class EraseBlocks(Msg, tag="spill.erase"):
    """Delete block files: those of `keys`, or with `everything` every block file in the
    store's directory. Ordered with the store's writes and reads: those sent before it
    have finished before it starts, those sent after it start after it ends."""

    copy_id: int
    keys: list[int]
    everything: bool = False


class BlocksErased(Msg, tag="spill.erased"):
    copy_id: int
    keys: list[int]
    ok: bool = True
    error: str = ""
