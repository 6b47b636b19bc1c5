"""The cache manager core's tiers below the device: the host tier and the file store.

Theory of operation
    A mixin of CacheManagerCore (core.py): the messages of the copies between tiers,
    eviction (which may demote to the host or start a backup), and the part of a match
    that reaches past the device pages. The books are host_tier.py's and store_tier.py's;
    this module is where the core's requests and tree meet them.

    Host tier (config.num_host_pages > 0; the pool's books in host_tier.py). A node
    entering the tree (write_through), or reached by its SELECTIVE_HITS-th match
    (write_through_selective), or taken by device eviction (write_back) is backed up to
    host pages (SpillPages). Device eviction demotes a backed-up leaf (the node stays,
    host-only) and skips one whose backup is still running (a short grant is then owed
    a PagesEvictable; under write_back the backups it starts are waited for alike). A
    match reaching into host-only nodes attaches device pages to them and sends
    LoadPages; its Matched, and
    that of any match reaching pages still loading, waits for the PagesLoaded. A failed
    load leaves its nodes invalid and matches its waiters again.

    File store (config.store_block_tokens > 0, with a host tier; its books in
    store_tier.py). A landed backup writes the whole blocks it completes to the store
    (StorePages); a match short of what the store holds of its tokens reads those
    blocks into host pages under a new host-only leaf (FetchPages) and is matched again
    once PagesFetched comes, loading them like any host-only prefix (under the
    "best_effort" prefetch policy it is answered at once, its match ending before the
    blocks being read, which later matches find in the host tier; under "timeout" it
    waits until the scheduler's Ticks say its timeout has passed, then goes on so).
    Such a Matched carries tree_version -1, once per request: the scheduler matches it
    again just before admitting it, so one that waited in its queue meanwhile gets
    what the read brought (SGLang's best_effort: what has arrived by then).
    StoreListed (from
    the shell at start, oldest first) tells the core what an earlier run left there,
    trimmed to the store's size cap (config.store_max_blocks: least recently used
    blocks are evicted, EraseBlocks, before a write would pass it). ClearStore
    (/hicache/storage-backend/clear) empties the store (EraseBlocks) and is answered
    with StoreCleared once the store has (BlocksErased).

    A request waiting for copies (`_Request.waiting`: their copy ids, with an entry in
    the host tier's `waiters`) gets no Matched until the last is answered, or is matched
    again (`_match_again`) when what it waited for changes what a match finds: a
    fetch, a failed load, a backup that makes room under write_back.

Invariants
    - every copy id a request waits for has that request in `host.waiters[copy id]`.
    - no copy starts while a DropTree waits (`_drops`); it runs once none is in flight.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shunter.actors.cache_manager.allocator import TREE, PageLedger
from shunter.actors.cache_manager.config import CacheConfig
from shunter.actors.cache_manager.host_tier import HostTier
from shunter.actors.cache_manager.radix import EvictedBlock, MatchResult, Node, RadixTree
from shunter.actors.cache_manager.store_tier import StoreTier, prefetch_timeout_ns
from shunter.bus.messages import (
    BlockRemoved,
    BlocksErased,
    ClearStore,
    DropTree,
    Msg,
    PagesEvictable,
    PagesFetched,
    PagesLoaded,
    PagesSpilled,
    StoreCleared,
)

if TYPE_CHECKING:
    from shunter.actors.cache_manager.core import _Request


class Tiers:
    config: CacheConfig
    ledger: PageLedger
    tree: RadixTree
    host: HostTier | None
    store: StoreTier | None
    requests: dict[str, _Request]
    _drops: list[DropTree]
    _store_timers: dict[str, list]
    _num_evicted: int

    if TYPE_CHECKING:  # the core's, which this mixin calls

        def _match(self, req: _Request) -> list[Msg]: ...

        def _unlock(self, req: _Request) -> None: ...

        def _drop(self, msg: DropTree) -> list[Msg]: ...

    def _through_tiers(self, host: HostTier, req: _Request, found: MatchResult,
                       tokens: list[int], out: list[Msg]) -> tuple[Node, list[int]] | None:  # fmt: skip
        """A match (`found` over `tokens`, the most it may cover) past the device pages:
        the blocks the store holds beyond it are read into host pages first, then the
        host-only part is loaded. Returns the node and device pages to lock now, or None
        when the request waits for a copy (registered) and is matched again after it."""
        node, pages = found.node, found.pages
        rid = req.tokenized.request_id
        past_device = found.num_tokens > len(pages) * self.config.page_size
        req.read_in_flight = False
        if self.store is not None:
            waits = self.store.waiting_on(node)
            if not waits:
                fetch = self.store.fetch(self.tree, host, node, found.num_tokens, tokens,
                                         lambda b: self._release_blocks(b, out))  # fmt: skip
                if fetch is not None:
                    out.append(fetch)
                    waits = {fetch.copy_id}
            policy = self.config.store_prefetch_policy
            if waits and (policy == "best_effort" or req.store_gave_up):
                node = self.store.before_fetches(node)  # the reads go on; no wait for them
                past_device = node.parent is not None and node.host_only
                req.read_in_flight = True
            elif waits:
                if policy == "timeout" and rid not in self._store_timers:
                    wait_ns = prefetch_timeout_ns(len(tokens) - found.num_tokens)
                    self._store_timers[rid] = [None, wait_ns]
                for cid in waits:
                    req.waiting.add(cid)
                    host.waiters[cid][rid] = None
                return None
        if past_device:
            node, load = host.load(self.tree, self.ledger, node,
                                   lambda keep, n: self._make_room(keep, n, out))  # fmt: skip
            if load is not None:
                out.append(load)
                pages = self.tree.path_pages(node)
            elif host.write_back and host.blocked and host.writes:
                self.tree.lock(node)  # the load's room waits for a backup: match again then
                req.node = node
                for cid in host.writes:
                    req.waiting.add(cid)
                    host.waiters.setdefault(cid, {})[rid] = None
                return None
        return node, pages

    def _version_for(self, req: _Request) -> int:
        """The tree version a Matched carries: -1, once, for a match a store read in
        flight may extend (_through_tiers), so the scheduler matches it again just before
        admitting it and a request that waited in its queue finds what was read."""
        if req.read_in_flight and not req.told_stale:
            req.told_stale = True
            return -1
        return self.tree.version

    def _release_blocks(self, blocks: list[EvictedBlock], out: list[Msg]) -> int:
        """Free what eviction took out of the tree; returns the device pages freed."""
        pages = [p for b in blocks for p in b.pages]
        assert all(self.ledger.owner[p] == TREE for p in pages)
        self.ledger.free(pages)
        hashes = [h for b in blocks for h in b.hashes]
        if self.config.emit_kv_events and hashes:
            out.append(BlockRemoved(hashes))
        if self.host is not None:  # (a demoted node's blocks stay: it names none)
            self.host.ledger.free([p for b in blocks for p in b.host_pages])
            self.host.num_demoted += sum(len(b.pages) for b in blocks if not b.hashes)
        return len(pages)

    def _evict(self, num_pages: int, out: list[Msg]) -> int:
        if self.host is not None:
            self.host.blocked = False
        if num_pages <= 0 or not self.tree.num_pages:
            return 0
        host, back_up = self.host, lambda node: self._backup(node, out)
        decide = None if host is None else lambda leaf: host.decide(leaf, back_up)
        return self._release_blocks(self.tree.evict(num_pages, decide), out)

    def _make_room(self, keep: Node, num_pages: int, out: list[Msg]) -> None:
        """Evict for a load, keeping keep's path (the whole match, host part too)."""
        self.tree.lock(keep)
        self._num_evicted += self._evict(num_pages, out)
        self.tree.unlock(keep)

    def _backup(self, node: Node, out: list[Msg]) -> bool:
        """Back node up to the host tier if it has room; whether a copy started."""
        if self.host is None or self._drops:
            return False
        spill = self.host.backup(self.tree, node, lambda b: self._release_blocks(b, out))
        if spill is not None:
            out.append(spill)
        return spill is not None

    def _on_spilled(self, msg: PagesSpilled) -> list[Msg]:
        host = self.host
        node = host.write_nodes.get(msg.copy_id) if host is not None else None
        out = host.spilled(self.tree, msg) if host is not None else None
        if out is None:  # not a backup of ours (or answered twice)
            return []
        assert host is not None and node is not None
        if msg.ok and self.store is not None and not self._drops:
            out += self.store.after_backup(self.tree, host, node)
        for rid in host.waiters.pop(msg.copy_id, {}):  # matches waiting for room (write_back)
            out += self._match_again(self.requests[rid], msg.copy_id)
        self._drop_when_idle(out)
        return out

    def _match_again(self, req: _Request, answered: int) -> list[Msg]:
        """Match a request waiting for copies again, once `answered` is; it stops
        waiting for the others."""
        rid = req.tokenized.request_id
        for cid in req.waiting - {answered}:
            del self.host.waiters[cid][rid]  # type: ignore[union-attr]
        req.waiting.clear()
        self._unlock(req)
        return self._match(req)

    def _on_loaded(self, msg: PagesLoaded) -> list[Msg]:
        host = self.host
        rids = host.loaded(self.tree, msg) if host is not None else None
        if rids is None:
            return []
        assert host is not None
        out = self._relief(len(msg.keys))  # eviction may have skipped a leaf it wrote
        for rid in rids:
            req = self.requests[rid]
            if not msg.ok:  # match again: it stops before the nodes that failed
                out += self._match_again(req, msg.copy_id)
                continue
            req.waiting.discard(msg.copy_id)
            if not req.waiting:
                out.append(self._matched(req))
        self._drop_when_idle(out)
        return out

    def _on_fetched(self, msg: PagesFetched) -> list[Msg]:
        host, store = self.host, self.store
        done = store.fetched(self.tree, host, msg) if host and store else None
        if done is None:
            return []
        rids, erase = done
        out: list[Msg] = [erase] if erase is not None else []
        out += self._relief(len(msg.keys))
        for rid in rids:
            self._store_timers.pop(rid, None)
            out += self._match_again(self.requests[rid], msg.copy_id)
        return self._drop_when_idle(out)

    def _store_timeouts(self, now_ns: int) -> list[Msg]:
        """A Tick at now_ns: the requests that have waited for the store their whole
        timeout are matched again without waiting for it (as under best_effort). A
        timer starts at the first Tick after its wait began."""
        out: list[Msg] = []
        for rid, timer in list(self._store_timers.items()):
            req = self.requests.get(rid)
            if req is None or not req.waiting:  # released, or answered meanwhile
                del self._store_timers[rid]
            elif timer[0] is None:
                timer[0] = now_ns
            elif now_ns - timer[0] >= timer[1]:
                del self._store_timers[rid]
                req.store_gave_up = True
                out += self._match_again(req, -1)
        return out

    def _on_clear_store(self, msg: ClearStore) -> list[Msg]:
        if self.host is None or self.store is None:
            why = "no file store: start the server with --hicache-storage-backend file"
            return [StoreCleared(msg.clear_id, ok=False, reason=why)]
        return [self.store.clear(self.host, msg.clear_id)]

    def _on_erased(self, msg: BlocksErased) -> list[Msg]:
        cleared = self.store.erased(msg) if self.store is not None else None
        return [] if cleared is None else [cleared]

    def _relief(self, num: int) -> list[Msg]:
        """A store copy or a load ended: eviction may have skipped a leaf for it, and a
        short grant then awaits this (as for a backup, host_tier.py)."""
        if self.host is None or not self.host.owe_relief:
            return []
        self.host.owe_relief = False
        return [PagesEvictable(num)]

    @property
    def _copying(self) -> bool:
        return (self.host is not None and self.host.busy) or (
            self.store is not None and self.store.busy
        )

    def _drop_when_idle(self, out: list[Msg]) -> list[Msg]:
        if self._drops and not self._copying:
            drops, self._drops = self._drops, []
            for d in drops:
                out += self._drop(d)
        return out
