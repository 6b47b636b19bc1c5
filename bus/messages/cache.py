"""Cache manager: prefix matches, KV page leases, the tree's ledger, census, KV events.

Pages are the unit of KV allocation: page p holds tokens [p*page_size, (p+1)*page_size)
of the pool's flat slot space (page size 1 means page == slot). Every page is in exactly
one place: free, leased to the scheduler and unused, held by a running request, or
cached in the tree. The census checks that at every step boundary.

Protocol between the scheduler and the cache manager (actors/cache_manager/core.py):
- Every Matched the scheduler receives is ended by exactly one SequenceReleased, or
  replaced by a newer Matched for the same request id (answer to RefreshMatch, a
  retraction, or a DropTree). That holds for a request aborted while still waiting too:
  the scheduler releases it with reason "aborted" (token_ids and pages may then be
  empty, which only unlocks its match). The cache manager never unlocks on an
  AbortRequest by itself: only the scheduler knows whether the request was admitted
  meanwhile, and unlocking a running request's prefix would let its pages be evicted
  and leased to another request while its row still reads them.
- Pages of the tree (a match's prefix_pages) are the tree's, never the scheduler's: they
  are not counted in SchedulerCensus.num_held_by_requests. Pages handed over by
  ChunkCached leave the scheduler's count too (the cache manager counts them from then
  on, in the tree or, where the tree already had those positions, aside for the request
  until its release).
- A page the cache manager cannot account for (already free, the tree's at another
  position, a request it does not know) makes the whole message refused: FreeRefused,
  and nothing of that message is applied.
"""

from __future__ import annotations

from shunter.bus.messages.base import Msg
from shunter.bus.messages.tokenizer import Tokenized


class Matched(Msg, tag="cache.matched"):
    """A request's longest cached prefix, locked until the request releases it.

    The match is page-aligned and leaves at least one token to compute (its logits are
    needed), so num_cached_tokens <= len(input_ids) - 1. After a retraction the match is
    over the tokens the request had computed (prompt plus output so far, as sent in
    SequenceReleased.token_ids), so num_cached_tokens may exceed len(request.input_ids)."""

    request: Tokenized
    num_cached_tokens: int
    prefix_pages: list[int]  # pages holding the first num_cached_tokens tokens
    # the tree's insert count when matched; admission re-matches if stale, and always if
    # -1 (the tree was dropped, or a file store read in flight may extend the match)
    tree_version: int


class RefreshMatch(Msg, tag="cache.refresh"):
    """Scheduler to cache manager: the tree grew since this request was matched;
    unlock the old match, match again and answer with a new Matched."""

    request_id: str


class LeaseRequest(Msg, tag="cache.lease.request"):
    """Scheduler asks for free pages up front, so its per-step hot path has no round trip."""

    lease_seq: int  # scheduler's counter; answers carry it back
    num_pages: int


class LeaseGranted(Msg, tag="cache.lease.granted"):
    lease_seq: int
    pages: list[int]  # may be fewer than asked for (possibly none) when the pool is short
    num_evicted_pages: int = 0  # evicted from the tree to make this grant
    # short because a leaf's backup to the host tier was still running: PagesEvictable
    # follows once one lands, so the scheduler can wait instead of freeing pages itself
    awaits_backup: bool = False


class LeaseReturned(Msg, tag="cache.lease.returned"):
    """Scheduler gives unused leased pages back."""

    pages: list[int]


class ChunkCached(Msg, tag="cache.chunk"):
    """A chunked prefill finished a chunk: insert its tokens so followers can share them.
    The request's lock moves to the new node; its pages covering the page-aligned part of
    token_ids now belong to the cache manager (the tree's, or kept aside for the request
    where the tree already held those positions; those are freed at its release). The
    request's row keeps using them; it lists them again in its SequenceReleased."""

    request_id: str
    token_ids: list[int]  # the request's whole computed prefix so far
    pages: list[int]  # its pages, prefix pages included; any beyond the aligned part stay its own


class SequenceReleased(Msg, tag="cache.release"):
    """A request leaves the running batch: insert its computed tokens (unless reason is
    "aborted" and caching is off), free duplicate and surplus pages, unlock its match.
    For reason "retracted" the cache manager matches the request again and answers with
    a new Matched, so the scheduler gets it back in its waiting queue."""

    request_id: str
    token_ids: list[int]  # tokens whose KV is computed, in order
    pages: list[int]  # all of the request's pages, prefix pages included
    reason: str = "finished"  # "finished", "aborted", "retracted"


class SchedulerCensus(Msg, tag="cache.census.sched"):
    """Scheduler's side of the census, sent at every step boundary."""

    step_id: int
    last_lease_seq: int  # grants up to this seq have been received
    num_leased_unused: int  # leased pages in the scheduler's pool, in no request's row
    num_held_by_requests: int  # leased pages in rows, not yet handed over by ChunkCached


class Census(Msg, tag="cache.census"):
    """free + leased_unused + held_by_requests + cached_in_tree + copying == total, per
    tier. The host tier has no leases or rows: its pages are free, cached, or being
    written by a backup in flight (copying)."""

    step_id: int
    tier: str  # "device", "host", "disk"
    total: int
    free: int
    leased_unused: int
    held_by_requests: int
    cached_in_tree: int
    ok: bool
    copying: int = 0


class CacheStats(Msg, tag="cache.stats"):
    """The cache manager's figures for /metrics: its pages per tier and state now, and
    running totals. Sent on the scheduler's Tick when they changed since the last one
    (so an idle engine sends none)."""

    num_pages: int
    num_free: int
    num_in_tree: int  # device pages the prefix tree holds (the rest: leased or in rows)
    num_queried_tokens: int  # prompt tokens matched against the tree
    num_hit_tokens: int  # of those, tokens found cached (loaded back from the host included)
    num_evicted_pages: int
    num_host_pages: int = 0  # the host tier (all 0 when it is off)
    num_host_free: int = 0
    num_host_in_tree: int = 0
    num_host_writing: int = 0  # host pages a backup in flight is writing
    num_host_hit_tokens: int = 0  # hit tokens that were loaded back from the host
    num_spilled_pages: int = 0  # pages backed up to the host
    num_loaded_pages: int = 0  # pages loaded back to the device
    num_copies_failed: int = 0
    num_store_blocks: int = 0  # the file store below the host tier (all 0 when it is off)
    num_stored_blocks: int = 0  # blocks written to it
    num_fetched_blocks: int = 0  # blocks read back into host pages
    num_store_hit_tokens: int = 0  # tokens read back from it for a match
    num_store_copies_failed: int = 0
    store_block_tokens: int = 0  # the store's block size: 0 when there is no store
    num_store_blocks_evicted: int = 0  # blocks erased to keep the store under its size cap


class PagesEvictable(Msg, tag="cache.evictable"):
    """Cache manager to scheduler: pages a short lease could not have (their backup to
    the host tier was in flight) can be evicted now; asking again may succeed."""

    num_pages: int


class CensusBroken(Msg, tag="cache.error.census"):
    step_id: int
    tier: str
    difference: int  # counted - total
    detail: str


class FreeRefused(Msg, tag="cache.error.free"):
    """A free that was not applied: the page was already free, or held by another."""

    pages: list[int]
    claimed_by: str  # who tried to free them
    reason: str


class DropTree(Msg, tag="cache.drop"):
    """Flip primitive (and /flush_cache): drop the prefix tree and reclaim every row it
    holds, locked ones included. Refused while a copy is in flight."""

    flip_id: str
    include_locked: bool = True
    weights_changed: bool = False  # the file store's blocks no longer match the weights


class TreeDropped(Msg, tag="cache.dropped"):
    flip_id: str
    num_pages_reclaimed: int
    ok: bool = True
    reason: str = ""  # why it was refused, when ok is False
    tree_version: int = 0  # the tree's version now; matches with an older one are stale


class BlockStored(Msg, tag="cache.kv.stored"):
    """KV event (vLLM/SGLang schema): blocks entered the prefix cache."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: str | None = None  # the extra_key namespace, when set


class BlockRemoved(Msg, tag="cache.kv.removed"):
    block_hashes: list[int]


class AllBlocksCleared(Msg, tag="cache.kv.cleared"):
    pass
