"""Cache manager core: prefix matches, page leases, the ledger, census, row reclaim.

Theory of operation
    The core owns the device KV pages and the radix tree over the tokens they hold. A
    request arrives as Tokenized: its longest cached prefix (page-aligned, leaving at
    least one token to compute, and every token whose prompt logprob it asks for) is
    locked and published as Matched. The scheduler draws
    pages through leases (LeaseRequest -> LeaseGranted, evicting LRU unlocked leaves
    when the free set is short; a grant may be smaller than asked, even empty, and
    never waits). Pages come back through LeaseReturned, ChunkCached (a chunk's pages
    go into the tree so followers share them; the request's lock moves down to the new
    node) and SequenceReleased (computed whole pages go into the tree, pages whose
    positions the tree already held with other pages are freed, as are the partial
    last page and any surplus; the match is unlocked; "retracted" matches again).

    Every page-returning message is checked against the ledger before anything of it
    is applied: a page must be leased (OUT), kept aside for this very request, or be
    the tree's own page at that very position of the request's tokens. Otherwise the
    whole message is refused with FreeRefused and the state is left as it was.

    SchedulerCensus closes the books at a step boundary: the scheduler counts leased
    pages it holds (unused, or in rows not yet handed over by ChunkCached); grants it
    has not received yet (lease_seq > last_lease_seq) count as leased unused; pages
    handed over by ChunkCached but kept aside count as held. Census is published, and
    CensusBroken too when free + leased_unused + held + cached != total.

    Host tier and file store: tiers.py (a match reaching past the device waits for
    the copies that bring its pages back, then is matched again or answered). The
    census, DropTree and Tick's figures below are books.py's.

    DropTree reclaims every page of the tree (differenced against the free set), locked
    ones too when include_locked; without include_locked (/flush_cache) it is refused
    while any node is locked, i.e. while any request is waiting or running (as SGLang
    refuses a flush with requests in flight). It waits while a copy is in flight (no
    new copy starts meanwhile) and is carried out when the last one is answered; the
    host tier is dropped with the tree. Requests whose locked path was dropped remember
    those pages ("reclaimed") and never free them later; TreeDropped.tree_version tells the
    scheduler that every earlier match is stale (it refreshes before admission).

    AbortRequest is not in the inbox: the scheduler ends every request it was sent a
    Matched for with a SequenceReleased (bus/messages/cache.py says why), so an abort
    reaches the cache manager in the one order that is safe.

    The scheduler's Tick (its shell's clock, every 0.25 s) asks for the figures of
    /metrics: CacheStats goes out when they changed since the last Tick, and every 5 s
    of Tick time unchanged (books.py's STATS_REFRESH_NS), so a gateway that subscribed
    after the last change still gets them.

    Time is `_clock`, advanced once per handled message (not by Tick); no clock,
    environment or randomness is read, so a recorded inbox replays to the same outbox.

Invariants (checked by tests/actors/cache_manager, after every message)
    - ledger counts: free + OUT + TREE + ASIDE == num_pages; TREE == tree.num_pages;
      host ledger: OUT == the pages of backups in flight, TREE + OUT ==
      tree.num_host_pages (a node's host pages are cached or being written).
    - a device page being loaded reaches no Matched before its PagesLoaded.
    - the tree's pages are exactly the ledger's TREE pages; no page is in two places.
    - a node with lock_ref > 0 is never evicted; locks == matched requests' paths.
"""

from __future__ import annotations

from shunter.actors.cache_manager.allocator import ASIDE, OUT, TREE, PageLedger
from shunter.actors.cache_manager.books import Books
from shunter.actors.cache_manager.config import SELECTIVE_HITS, CacheConfig
from shunter.actors.cache_manager.host_tier import HostTier
from shunter.actors.cache_manager.radix import Node, RadixTree
from shunter.actors.cache_manager.stats import refusal
from shunter.actors.cache_manager.store_tier import StoreTier
from shunter.bus.messages import (
    BlocksErased,
    BlockStored,
    CacheStats,
    ChunkCached,
    ClearStore,
    DropTree,
    FreeRefused,
    LeaseGranted,
    LeaseRequest,
    LeaseReturned,
    Matched,
    Msg,
    PagesFetched,
    PagesLoaded,
    PagesSpilled,
    PagesStored,
    RefreshMatch,
    RequestFailed,
    SchedulerCensus,
    SequenceReleased,
    StoreListed,
    Tick,
    Tokenized,
)

Inbox = (
    Tokenized | RefreshMatch | LeaseRequest | LeaseReturned | ChunkCached | SequenceReleased
    | SchedulerCensus | DropTree | PagesSpilled | PagesLoaded | PagesStored | PagesFetched
    | StoreListed | ClearStore | BlocksErased | Tick
)  # fmt: skip
INBOX_TYPES: tuple[type[Msg], ...] = Inbox.__args__  # type: ignore[attr-defined]


def _first_match_bound(t: Tokenized) -> int:
    """Most tokens a new request's match may cover: all but one (its logits give the
    next token), and when prompt logprobs are asked for from position s
    (logprob_start_len >= 0) at most max(s - 1, 0), since the token at s is scored by
    the logits at s - 1, which a cached prefix would not compute."""
    bound = len(t.input_ids) - 1
    s = t.sampling.logprob_start_len
    return min(bound, max(s - 1, 0)) if s >= 0 else bound


def _retracted_bound(t: Tokenized, computed: list[int]) -> int:
    """Most tokens a retracted request's match may cover, its key being the tokens it
    had computed (fewer than it holds, so all may be cached). Stopped inside its prompt
    with prompt logprobs asked for, it reported them up to position len(computed) - 1,
    and the next one is scored by the logits at len(computed) - 1 (the scheduler
    reopens the row asking from there), so those must be computed again."""
    s = t.sampling.logprob_start_len
    if s >= 0 and len(computed) < len(t.input_ids):
        return max(s, len(computed)) - 1
    return len(computed)


class _Request:
    __slots__ = ("aside", "key_tokens", "max_match", "node", "read_in_flight", "reclaimed",
                 "store_gave_up", "tokenized", "told_stale", "waiting")  # fmt: skip

    def __init__(self, tokenized: Tokenized, key_tokens: list[int], max_match: int) -> None:
        self.tokenized = tokenized
        self.key_tokens = key_tokens  # what is matched: input_ids, or computed tokens
        self.max_match = max_match  # most tokens a match may cover
        self.node: Node | None = None  # locked node of the current match
        self.aside: set[int] = set()  # its pages kept aside (see allocator.ASIDE)
        self.reclaimed: frozenset[int] = frozenset()  # its path pages a DropTree took
        self.waiting: set[int] = set()  # loads its Matched waits for (copy ids)
        self.store_gave_up = False  # it waited for the store past its timeout
        self.read_in_flight = False  # its last match went on beside a store read
        self.told_stale = False  # a Matched told the scheduler to match it again


class CacheManagerCore(Books):
    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self.page_size = config.page_size
        self.ledger = PageLedger(config.num_pages)
        self.host = (HostTier(config.num_host_pages, config.page_size, config.write_policy)
                     if config.num_host_pages else None)  # fmt: skip
        self.store = (StoreTier(config.store_block_tokens, config.page_size,
                                config.store_max_blocks)
                      if self.host is not None and config.store_block_tokens else None)  # fmt: skip
        if self.host is not None and self.store is not None:
            self.host.keep = self.store.keep
        self.tree = RadixTree(config.page_size,
                              hash_blocks=config.emit_kv_events or self.host is not None,
                              eviction_policy=config.eviction_policy)  # fmt: skip
        self.requests: dict[str, _Request] = {}
        self._aside_owner = self.ledger.aside_owner
        self._leases_in_flight: dict[int, int] = {}  # lease_seq -> pages granted
        self._drops: list[DropTree] = []  # waiting for the copies in flight
        # "timeout" prefetch: request -> [the first Tick's time after it began waiting
        # for the store (None: none yet), how long it may wait]
        self._store_timers: dict[str, list] = {}
        self._clock = 0
        self._num_matches = self._num_queried = self._num_hit = 0
        self._num_evicted = self._num_refused = self._num_broken = self._num_deferred = 0
        self._last_stats: CacheStats | None = None
        self._stats_sent_ns = 0

    def handle(self, msg: Msg) -> list[Msg]:
        if isinstance(msg, Tick):  # time is not the tree's clock: it moves with messages
            return self._on_tick(msg)
        self._clock += 1
        self.tree.now = self._clock
        match msg:
            case Tokenized():
                return self._on_tokenized(msg)
            case RefreshMatch(request_id=rid):
                req = self.requests.get(rid)
                if req is None or req.waiting:  # released meanwhile, or a match to come
                    return []
                self._unlock(req)
                return self._match(req)
            case LeaseRequest():
                return self._on_lease(msg)
            case LeaseReturned(pages=pages):
                bad = self.ledger.refusals(pages, None, [])
                if bad:
                    return [self._refuse(bad, "scheduler lease")]
                self.ledger.free(pages)
                return []
            case ChunkCached():
                return self._on_chunk(msg)
            case SequenceReleased():
                return self._on_release(msg)
            case SchedulerCensus():
                return self._on_census(msg)
            case DropTree():
                return self._on_drop(msg)
            case PagesSpilled():
                return self._on_spilled(msg)
            case PagesLoaded():
                return self._on_loaded(msg)
            case PagesStored():
                if self.store is None or not self.store.stored(msg):
                    return []
                return self._drop_when_idle(self._relief(len(msg.keys)))
            case PagesFetched():
                return self._on_fetched(msg)
            case StoreListed(keys=keys):
                if self.store is None or self.host is None:
                    return []
                trim = self.store.listed(self.host, keys)
                return [trim] if trim is not None else []
            case ClearStore():
                return self._on_clear_store(msg)
            case BlocksErased():
                return self._on_erased(msg)
        raise TypeError(f"cache manager core cannot handle {type(msg).__name__}")

    # -- matching -----------------------------------------------------------------

    def _on_tokenized(self, t: Tokenized) -> list[Msg]:
        if t.request_id in self.requests:
            msg = f"request id {t.request_id!r} is already in use"
            return [RequestFailed(t.request_id, "invalid_request", msg, 400)]
        req = self.requests[t.request_id] = _Request(t, t.input_ids, _first_match_bound(t))
        return self._match(req)

    def _match(self, req: _Request) -> list[Msg]:
        """Lock the longest cached prefix, leaving >= 1 token to compute (and every
        token whose prompt logprob was asked for): see _first_match_bound. Its Matched
        goes out now, or once the loads it waits for are answered (the module
        docstring's host tier)."""
        key = req.key_tokens
        req.reclaimed = frozenset()
        self._num_matches += 1
        self._num_queried += len(key)
        limit = min(len(key), req.max_match)
        if self.config.disable_radix_cache or limit < self.page_size:
            return [Matched(req.tokenized, 0, [], self.tree.version)]
        host = self.host if not self._drops else None  # (no copy starts while a drop waits)
        found = self.tree.match(req.tokenized.extra_key, key[:limit], hit=True,
                                through_host=host is not None)  # fmt: skip
        out: list[Msg] = []
        node, pages = found.node, found.pages
        if host is not None:
            reached = self._through_tiers(host, req, found, key[:limit], out)
            if reached is None:
                return out  # matched again once a copy it waits for is answered
            node, pages = reached
        self.tree.lock(node)
        req.node = node
        num_tokens = len(pages) * self.page_size
        self._num_hit += num_tokens
        if host is not None and host.selective:
            n = node
            while n.parent is not None:
                if n.hit_count >= SELECTIVE_HITS and not n.host_pages:
                    self._backup(n, out)
                n = n.parent
        if self.host is not None:
            for cid in self.host.waits_for(pages):
                req.waiting.add(cid)
                self.host.waiters[cid][req.tokenized.request_id] = None
        if not req.waiting:
            out.append(Matched(req.tokenized, num_tokens, pages, self._version_for(req)))
        return out

    def _matched(self, req: _Request) -> Matched:
        pages = self.tree.path_pages(req.node) if req.node is not None else []
        num = len(pages) * self.page_size
        return Matched(req.tokenized, num, pages, self._version_for(req))

    def _unlock(self, req: _Request) -> None:
        if req.node is not None:
            self.tree.unlock(req.node)
            req.node = None

    # -- leases -------------------------------------------------------------------

    def _on_lease(self, msg: LeaseRequest) -> list[Msg]:
        out: list[Msg] = []
        num_evicted = self._evict(msg.num_pages - self.ledger.num_free, out)
        self._num_evicted += num_evicted
        pages = self.ledger.take(max(msg.num_pages, 0))
        blocked = len(pages) < msg.num_pages and self.host is not None and self.host.blocked
        if blocked:
            self.host.owe_relief = True
        flights = self._leases_in_flight
        flights[msg.lease_seq] = flights.get(msg.lease_seq, 0) + len(pages)
        out.append(LeaseGranted(msg.lease_seq, pages, num_evicted, blocked))
        return out

    # -- pages coming back --------------------------------------------------------

    def _refuse(self, bad: list[tuple[int, str]], claimed_by: str) -> FreeRefused:
        self._num_refused += 1
        return refusal(bad, claimed_by)

    def _unknown(self, rid: str, pages: list[int]) -> FreeRefused:
        self._num_refused += 1
        return FreeRefused(
            list(pages), f"request {rid}", "unknown request (not matched, or already released)"
        )

    def _tree_pages(self, req: _Request, tokens: list[int]) -> list[int]:
        """The tree's pages at the positions of tokens, as an insert sees them: through
        nodes a failed load left invalid too (an insert gives its pages to the host-only
        nodes below one, which a valid-only match would not reach)."""
        if self.config.disable_radix_cache or req.reclaimed:
            return []
        return self.tree.match(req.tokenized.extra_key, tokens, split=False,
                               valid_only=False).pages  # fmt: skip

    def _to_tree(self, pages: list[int]) -> None:
        aside = [p for p in pages if self.ledger.owner[p] == ASIDE] if self._aside_owner else []
        for p in aside:
            self.requests[self._aside_owner.pop(p)].aside.discard(p)
        self.ledger.move(aside, ASIDE, TREE)
        self.ledger.move([p for p in pages if p not in aside] if aside else pages, OUT, TREE)

    def _put_aside(self, req: _Request, pages: list[int]) -> None:
        rid = req.tokenized.request_id
        for p in pages:
            if self.ledger.owner[p] == OUT:
                self.ledger.move([p], OUT, ASIDE)
                self._aside_owner[p] = rid
                req.aside.add(p)

    def _insert(self, req: _Request, tokens: list[int], pages: list[int], out: list[Msg]):
        """Insert whole pages; returns (node, duplicate pages the tree already covered)."""
        ns = req.tokenized.extra_key
        ins = self.tree.insert(ns, tokens, pages)
        k = ins.num_cached_tokens // self.page_size
        head = pages[:k]
        dups = (
            []
            if head == ins.cached_pages
            else [p for p, q in zip(head, ins.cached_pages) if p != q]
        )
        if len(pages) > k:  # a new leaf, or host-only nodes that took these pages
            self._to_tree(pages[k:])
        if ins.new_node is not None:
            if self.config.emit_kv_events:
                leaf = ins.new_node
                assert leaf.parent is not None
                parent_hash = leaf.parent.hashes[-1] if leaf.parent.hashes else None
                out.append(
                    BlockStored(
                        list(leaf.hashes), parent_hash, list(leaf.key), self.page_size, ns or None
                    )
                )
            if self.host is not None and not (self.host.selective or self.host.write_back):
                self._backup(ins.new_node, out)
        return ins.node, dups

    def _on_chunk(self, msg: ChunkCached) -> list[Msg]:
        req = self.requests.get(msg.request_id)
        if req is None:
            return [self._unknown(msg.request_id, msg.pages)]
        n_full = min(len(msg.token_ids) // self.page_size, len(msg.pages))
        tokens = msg.token_ids[: n_full * self.page_size]
        head = msg.pages[:n_full]
        if req.reclaimed:
            head = [p for p in head if p not in req.reclaimed]
        bad = self.ledger.refusals(head, msg.request_id, self._tree_pages(req, tokens))
        if bad:
            return [self._refuse(bad, f"request {msg.request_id}")]
        if self.config.disable_radix_cache or req.reclaimed:
            self._put_aside(req, head)
            return []
        out: list[Msg] = []
        node, dups = self._insert(req, tokens, head, out)
        self._put_aside(req, dups)
        above = req.node
        while above is not None and above is not node:
            above = above.parent
        if above is None:  # the chunk reaches past the locked path: move the lock down
            self.tree.lock(node)
            self._unlock(req)
            req.node = node
        return out

    def _on_release(self, msg: SequenceReleased) -> list[Msg]:
        rid = msg.request_id
        req = self.requests.get(rid)
        if req is None:
            return [self._unknown(rid, msg.pages)]
        n_full = min(len(msg.token_ids) // self.page_size, len(msg.pages))
        tokens = msg.token_ids[: n_full * self.page_size]
        pages = [p for p in msg.pages if p not in req.reclaimed] if req.reclaimed else msg.pages
        bad = self.ledger.refusals(pages, rid, self._tree_pages(req, tokens))
        if bad:
            return [self._refuse(bad, f"request {rid}")]
        out: list[Msg] = []
        if self.config.disable_radix_cache or req.reclaimed or not n_full:
            to_free = [p for p in pages if self.ledger.owner[p] != TREE]
        else:
            _, to_free = self._insert(req, tokens, pages[:n_full], out)
            to_free += pages[n_full:]
        listed = set(to_free)
        to_free += [p for p in sorted(req.aside) if p not in listed]
        for p in req.aside:
            del self._aside_owner[p]
        req.aside.clear()
        self.ledger.free(to_free)
        self._unlock(req)
        for cid in req.waiting:  # (the scheduler releases only what it was matched)
            del self.host.waiters[cid][rid]  # type: ignore[union-attr]
        del self.requests[rid]
        self._store_timers.pop(rid, None)
        if msg.reason == "retracted":
            if msg.token_ids:  # matched over what it computed
                key, bound = msg.token_ids, _retracted_bound(req.tokenized, msg.token_ids)
            else:  # computed nothing: as before
                key, bound = req.key_tokens, req.max_match
            again = self.requests[rid] = _Request(req.tokenized, key, bound)
            out += self._match(again)
        return out
