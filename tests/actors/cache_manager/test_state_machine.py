"""Hypothesis state machines: a model scheduler driving the real cache manager core, for hypothesis state machines.

The machine plays the scheduler's side of the protocol in bus/messages/cache.py:
requests arrive and are matched, leases come back now or later (in flight), prefills
run in chunks (ChunkCached), decode steps append tokens, requests finish, abort,
retract or refresh, pages are returned, copies start and end, the tree is dropped.
It also tries frees that must be refused. After every step it checks the books: the
ledger partitions [0, num_pages) exactly into the free set, the tree, pages kept aside,
and pages the model holds (pool, grants in flight, rows); locks equal the requests'
matched paths; the KV events replay to the tree's block hashes; the census is ok.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shunter.actors.cache_manager.allocator import ASIDE, FREE, OUT, TREE
from shunter.actors.cache_manager.config import CacheConfig
from shunter.actors.cache_manager.core import CacheManagerCore
from shunter.bus.messages import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Census,
    ChunkCached,
    DropTree,
    FreeRefused,
    LeaseGranted,
    LeaseRequest,
    LeaseReturned,
    Matched,
    PagesSpilled,
    RefreshMatch,
    SamplingParams,
    SchedulerCensus,
    SequenceReleased,
    SpillPages,
    Tokenized,
    TreeDropped,
)

SP = SamplingParams(max_new_tokens=8)
BASES = [
    list(range(100, 124)),
    list(range(100, 108)) + list(range(200, 216)),
    list(range(300, 324)),
]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class _Waiting:
    def __init__(self, tok: Tokenized, target: list[int], m: Matched, key: list[int]) -> None:
        self.tok, self.target, self.stale = tok, target, False
        self.key = key  # what the cache manager matches: the prompt, or computed tokens
        self.num_cached, self.prefix = m.num_cached_tokens, m.prefix_pages


class _Running:
    def __init__(self, w: _Waiting, computed: list[int], row: list[int]) -> None:
        self.tok, self.target, self.computed, self.row = w.tok, w.target, computed, row
        self.own_from = len(w.prefix)  # row[:own_from] belong to the cache manager


class CacheMachine(RuleBasedStateMachine):
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

    def oracle_match(self, ns: str, key: list[int]) -> int:
        """Longest page-aligned prefix of key[:-1] spelled by any root path (brute force)."""
        limit = max(len(key) - 1, 0)
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

    def check_match(self, out, rid: str, key: list[int]) -> Matched:
        assert len(out) == 1 and isinstance(out[0], Matched), out
        m = out[0]
        assert m.request.request_id == rid
        assert m.num_cached_tokens == self.oracle_match(m.request.extra_key, key)
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

    # -- rules: arrivals and leases -----------------------------------------------

    @rule(base=st.integers(0, 2), plen=st.integers(0, 24), ns=st.sampled_from(["", "", "lora"]),
          suffix=st.lists(st.integers(0, 40), max_size=6))  # fmt: skip
    def arrive(self, base, plen, ns, suffix):
        tokens = BASES[base][:plen] + suffix or [1]
        rid = self.new_id()
        tok = Tokenized(rid, tokens, SP, extra_key=ns)
        m = self.check_match(self.send(tok), rid, tokens)
        self.waiting[rid] = _Waiting(tok, tokens, m, tokens)

    @rule(base=st.integers(0, 2), plen=st.integers(4, 24), ns=st.sampled_from(["", "lora"]),
          suffix=st.lists(st.integers(0, 40), max_size=4), num_decode=st.integers(0, 3),
          chunked=st.booleans())  # fmt: skip
    def serve_one(self, base, plen, ns, suffix, num_decode, chunked):
        """A whole request in one step (arrive, lease, prefill, decode, finish), so that
        short runs still build a tree worth matching against and evicting from."""
        self.arrive(base, plen, ns, suffix)
        rid = f"r{self.next_id}"
        w = self.waiting[rid]
        total = len(w.target) + num_decode
        self.lease(max(_ceil_div(total, self.ps) - len(w.prefix) - len(self.pool), 0), True)
        self.admit_one(rid, len(w.target), 0)
        if rid not in self.running:
            return
        if chunked:
            self.chunk_one(rid)
        for i in range(num_decode):
            self.advance_one(rid, 1, 7 + i)
        self.release_one(rid, "finished")

    @rule(base=st.integers(0, 2), plen=st.integers(6, 20), finish=st.booleans())
    def twins(self, base, plen, finish):
        """Two identical prompts prefilled side by side: the second one's chunk finds
        its positions already cached, so its pages are kept aside, then freed."""
        rids = []
        for _ in range(2):
            self.arrive(base, plen, "", [])
            rids.append(f"r{self.next_id}")
            w = self.waiting[rids[-1]]
            self.lease(max(_ceil_div(len(w.target), self.ps) - len(self.pool), 0), True)
            self.admit_one(rids[-1], plen, 0)
        for rid in rids:
            if rid in self.running:
                self.chunk_one(rid)
        for rid in rids:
            if finish and rid in self.running:
                self.release_one(rid, "finished")

    @rule(n=st.integers(0, 10), deliver=st.booleans())
    def lease(self, n, deliver):
        self.seq += 1
        t = self.core.tree
        can = self.core.ledger.num_free + t.num_pages - t.num_locked_pages
        out = self.send(LeaseRequest(self.seq, n))
        g = out[-1]
        assert isinstance(g, LeaseGranted) and g.lease_seq == self.seq
        assert len(g.pages) == min(n, can), (len(g.pages), n, can)
        assert all(self.core.ledger.owner[p] == OUT for p in g.pages)
        self.pending.append((self.seq, g.pages))
        if deliver:
            self.deliver()

    @rule()
    def deliver(self):
        for seq, pages in self.pending:
            self.pool += pages
            self.delivered_seq = seq
        self.pending.clear()

    @rule(k=st.integers(1, 6))
    def give_back(self, k):
        pages, self.pool = self.pool[:k], self.pool[k:]
        assert self.send(LeaseReturned(pages)) == []

    # -- rules: requests ------------------------------------------------------------

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 24), extra=st.integers(0, 1))
    def admit(self, data, chunk, extra):
        self.admit_one(data.draw(st.sampled_from(sorted(self.waiting))), chunk, extra)

    def admit_one(self, rid: str, chunk: int, extra: int) -> None:
        w = self.waiting[rid]
        if w.stale:
            self.refresh_one(rid)
        computed = w.target[: w.num_cached + chunk]
        pages = self.take(_ceil_div(len(computed), self.ps) - len(w.prefix) + extra)
        if pages is None:
            return
        del self.waiting[rid]
        self.running[rid] = _Running(w, computed, w.prefix + pages)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), chunk=st.integers(1, 12), token=st.integers(0, 40))
    def advance(self, data, chunk, token):
        self.advance_one(data.draw(st.sampled_from(sorted(self.running))), chunk, token)

    def advance_one(self, rid: str, chunk: int, token: int) -> None:
        r = self.running[rid]
        if len(r.computed) < len(r.target):
            new = r.target[: len(r.computed) + chunk]
        else:
            new = [*r.computed, token]
        pages = self.take(max(_ceil_div(len(new), self.ps) - len(r.row), 0))
        if pages is not None:
            r.computed, r.row = new, r.row + pages

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def chunk_cached(self, data):
        self.chunk_one(data.draw(st.sampled_from(sorted(self.running))))

    def chunk_one(self, rid: str) -> None:
        r = self.running[rid]
        out = self.send(ChunkCached(rid, r.computed, r.row))
        assert all(isinstance(o, BlockStored) for o in out), out
        r.own_from = max(r.own_from, min(len(r.computed) // self.ps, len(r.row)))

    @precondition(lambda self: self.running)
    @rule(data=st.data(), reason=st.sampled_from(["finished", "aborted", "retracted"]))
    def release(self, data, reason):
        self.release_one(data.draw(st.sampled_from(sorted(self.running))), reason)

    def release_one(self, rid: str, reason: str) -> None:
        r = self.running.pop(rid)
        msg = SequenceReleased(rid, r.computed, r.row, reason)
        out = self.send(msg)
        events = [o for o in out if not isinstance(o, Matched)]
        assert all(isinstance(o, BlockStored) for o in events), out
        if reason == "retracted":
            target = r.target if len(r.target) > len(r.computed) else r.computed
            m = self.check_match([o for o in out if isinstance(o, Matched)], rid, r.computed)
            self.waiting[rid] = _Waiting(r.tok, target, m, r.computed)
        else:
            assert not any(isinstance(o, Matched) for o in out)
            self.released.append(msg)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), with_prefix=st.booleans())
    def abort_waiting(self, data, with_prefix):
        rid = data.draw(st.sampled_from(sorted(self.waiting)))
        w = self.waiting.pop(rid)
        msg = SequenceReleased(rid, w.target[: w.num_cached] if with_prefix else [],
                               w.prefix if with_prefix else [], "aborted")  # fmt: skip
        assert self.send(msg) == []

    def refresh_one(self, rid: str) -> None:
        w = self.waiting[rid]
        m = self.check_match(self.send(RefreshMatch(rid)), rid, w.key)
        w.num_cached, w.prefix, w.stale = m.num_cached_tokens, m.prefix_pages, False

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def refresh(self, data):
        self.refresh_one(data.draw(st.sampled_from(sorted(self.waiting))))

    # -- rules: frees that must be refused ------------------------------------------

    @rule(data=st.data(), kind=st.sampled_from(["free", "tree", "twice", "released", "row+free"]))
    def bad_free(self, data, kind):
        ledger = self.core.ledger
        if kind == "free" and ledger.num_free:
            p = data.draw(st.sampled_from(ledger.pages_owned_by(FREE)))
            self.check_refused(LeaseReturned([p]))
        elif kind == "tree" and ledger.counts[TREE]:
            p = data.draw(st.sampled_from(ledger.pages_owned_by(TREE)))
            self.check_refused(LeaseReturned([p]))
        elif kind == "twice" and self.pool:
            self.check_refused(LeaseReturned([self.pool[0], self.pool[0]]))
        elif kind == "released" and self.released:
            self.check_refused(data.draw(st.sampled_from(self.released)))
        elif kind == "row+free" and self.running and ledger.num_free:
            rid = data.draw(st.sampled_from(sorted(self.running)))
            r = self.running[rid]
            p = data.draw(st.sampled_from(ledger.pages_owned_by(FREE)))
            self.check_refused(SequenceReleased(rid, r.computed, [*r.row, p]))

    # -- rules: copies and drops ------------------------------------------------------

    @rule()
    def copy_start(self):
        self.next_copy += 1
        self.copies.add(self.next_copy)
        assert self.send(SpillPages(self.next_copy, [], [], [])) == []

    @precondition(lambda self: self.copies)
    @rule()
    def copy_done(self):
        cid = min(self.copies)
        self.copies.discard(cid)
        assert self.send(PagesSpilled(cid, [])) == []

    @rule(include_locked=st.booleans())
    def drop(self, include_locked):
        if include_locked and self.running:
            return  # a flip drains or retracts running requests first
        t = self.core.tree
        num_tree, locked = t.num_pages, t.num_locked_nodes
        before = self.snapshot()
        out = self.send(DropTree(f"f{self.step}", include_locked))
        res = out[-1]
        assert isinstance(res, TreeDropped)
        if self.copies or (locked and not include_locked):
            assert not res.ok and res.reason and len(out) == 1
            assert self.snapshot() == before
            return
        assert res.ok and res.num_pages_reclaimed == num_tree and res.tree_version == t.version
        assert isinstance(out[0], AllBlocksCleared) or not self.emit_kv_events
        assert t.num_pages == 0 and self.core.ledger.counts[TREE] == 0
        for w in self.waiting.values():
            w.stale = True

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


class CacheMachinePaged(CacheMachine):
    page_size = 4
    num_pages = 12


class CacheMachineNoEvents(CacheMachine):
    emit_kv_events = False
    num_pages = 8


class CacheMachineNoRadix(CacheMachine):
    disable_radix_cache = True
    num_pages = 10


QUICK = settings(max_examples=40, stateful_step_count=40, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow])  # fmt: skip

TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = QUICK
TestCacheMachinePaged = CacheMachinePaged.TestCase
TestCacheMachinePaged.settings = QUICK
TestCacheMachineNoEvents = CacheMachineNoEvents.TestCase
TestCacheMachineNoEvents.settings = settings(QUICK, max_examples=15)
TestCacheMachineNoRadix = CacheMachineNoRadix.TestCase
TestCacheMachineNoRadix.settings = settings(QUICK, max_examples=15)


@pytest.mark.heavy
def test_fuzz_100k_steps():
    """Seeded (derandomized) long run over both page sizes: at least 100k steps in all."""
    from hypothesis.stateful import run_state_machine_as_test

    num_steps = [0]

    def counted(machine):
        class Counted(machine):
            def teardown(self):
                num_steps[0] += self.step

        return Counted

    long = settings(max_examples=140, stateful_step_count=500, deadline=None,
                    derandomize=True, database=None, suppress_health_check=list(HealthCheck))  # fmt: skip
    for machine in (CacheMachine, CacheMachinePaged):
        run_state_machine_as_test(counted(machine), settings=long)
    assert num_steps[0] >= 100_000, num_steps[0]
