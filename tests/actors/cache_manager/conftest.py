"""Shared harness for the hypothesis state machine (test_state_machine.py): the model
scheduler's plumbing and the books it checks after every step.

`CacheMachineBase` drives the real cache manager core and checks what comes back
(block events, refused frees, matches against a brute-force oracle); its invariants
check the books: the ledger partitions [0, num_pages) exactly into the free set, the
tree, pages kept aside, and pages the model holds (pool, grants in flight, rows);
locks equal the requests' matched paths; the KV events replay to the tree's block
hashes; the census is ok.

It also models what the pages hold: `dev` (device page -> the tokens whose KV it
holds, written when a row computes them) and `host_data` (host page -> tokens, written
when a backup is answered). Every Matched's prefix pages must hold its tokens. With a
host tier (num_host_pages > 0) the machine plays the executor too: copies queue in
`copies_out` and are answered in order (rule `copy_answer`), so a Matched may come
later than its request (`loading`), and only bounds on its length are checked. The rules (the scheduler's moves) are in the test module,
which imports these helpers by name.
"""

from __future__ import annotations

from hypothesis.stateful import RuleBasedStateMachine, invariant

from shunter.actors.cache_manager.allocator import ASIDE, FREE, OUT, TREE
from shunter.actors.cache_manager.config import CacheConfig
from shunter.actors.cache_manager.core import CacheManagerCore
from shunter.bus.messages import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Census,
    FreeRefused,
    LoadPages,
    Matched,
    PagesEvictable,
    SchedulerCensus,
    SequenceReleased,
    SpillPages,
    Tokenized,
)


class _Waiting:
    def __init__(
        self, tok: Tokenized, target: list[int], m: Matched, key: list[int], limit: int | None
    ) -> None:
        self.tok, self.target, self.stale = tok, target, False
        self.key = key  # what the cache manager matches: the prompt, or computed tokens
        self.limit = limit  # most tokens a match may cover (None: all of key but one)
        self.num_cached, self.prefix = m.num_cached_tokens, m.prefix_pages


class _Running:
    def __init__(self, w: _Waiting, computed: list[int], row: list[int]) -> None:
        self.tok, self.target, self.computed, self.row = w.tok, w.target, computed, row
        self.own_from = len(w.prefix)  # row[:own_from] belong to the cache manager
        self.first_own = len(w.prefix)  # the row computes into row[first_own:]


class CacheMachineBase(RuleBasedStateMachine):
    page_size = 1
    num_pages = 24
    emit_kv_events = True
    disable_radix_cache = False
    num_host_pages = 0
    write_policy = "write_through"

    def __init__(self) -> None:
        super().__init__()
        cfg = CacheConfig(
            num_pages=self.num_pages,
            page_size=self.page_size,
            emit_kv_events=self.emit_kv_events,
            disable_radix_cache=self.disable_radix_cache,
            num_host_pages=self.num_host_pages,
            write_policy=self.write_policy,
        )
        self.core = CacheManagerCore(cfg)
        self.host = self.num_host_pages > 0
        self.copies_out: list[SpillPages | LoadPages] = []  # the executor's queue
        self.loading: dict[str, tuple[Tokenized, list[int], list[int], int | None]] = {}
        self.dev: dict[int, tuple[int, ...]] = {}  # device page -> tokens it holds
        self.host_data: dict[int, tuple[int, ...]] = {}
        self.drops_pending = 0
        self.ps = self.page_size
        self.pool: list[int] = []
        self.pending: list[tuple[int, list[int]]] = []
        self.seq = self.delivered_seq = self.step = self.next_id = self.next_copy = 0
        self.waiting: dict[str, _Waiting] = {}
        self.running: dict[str, _Running] = {}
        self.released: list[SequenceReleased] = []
        self.hashes: set[int] = set()

    # -- plumbing -----------------------------------------------------------------

    def send(self, msg):
        out = self.core.handle(msg)
        for o in out:
            if isinstance(o, BlockStored):
                assert o.block_size == self.ps and len(o.token_ids) == len(o.block_hashes) * self.ps
                assert not self.hashes & set(o.block_hashes), "block stored twice"
                assert o.parent_block_hash is None or o.parent_block_hash in self.hashes
                self.hashes |= set(o.block_hashes)
            elif isinstance(o, BlockRemoved):
                assert set(o.block_hashes) <= self.hashes, "removed a block never stored"
                self.hashes -= set(o.block_hashes)
            elif isinstance(o, AllBlocksCleared):
                self.hashes.clear()
            elif isinstance(o, SpillPages | LoadPages):
                assert self.host, o
                self.copies_out.append(o)
        if self.host:  # what the rules check is the rest
            skip = (SpillPages, LoadPages, PagesEvictable, BlockRemoved)
            out = [o for o in out if not isinstance(o, skip)]
        return out

    def compute(self, r: _Running) -> None:
        """The row's own pages now hold the tokens it computed into them."""
        ps = self.ps
        for i in range(r.first_own, min(len(r.row), -(-len(r.computed) // ps))):
            self.dev[r.row[i]] = tuple(r.computed[i * ps : (i + 1) * ps])

    def snapshot(self):
        c = self.core
        nodes = sorted(
            (n.node_id, tuple(n.key), tuple(n.pages), n.lock_ref) for n in c.tree.nodes()
        )
        s = c.statistics()
        return (bytes(c.ledger.owner), c.ledger.pages_owned_by(FREE), nodes, s.tree_version,
                s.num_requests, s.num_aside, dict(c._aside_owner))  # fmt: skip

    def check_refused(self, msg) -> None:
        before = self.snapshot()
        out = self.send(msg)
        assert len(out) == 1 and isinstance(out[0], FreeRefused), out
        assert self.snapshot() == before, "a refused free changed the state"

    def new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def oracle_match(self, ns: str, key: list[int], limit: int | None = None,
                     device_only: bool = False) -> int:  # fmt: skip
        """Longest page-aligned prefix of key[:limit] (key[:-1] by default) spelled by
        any root path (brute force) of valid nodes (device-resident ones only, if so)."""
        limit = max(len(key) - 1, 0) if limit is None else limit
        limit -= limit % self.ps
        best = 0
        for node in self.core.tree.nodes():
            if node.namespace != ns:
                continue
            path, n, usable = [], node, True
            while n.parent is not None:
                path[:0] = n.key
                usable = usable and n.valid and (bool(n.pages) or not device_only)
                n = n.parent
            if not usable:
                continue
            k = 0
            while k < min(len(path), limit) and path[k] == key[k]:
                k += 1
            best = max(best, k - k % self.ps)
        return best

    def check_match(self, out, rid: str, key: list[int], limit: int | None = None,
                    lower: int = 0) -> Matched | None:  # fmt: skip
        """The Matched for rid in out (checked against the oracle); with a host tier
        None when it waits for a load (rid then waits in `loading`), else within
        [lower, what the whole tree spells]."""
        if not self.host:
            assert len(out) == 1 and isinstance(out[0], Matched), out
        ms = [o for o in out if isinstance(o, Matched)]
        assert len(out) == len(ms) <= 1, out
        if not ms:
            assert self.core.requests[rid].waiting
            return None
        m = ms[0]
        assert m.request.request_id == rid
        full = self.oracle_match(m.request.extra_key, key, limit)
        if self.host:
            assert lower <= m.num_cached_tokens <= full, (lower, m.num_cached_tokens, full)
        else:
            assert m.num_cached_tokens == full
        self.check_matched(m, key)
        return m

    def check_matched(self, m: Matched, key: list[int]) -> None:
        """A Matched's pages are the locked path's, and hold its tokens."""
        ps = self.ps
        assert len(m.prefix_pages) * ps == m.num_cached_tokens
        assert m.tree_version == self.core.tree.version
        node = self.core.requests[m.request.request_id].node
        if m.prefix_pages:
            assert self.core.tree.path_pages(node) == m.prefix_pages
        for i, p in enumerate(m.prefix_pages):
            assert self.dev.get(p) == tuple(key[i * ps : (i + 1) * ps]), (i, p)

    def held(self) -> int:
        return sum(len(r.row) - r.own_from for r in self.running.values())

    def take(self, n: int) -> list[int] | None:
        if n > len(self.pool):
            return None
        got, self.pool = self.pool[:n], self.pool[n:]
        return got

    # -- the books --------------------------------------------------------------------

    @invariant()
    def books_balance(self):
        c = self.core
        ledger, tree = c.ledger, c.tree
        ledger.check()
        tree_pages = tree.all_pages()
        assert len(tree_pages) == len(set(tree_pages)) == tree.num_pages
        assert set(tree_pages) == set(ledger.pages_owned_by(TREE))
        held_out = list(self.pool) + [p for _, ps in self.pending for p in ps]
        for r in self.running.values():
            held_out += r.row[r.own_from :]
        assert len(held_out) == len(set(held_out)), "a page is in two places"
        assert set(held_out) == set(ledger.pages_owned_by(OUT))
        aside = set(ledger.pages_owned_by(ASIDE))
        assert set(c._aside_owner) == aside
        for rid, r in self.running.items():
            path = tree.path_pages(c.requests[rid].node) if c.requests[rid].node else []
            for i, p in enumerate(r.row[: r.own_from]):
                assert (i < len(path) and path[i] == p) or c._aside_owner.get(p) == rid
        assert set(c.requests) == set(self.waiting) | set(self.running) | set(self.loading)
        if c.host is not None:
            c.host.ledger.check()
            host_pages = tree.all_host_pages()
            assert len(host_pages) == len(set(host_pages)) == tree.num_host_pages
            writing = [h for o in self.copies_out if isinstance(o, SpillPages)
                       for h in o.host_pages]  # fmt: skip
            assert sorted(writing) == c.host.ledger.pages_owned_by(OUT)
            assert set(host_pages) == set(c.host.ledger.pages_owned_by(TREE)) | set(writing)
            loading = [p for o in self.copies_out if isinstance(o, LoadPages)
                       for p in o.device_pages]  # fmt: skip
            assert sorted(loading) == sorted(c.host.page_load)

    @invariant()
    def locks_are_the_matched_paths(self):
        c = self.core
        expected: dict[int, int] = {}
        for req in c.requests.values():
            n = req.node
            while n is not None and n.parent is not None:
                expected[n.node_id] = expected.get(n.node_id, 0) + 1
                n = n.parent
            if req.node is not None and req.node.parent is not None:  # still in the tree
                root = req.node
                while root.parent is not None:
                    root = root.parent
                assert c.tree.roots.get(root.namespace) is root, "a locked node was evicted"
        nodes = c.tree.nodes()
        for n in nodes:
            assert n.lock_ref == expected.get(n.node_id, 0), n
        assert c.tree.num_locked_nodes == sum(1 for n in nodes if n.lock_ref)
        assert c.tree.leaves == {
            n for n in nodes if n.pages and not any(ch.pages for ch in n.children.values())
        }
        assert c.tree.host_leaves == {n for n in nodes if n.host_only and not n.children}
        for n in nodes:
            assert n.pages or n.host_only, "a node holding nothing"
            assert not n.pages or n.parent.pages or n.parent.parent is None, "device under host"
            assert not n.host_pages or len(n.host_pages) * self.ps == len(n.key)
            assert not n.lock_ref or n.pages

    @invariant()
    def kv_events_replay_to_the_tree(self):
        if self.emit_kv_events:
            assert self.hashes == {h for n in self.core.tree.nodes() for h in n.hashes}

    @invariant()
    def census_holds(self):
        self.step += 1
        in_flight = sum(len(ps) for _, ps in self.pending)
        out = self.core.handle(
            SchedulerCensus(self.step, self.delivered_seq, len(self.pool), self.held())
        )
        assert len(out) == 1 + self.host, out
        cen = out[0]
        assert isinstance(cen, Census) and cen.ok and cen.tier == "device", cen
        assert cen.leased_unused == len(self.pool) + in_flight
        assert cen.free + cen.leased_unused + cen.held_by_requests + cen.cached_in_tree == cen.total
        if self.host:
            h = out[1]
            assert isinstance(h, Census) and h.ok and h.tier == "host", h
            writing = sum(len(o.host_pages) for o in self.copies_out if isinstance(o, SpillPages))
            assert h.copying == writing
            assert h.cached_in_tree + writing == self.core.tree.num_host_pages
            assert h.free + h.copying + h.cached_in_tree == h.total == self.num_host_pages
