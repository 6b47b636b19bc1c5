"""Hypothesis state machines: a model scheduler driving the real cache manager core.

The machine plays the scheduler's side of the protocol in bus/messages/cache.py:
requests arrive and are matched, leases come back now or later (in flight), prefills
run in chunks (ChunkCached), decode steps append tokens, requests finish, abort,
retract or refresh, pages are returned, copies start and end, the tree is dropped.
It also tries frees that must be refused. The plumbing and the books checked after
every step are in conftest.py (`CacheMachineBase`); here are the rules, the quick
runs over four configurations, and the long seeded run (heavy).
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import precondition, rule

from shunter.actors.cache_manager.allocator import FREE, OUT, TREE
from shunter.bus.messages import (
    AllBlocksCleared,
    BlockStored,
    ChunkCached,
    DropTree,
    LeaseGranted,
    LeaseRequest,
    LeaseReturned,
    Matched,
    PagesLoaded,
    PagesSpilled,
    RefreshMatch,
    SamplingParams,
    SequenceReleased,
    SpillPages,
    Tokenized,
    TreeDropped,
)
from tests.actors.cache_manager.conftest import CacheMachineBase, _Running, _Waiting

SP = SamplingParams(max_new_tokens=8)
BASES = [
    list(range(100, 124)),
    list(range(100, 108)) + list(range(200, 216)),
    list(range(300, 324)),
]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class CacheMachine(CacheMachineBase):
    # -- rules: arrivals and leases -----------------------------------------------

    @rule(base=st.integers(0, 2), plen=st.integers(0, 24), ns=st.sampled_from(["", "", "lora"]),
          suffix=st.lists(st.integers(0, 40), max_size=6))  # fmt: skip
    def arrive(self, base, plen, ns, suffix):
        tokens = BASES[base][:plen] + suffix or [1]
        rid = self.new_id()
        tok = Tokenized(rid, tokens, SP, extra_key=ns)
        lower = self.oracle_match(ns, tokens, device_only=True) if self.host else 0
        m = self.check_match(self.send(tok), rid, tokens, lower=lower)
        if m is None:
            self.loading[rid] = (tok, tokens, tokens, None)
            return
        self.waiting[rid] = _Waiting(tok, tokens, m, tokens, None)

    @rule(base=st.integers(0, 2), plen=st.integers(4, 24), ns=st.sampled_from(["", "lora"]),
          suffix=st.lists(st.integers(0, 40), max_size=4), num_decode=st.integers(0, 3),
          chunked=st.booleans())  # fmt: skip
    def serve_one(self, base, plen, ns, suffix, num_decode, chunked):
        """A whole request in one step (arrive, lease, prefill, decode, finish), so that
        short runs still build a tree worth matching against and evicting from."""
        self.arrive(base, plen, ns, suffix)
        rid = f"r{self.next_id}"
        w = self.waiting.get(rid)
        if w is None:  # its Matched waits for a load
            return
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
            w = self.waiting.get(rids[-1])
            if w is None:
                continue
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
        if self.host:  # leaves whose backup is in flight are not evicted (yet)
            assert len(g.pages) <= min(n, can), (len(g.pages), n, can)
        else:
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

    @rule()
    def squeeze(self):
        """Lease every page the cache can free, then give them all back: the tree
        keeps only what is locked (and, with a host tier, its host copies)."""
        self.lease(self.num_pages, True)
        self.give_back(len(self.pool))

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
        if self.drops_pending:  # a flip has paused admission
            return
        w = self.waiting[rid]
        if w.stale:
            self.refresh_one(rid)
            if rid not in self.waiting:
                return
        computed = w.target[: w.num_cached + chunk]
        pages = self.take(_ceil_div(len(computed), self.ps) - len(w.prefix) + extra)
        if pages is None:
            return
        del self.waiting[rid]
        self.running[rid] = _Running(w, computed, w.prefix + pages)
        self.compute(self.running[rid])

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
            self.compute(r)

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
            # all it computed may be cached: it holds more tokens than that
            m = self.check_match([o for o in out if isinstance(o, Matched)], rid, r.computed,
                                 len(r.computed))  # fmt: skip
            if m is None:
                self.loading[rid] = (r.tok, target, r.computed, len(r.computed))
                return
            self.waiting[rid] = _Waiting(r.tok, target, m, r.computed, len(r.computed))
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
        ns = w.tok.extra_key
        lower = self.oracle_match(ns, w.key, w.limit, device_only=True) if self.host else 0
        m = self.check_match(self.send(RefreshMatch(rid)), rid, w.key, w.limit, lower)
        if m is None:
            del self.waiting[rid]
            self.loading[rid] = (w.tok, w.target, w.key, w.limit)
            return
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

    @precondition(lambda self: self.copies_out)
    @rule(ok=st.sampled_from([True, True, True, False]))
    def copy_answer(self, ok):
        """The executor answers the oldest copy: the data moves (or, failed, garbage
        lands), then the reply may release Matched messages and a waiting drop."""
        c = self.copies_out.pop(0)
        if isinstance(c, SpillPages):
            if ok:
                for d, h in zip(c.device_pages, c.host_pages, strict=True):
                    self.host_data[h] = self.dev[d]
            out = self.send(PagesSpilled(c.copy_id, c.keys, ok))
        else:
            for d, h in zip(c.device_pages, c.host_pages, strict=True):
                self.dev[d] = self.host_data[h] if ok else (-1,)
            out = self.send(PagesLoaded(c.copy_id, c.keys, ok))
        dropped = any(isinstance(o, TreeDropped) and o.ok for o in out)
        for o in out:
            if isinstance(o, Matched):
                rid = o.request.request_id
                tok, target, key, limit = self.loading.pop(rid)
                if not dropped:  # (else its pages went with the tree: stale, see below)
                    self.check_matched(o, key)
                self.waiting[rid] = _Waiting(tok, target, o, key, limit)
            elif isinstance(o, TreeDropped):
                self.drops_pending -= 1
                self.check_dropped(o)
            else:
                assert isinstance(o, AllBlocksCleared), o

    def check_dropped(self, res: TreeDropped) -> None:
        t = self.core.tree
        if not res.ok:
            assert "prefix locks" in res.reason
            return
        # (drops held together are carried out one after another: the last one's is now)
        assert res.tree_version <= t.version and t.num_pages == t.num_host_pages == 0
        assert self.core.ledger.counts[TREE] == 0
        assert self.core.host is None or self.core.host.ledger.num_free == self.num_host_pages
        for w in self.waiting.values():
            w.stale = True

    @rule(include_locked=st.booleans())
    def drop(self, include_locked):
        if include_locked and self.running:
            return  # a flip drains or retracts running requests first
        t = self.core.tree
        num_tree, locked = t.num_pages, t.num_locked_nodes
        before = self.snapshot()
        out = self.send(DropTree(f"f{self.step}", include_locked))
        if self.copies_out:  # carried out once the copies in flight are answered
            assert out == [] and self.snapshot() == before
            self.drops_pending += 1
            return
        res = out[-1]
        assert isinstance(res, TreeDropped)
        if locked and not include_locked:
            assert not res.ok and res.reason and len(out) == 1
            assert self.snapshot() == before
            return
        assert res.ok and res.num_pages_reclaimed == num_tree and res.tree_version == t.version
        assert isinstance(out[0], AllBlocksCleared) or not self.emit_kv_events
        assert t.num_pages == 0 and self.core.ledger.counts[TREE] == 0
        for w in self.waiting.values():
            w.stale = True


class CacheMachinePaged(CacheMachine):
    page_size = 4
    num_pages = 12


class CacheMachineNoEvents(CacheMachine):
    emit_kv_events = False
    num_pages = 8


class CacheMachineNoRadix(CacheMachine):
    disable_radix_cache = True
    num_pages = 10


class CacheMachineHost(CacheMachine):
    """With a host tier the device pool is small, so that eviction demotes often."""

    num_pages = 14
    num_host_pages = 28


class CacheMachineHostPaged(CacheMachine):
    """A host pool smaller than the device pool: backups are skipped, host leaves go."""

    page_size = 4
    num_pages = 10
    num_host_pages = 6


class CacheMachineHostSelective(CacheMachine):
    num_pages = 14
    num_host_pages = 20
    write_policy = "write_through_selective"


class CacheMachineHostWriteBack(CacheMachine):
    """Backups start at eviction; short grants wait for them."""

    num_pages = 14
    num_host_pages = 20
    write_policy = "write_back"


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
TestCacheMachineHost = CacheMachineHost.TestCase
TestCacheMachineHost.settings = QUICK
TestCacheMachineHostPaged = CacheMachineHostPaged.TestCase
TestCacheMachineHostPaged.settings = QUICK
TestCacheMachineHostSelective = CacheMachineHostSelective.TestCase
TestCacheMachineHostSelective.settings = settings(QUICK, max_examples=20)
TestCacheMachineHostWriteBack = CacheMachineHostWriteBack.TestCase
TestCacheMachineHostWriteBack.settings = settings(QUICK, max_examples=20)


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
    for machine in (CacheMachine, CacheMachinePaged, CacheMachineHost, CacheMachineHostPaged):
        run_state_machine_as_test(counted(machine), settings=long)
    assert num_steps[0] >= 100_000, num_steps[0]
