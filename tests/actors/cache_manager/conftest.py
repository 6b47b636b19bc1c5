"""Shared harness for the hypothesis state machine (test_state_machine.py): the model
scheduler's plumbing and the books it checks after every step.

`CacheMachineBase` drives the real cache manager core and checks what comes back
(block events, refused frees, matches against a brute-force oracle); its invariants
check the books: the ledger partitions [0, num_pages) exactly into the free set, the
tree, pages kept aside, and pages the model holds (pool, grants in flight, rows);
locks equal the requests' matched paths; the KV events replay to the tree's block
hashes; the census is ok. The rules (the scheduler's moves) are in the test module,
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
    Matched,
    SchedulerCensus,
    SequenceReleased,
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


class CacheMachineBase(RuleBasedStateMachine):
    page_size = 1
    num_pages = 24
    emit_kv_events = True
    disable_radix_cache = False

    def __init__(self) -> None:
        super().__init__()
        cfg = CacheConfig(
            num_pages=self.num_pages,
            page_size=self.page_size,
            emit_kv_events=self.emit_kv_events,
            disable_radix_cache=self.disable_radix_cache,
        )
        self.core = CacheManagerCore(cfg)
        self.ps = self.page_size
        self.pool: list[int] = []
        self.pending: list[tuple[int, list[int]]] = []
        self.seq = self.delivered_seq = self.step = self.next_id = self.next_copy = 0
        self.waiting: dict[str, _Waiting] = {}
        self.running: dict[str, _Running] = {}
        self.released: list[SequenceReleased] = []
        self.copies: set[int] = set()
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
        return out

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

    def oracle_match(self, ns: str, key: list[int], limit: int | None = None) -> int:
        """Longest page-aligned prefix of key[:limit] (key[:-1] by default) spelled by
        any root path (brute force)."""
        limit = max(len(key) - 1, 0) if limit is None else limit
        limit -= limit % self.ps
        best = 0
        for node in self.core.tree.nodes():
            if node.namespace != ns:
                continue
            path, n = [], node
            while n.parent is not None:
                path[:0] = n.key
                n = n.parent
            k = 0
            while k < min(len(path), limit) and path[k] == key[k]:
                k += 1
            best = max(best, k - k % self.ps)
        return best

    def check_match(self, out, rid: str, key: list[int], limit: int | None = None) -> Matched:
        assert len(out) == 1 and isinstance(out[0], Matched), out
        m = out[0]
        assert m.request.request_id == rid
        assert m.num_cached_tokens == self.oracle_match(m.request.extra_key, key, limit)
        assert len(m.prefix_pages) * self.ps == m.num_cached_tokens
        assert m.tree_version == self.core.tree.version
        node = self.core.requests[rid].node
        if m.prefix_pages:
            assert self.core.tree.path_pages(node) == m.prefix_pages
        return m

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
        assert set(c.requests) == set(self.waiting) | set(self.running)

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
        assert c.tree.leaves == {n for n in nodes if not n.children}

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
        assert len(out) == 1, out
        cen = out[0]
        assert isinstance(cen, Census) and cen.ok, cen
        assert cen.leased_unused == len(self.pool) + in_flight
        assert cen.free + cen.leased_unused + cen.held_by_requests + cen.cached_in_tree == cen.total
