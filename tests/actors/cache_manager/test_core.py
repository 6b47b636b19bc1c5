"""Cache manager core, message by message: matches, releases, chunks, leases, census,
refused frees, drops, KV events, config."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from shunter.actors.cache_manager.allocator import ASIDE, OUT, TREE
from shunter.actors.cache_manager.config import CacheConfig
from shunter.actors.cache_manager.core import CacheManagerCore
from shunter.actors.cache_manager.radix import block_hash
from shunter.bus.messages import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheStats,
    Census,
    CensusBroken,
    ChunkCached,
    DropTree,
    FreeRefused,
    HealthPing,
    LeaseGranted,
    LeaseRequest,
    LeaseReturned,
    Matched,
    PagesLoaded,
    PagesSpilled,
    RefreshMatch,
    RequestFailed,
    SamplingParams,
    SchedulerCensus,
    SequenceReleased,
    Tick,
    Tokenized,
)

SP = SamplingParams()


def make(num_pages=32, page_size=1, **kw) -> CacheManagerCore:
    return CacheManagerCore(CacheConfig(num_pages=num_pages, page_size=page_size, **kw))


def tok(rid: str, ids: list[int], ns: str = "") -> Tokenized:
    return Tokenized(rid, ids, SP, extra_key=ns)


def lease(core: CacheManagerCore, seq: int, n: int) -> list[int]:
    g = core.handle(LeaseRequest(seq, n))[-1]
    assert isinstance(g, LeaseGranted)
    return g.pages


def serve(core, rid, ids, seq, ns="") -> list[int]:
    """Match, lease, compute and finish one request; returns its pages."""
    (m,) = core.handle(tok(rid, ids, ns))
    ps = core.page_size
    pages = m.prefix_pages + lease(core, seq, -(-len(ids) // ps) - len(m.prefix_pages))
    core.handle(SequenceReleased(rid, ids, pages))
    return pages


def test_match_is_page_aligned_and_leaves_one_token():
    core = make(page_size=4)
    serve(core, "a", list(range(12)), 1)
    assert core.ledger.counts[TREE] == 3
    (m,) = core.handle(tok("b", list(range(12))))  # all cached, but one must be computed
    assert isinstance(m, Matched) and m.num_cached_tokens == 8 and len(m.prefix_pages) == 2
    (m,) = core.handle(tok("c", list(range(13))))
    assert m.num_cached_tokens == 12 and m.tree_version == 1
    (m,) = core.handle(tok("d", [0, 1, 2, 3, 4, 5, 9, 9, 9]))
    assert m.num_cached_tokens == 4
    s = core.statistics()
    assert (s.num_matches, s.num_hit_tokens, s.num_queried_tokens) == (4, 24, 46)
    assert s.hit_rate == pytest.approx(24 / 46)


def test_release_frees_partial_page_surplus_and_duplicates():
    core = make(page_size=4)
    ids = list(range(10))  # 2 whole pages + a partial one
    (m,) = core.handle(tok("a", ids))
    pages = lease(core, 1, 4)  # one more than needed: surplus
    (stored,) = core.handle(SequenceReleased("a", ids, pages))
    assert isinstance(stored, BlockStored) and stored.token_ids == ids[:8]
    assert core.ledger.pages_owned_by(TREE) == sorted(pages[:2])
    assert core.ledger.num_free == 30
    # b computed the same 8 tokens in its own pages (matched before a finished)
    (m,) = core.handle(tok("b", [*ids[:8], 50, 51]))
    assert m.num_cached_tokens == 8
    core2 = make(page_size=4)
    core2.handle(tok("a", ids))
    core2.handle(tok("b", ids))  # both match nothing
    pa, pb = lease(core2, 1, 3), lease(core2, 2, 3)
    core2.handle(SequenceReleased("a", ids, pa))
    out = core2.handle(SequenceReleased("b", ids, pb))
    assert out == []  # nothing new for the tree
    assert core2.ledger.pages_owned_by(TREE) == sorted(pa[:2])
    assert core2.ledger.num_free == 30  # b's 2 duplicates and both partial pages freed
    assert core2.statistics().num_requests == 0


def test_chunk_moves_lock_and_followers_share():
    core = make()
    prompt = list(range(20))
    core.handle(tok("a", prompt))
    pages = lease(core, 1, 20)
    (stored,) = core.handle(ChunkCached("a", prompt[:8], pages[:10]))  # 2 pages pre-allocated
    assert stored.token_ids == prompt[:8]
    assert core.tree.num_locked_pages == 8 and core.ledger.counts[TREE] == 8
    (m,) = core.handle(tok("b", [*prompt[:8], 99]))
    assert m.prefix_pages == pages[:8]
    # a's lock holds the chunk against eviction: a lease finds nothing to evict
    assert core.handle(LeaseRequest(2, 100))[-1].num_evicted_pages == 0
    core.handle(ChunkCached("a", prompt[:16], pages[:16]))
    assert core.tree.num_locked_pages == 16
    core.handle(ChunkCached("a", prompt[:4], pages[:4]))  # shorter: the lock stays deep
    assert core.tree.num_locked_pages == 16
    core.handle(SequenceReleased("a", prompt, pages))
    assert core.tree.num_locked_pages == 8  # b still holds its 8


def test_chunk_over_cached_positions_keeps_pages_aside_until_release():
    core = make()
    prompt = list(range(10))
    core.handle(tok("a", prompt))
    core.handle(tok("b", prompt))
    pa, pb = lease(core, 1, 10), lease(core, 2, 10)
    core.handle(ChunkCached("a", prompt, pa))
    assert core.handle(ChunkCached("b", prompt, pb)) == []  # the tree had them all
    assert core.ledger.counts[ASIDE] == 10 and core.ledger.counts[TREE] == 10
    # b's row still reads its own pages, so the census counts them as held
    (c,) = core.handle(SchedulerCensus(1, 2, 0, 0))
    assert c.ok and c.held_by_requests == 10 and c.cached_in_tree == 10
    # a release that does not list them still frees them
    core.handle(SequenceReleased("b", [], []))
    assert core.ledger.counts[ASIDE] == 0 and core.ledger.num_free == 22


def test_retracted_request_is_matched_again_over_its_computed_tokens():
    core = make()
    prompt = [5, 6, 7, 8]
    core.handle(tok("a", prompt))
    pages = lease(core, 1, 7)
    computed = [*prompt, 40, 41, 42]
    out = core.handle(SequenceReleased("a", computed, pages, "retracted"))
    stored, m = out
    assert isinstance(stored, BlockStored) and isinstance(m, Matched)
    # all of them: a running request holds more tokens than it computed (its last
    # sample, or the rest of its prompt), so one is left to compute anyway
    assert m.request.input_ids == prompt and m.num_cached_tokens == 7
    assert m.prefix_pages == pages[:7] and m.tree_version == 1
    assert core.tree.num_locked_pages == 7 and "a" in core.requests
    (m2,) = core.handle(RefreshMatch("a"))  # refresh keeps matching the computed tokens
    assert m2.num_cached_tokens == 7 and core.tree.num_locked_pages == 7
    assert core.handle(RefreshMatch("zzz")) == []


def test_prompt_logprobs_bound_the_match_to_what_they_score():
    """The token at logprob_start_len s is scored by the logits at s - 1, so a match
    covers at most max(s - 1, 0) tokens (page-aligned). A retracted request is matched
    over what it computed: all of it after its prompt, and inside its prompt all but
    the position that scores the next token."""
    core = make(page_size=4)
    ids = list(range(16))
    serve(core, "a", ids, 1)

    def match(rid: str, start: int) -> Matched:
        (m,) = core.handle(Tokenized(rid, ids, SamplingParams(logprob_start_len=start)))
        return m

    got = {s: match(f"s{s}", s).num_cached_tokens for s in (-1, 0, 1, 5, 6, 9, 13, 16)}
    assert got == {-1: 12, 0: 0, 1: 0, 5: 4, 6: 4, 9: 8, 13: 12, 16: 12}
    (m,) = core.handle(RefreshMatch("s6"))  # a refresh keeps the bound
    assert m.num_cached_tokens == 4
    # retracted before computing anything: matched over its prompt again, bound kept
    (m,) = core.handle(SequenceReleased("s0", [], lease(core, 2, 4), "retracted"))
    assert m.num_cached_tokens == 0
    pages = m.prefix_pages + lease(core, 3, 17)
    out = core.handle(SequenceReleased("s0", [*ids, 99], pages, "retracted"))
    assert out[-1].num_cached_tokens == 16
    # retracted inside its prompt: reported up to position 11, and the logits at 11
    # score position 12, so at most 11 tokens (8, page-aligned) come from the cache
    (m,) = core.handle(RefreshMatch("s5"))
    pages = m.prefix_pages + lease(core, 4, 2)
    out = core.handle(SequenceReleased("s5", ids[:12], pages, "retracted"))
    assert out[-1].num_cached_tokens == 8


def test_bad_frees_are_refused_and_change_nothing():
    core = make(page_size=2)
    ids = list(range(8))
    pages = serve(core, "a", ids, 1)
    core.handle(tok("b", ids))
    own = lease(core, 2, 4)
    before = (bytes(core.ledger.owner), core.ledger.pages_owned_by(0), core.statistics())
    cases = [
        (LeaseReturned([core.ledger.pages_owned_by(0)[0]]), "already free"),
        (LeaseReturned([pages[0]]), "owned by the prefix tree"),
        (LeaseReturned([own[0], own[0]]), "listed twice"),
        (LeaseReturned([10_000]), "no such page"),
        (SequenceReleased("a", ids, pages), "unknown request"),
        (ChunkCached("nope", ids, own), "unknown request"),
        # b's pages with the tree's pages in the wrong positions
        (SequenceReleased("b", ids, [pages[1], pages[0], *own[2:]]), "owned by the prefix tree"),
        (SequenceReleased("b", [], [pages[0]]), "owned by the prefix tree"),
    ]
    for msg, why in cases:
        (r,) = core.handle(msg)
        assert isinstance(r, FreeRefused) and why in r.reason, (msg, r)
        after = core.statistics()
        assert bytes(core.ledger.owner) == before[0] and core.ledger.pages_owned_by(0) == before[1]
        assert after.num_free_refused > 0
    assert core.statistics().num_free_refused == len(cases)
    # the right pages: all cached already, so nothing to store; own[1:] are surplus
    assert core.handle(SequenceReleased("b", ids, [*pages[:3], own[0], *own[1:]])) == []
    assert core.ledger.num_free == 32 - 4


def test_census_counts_grants_in_flight_and_names_a_mismatch():
    core = make(num_pages=16)
    lease(core, 1, 4)
    lease(core, 2, 3)
    (c,) = core.handle(SchedulerCensus(1, 1, 4, 0))  # grant 2 not received yet
    assert c == Census(1, "device", 16, 9, 7, 0, 0, True)
    (c,) = core.handle(SchedulerCensus(2, 2, 5, 2))
    assert c.ok and c.leased_unused == 5 and c.held_by_requests == 2
    out = core.handle(SchedulerCensus(3, 2, 5, 1))  # the scheduler lost a page
    assert isinstance(out[0], Census) and not out[0].ok
    broken = out[1]
    assert isinstance(broken, CensusBroken) and broken.difference == -1
    assert "7 pages are leased out" in broken.detail
    assert core.statistics().num_census_broken == 1


def test_lease_evicts_lru_and_grants_short_when_the_pool_is():
    core = make(num_pages=8, page_size=2)
    serve(core, "a", [1, 1, 1, 1], 1)  # 2 pages
    serve(core, "b", [2, 2, 2, 2], 2)  # 2 pages
    a_hashes = core.tree.roots[""].children[(1, 1)].hashes
    core.handle(tok("c", [2, 2, 2, 2, 2]))  # locks b's prefix
    held = lease(core, 3, 4)
    out = core.handle(LeaseRequest(4, 3))
    removed, g = out
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == a_hashes
    assert g.num_evicted_pages == 2 and len(g.pages) == 2  # b is locked: short grant
    (g,) = core.handle(LeaseRequest(5, 2))
    assert g.pages == [] and g.num_evicted_pages == 0
    assert core.handle(LeaseReturned(held)) == []
    assert core.ledger.num_free == 4


def test_kv_events_content_and_namespaces():
    core = make(page_size=2)
    (m,) = core.handle(tok("a", [1, 2, 3, 4, 5], ns="lora7"))
    pages = lease(core, 1, 3)
    (s1,) = core.handle(SequenceReleased("a", [1, 2, 3, 4, 5], pages))
    h1 = block_hash(None, [1, 2], "lora7")
    h2 = block_hash(h1, [3, 4])
    assert s1 == BlockStored([h1, h2], None, [1, 2, 3, 4], 2, "lora7")
    (m,) = core.handle(tok("b", [1, 2, 3, 4, 7, 8, 0], ns="lora7"))
    more = lease(core, 2, 2)
    (s2,) = core.handle(SequenceReleased("b", [1, 2, 3, 4, 7, 8], m.prefix_pages + more))
    assert s2 == BlockStored([block_hash(h2, [7, 8])], h2, [7, 8], 2, "lora7")
    (m,) = core.handle(tok("c", [1, 2, 3, 4, 7, 8, 0]))  # other namespace: no hit
    assert m.num_cached_tokens == 0
    core.handle(SequenceReleased("c", [], []))
    out = core.handle(DropTree("f1"))
    assert isinstance(out[0], AllBlocksCleared) and out[1].num_pages_reclaimed == 3


def test_flush_is_refused_while_a_prefix_is_locked():
    core = make()
    serve(core, "a", list(range(6)), 1)
    core.handle(tok("b", list(range(7))))
    assert core.handle(PagesSpilled(1, [11])) == []  # no such copy: ignored
    (r,) = core.handle(DropTree("flush", include_locked=False))
    assert not r.ok and "1 requests hold prefix locks" in r.reason
    assert core.ledger.counts[TREE] == 6
    _cleared, r = core.handle(DropTree("f", include_locked=True))
    assert r.ok and r.num_pages_reclaimed == 6 and r.tree_version == 2
    assert core.ledger.num_free == 32 and core.tree.num_pages == 0


def test_a_request_waiting_across_a_drop_never_frees_its_old_prefix():
    core = make(num_pages=8)
    ids = list(range(6))
    serve(core, "a", ids, 1)
    (m,) = core.handle(tok("b", ids))
    assert m.prefix_pages == [0, 1, 2, 3, 4]
    core.handle(DropTree("f"))
    taken = lease(core, 2, 8)  # the old prefix pages now lease to someone else
    assert set(m.prefix_pages) <= set(taken)
    # b is aborted while waiting, with its (stale) match: nothing of it may be freed
    assert core.handle(SequenceReleased("b", ids[:5], m.prefix_pages, "aborted")) == []
    assert core.ledger.num_free == 0 and core.statistics().num_requests == 0


def test_radix_disabled_matches_nothing_and_frees_everything():
    core = make(disable_radix_cache=True)
    ids = list(range(8))
    pages = serve(core, "a", ids, 1)
    assert len(pages) == 8 and core.ledger.num_free == 32 and core.tree.num_pages == 0
    (m,) = core.handle(tok("b", ids))
    assert m.num_cached_tokens == 0
    pages = lease(core, 2, 8)
    assert core.handle(ChunkCached("b", ids[:4], pages)) == []
    assert core.ledger.counts[ASIDE] == 4
    (c,) = core.handle(SchedulerCensus(1, 2, 0, 4))
    assert c.ok
    assert core.handle(SequenceReleased("b", ids, pages, "aborted")) == []
    assert core.ledger.num_free == 32


def test_duplicate_request_id_and_unknown_message():
    core = make()
    core.handle(tok("a", [1, 2, 3]))
    (f,) = core.handle(tok("a", [1, 2, 3]))
    assert isinstance(f, RequestFailed) and f.code == "invalid_request"
    with pytest.raises(TypeError, match="HealthPing"):
        core.handle(HealthPing("p", "cache"))


def test_a_tick_sends_the_figures_when_they_changed():
    """Tick asks for CacheStats: sent when the figures moved since the last one, not
    otherwise, and the tree's clock (its LRU order) does not move with ticks."""
    core = make(page_size=1)
    (first,) = core.handle(Tick(1))
    assert isinstance(first, CacheStats)
    assert (first.num_pages, first.num_free, first.num_in_tree, first.num_host_pages) == (
        32,
        32,
        0,
        0,
    )
    assert core.handle(Tick(2)) == []
    clock = core._clock
    serve(core, "a", [1, 2, 3, 4], 1)
    core.handle(tok("b", [1, 2, 3, 9]))
    (s,) = core.handle(Tick(3))
    assert (s.num_in_tree, s.num_queried_tokens, s.num_hit_tokens) == (4, 8, 3)
    assert s.num_free == 32 - 4
    assert core._clock == clock + 4  # a lease, a release and two matches; no ticks
    assert core.handle(Tick(4)) == []


def test_unchanged_figures_go_out_again_every_refresh_interval_of_tick_time():
    """A gateway that subscribed after the last change (multi-process servers start it
    after the cache manager) still gets the figures: unchanged, they are re-sent once
    STATS_REFRESH_NS of Tick time has passed since they last went out."""
    from shunter.actors.cache_manager.books import STATS_REFRESH_NS

    core = make(page_size=1)
    t0 = 10**12
    (first,) = core.handle(Tick(t0))
    assert core.handle(Tick(t0 + STATS_REFRESH_NS - 1)) == []
    (again,) = core.handle(Tick(t0 + STATS_REFRESH_NS))
    assert again == first
    assert core.handle(Tick(t0 + STATS_REFRESH_NS + 1)) == []  # counted from the resend


def test_config_validation_and_info_round_trip():
    for kw, match in [
        ({"num_pages": 0}, "num_pages"),
        ({"num_pages": 4, "page_size": 0}, "page_size"),
        ({"num_pages": 4, "eviction_policy": "slru"}, "eviction_policy"),
    ]:
        with pytest.raises(ValueError, match=match):
            CacheConfig(**kw)
    cfg = CacheConfig(num_pages=100, page_size=16, disable_radix_cache=True, emit_kv_events=False)
    assert CacheConfig.from_info(cfg.to_info()) == cfg
    assert cfg.num_tokens == 1600
    with pytest.raises(ValueError, match="num_pages"):
        CacheConfig.from_info({"page_size": 1})


_ids = st.sampled_from(["a", "b", "c"])
_toks = st.lists(st.integers(0, 4), max_size=12)
_pages = st.lists(st.integers(-1, 16), max_size=8)
_any_inbox = st.one_of(
    st.builds(Tokenized, _ids, _toks, st.just(SP), extra_key=st.sampled_from(["", "x"])),
    st.builds(RefreshMatch, _ids),
    st.builds(LeaseRequest, st.integers(0, 50), st.integers(-2, 20)),
    st.builds(LeaseReturned, _pages),
    st.builds(ChunkCached, _ids, _toks, _pages),
    st.builds(
        SequenceReleased, _ids, _toks, _pages, st.sampled_from(["finished", "aborted", "retracted"])
    ),
    st.builds(
        SchedulerCensus, st.integers(0, 9), st.integers(0, 50), st.integers(0, 9), st.integers(0, 9)
    ),
    st.builds(DropTree, st.just("f"), st.booleans()),
    st.builds(PagesSpilled, st.integers(0, 4), st.just([]), st.booleans()),
    st.builds(PagesLoaded, st.integers(0, 4), st.just([]), st.booleans()),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_any_inbox, max_size=40), st.sampled_from([1, 2]), st.sampled_from([0, 6]))
def test_any_message_sequence_keeps_the_books_whole(msgs, page_size, num_host_pages):
    """Garbage in (wrong pages, unknown ids, double releases, copy replies in any order):
    never an exception, and the ledger, the tree and the locks stay consistent with each
    other."""
    core = make(num_pages=16, page_size=page_size, num_host_pages=num_host_pages)
    for msg in msgs:
        core.handle(msg)
        core.ledger.check()
        tree_pages = core.tree.all_pages()
        assert len(tree_pages) == len(set(tree_pages)) == core.tree.num_pages
        assert set(tree_pages) == set(core.ledger.pages_owned_by(TREE))
        assert set(core._aside_owner) == set(core.ledger.pages_owned_by(ASIDE))
        locks: dict[int, int] = {}
        for req in core.requests.values():
            n = req.node
            while n is not None and n.parent is not None:
                locks[n.node_id] = locks.get(n.node_id, 0) + 1
                n = n.parent
        assert all(n.lock_ref == locks.get(n.node_id, 0) for n in core.tree.nodes())
        if core.host is not None:
            core.host.ledger.check()
            assert (
                core.host.ledger.counts[TREE] + core.host.ledger.counts[OUT]
                == core.tree.num_host_pages
            )
