"""Cache manager core with a file store below the host tier, message by message: blocks
written once their backup lands, read back into host pages for a match (which is then
loaded like any host-only prefix), blocks listed at start, failed reads, weights flips,
and the pages a store copy uses kept from eviction."""

from __future__ import annotations

from shunter.actors.cache_manager.allocator import OUT
from shunter.actors.cache_manager.config import CacheConfig
from shunter.actors.cache_manager.core import CacheManagerCore
from shunter.actors.cache_manager.store_tier import block_keys
from shunter.bus.messages import (
    BlocksErased,
    Census,
    ClearStore,
    DropTree,
    EraseBlocks,
    FetchPages,
    LeaseGranted,
    LeaseRequest,
    LeaseReturned,
    LoadPages,
    Matched,
    PagesFetched,
    PagesLoaded,
    PagesSpilled,
    PagesStored,
    RefreshMatch,
    SamplingParams,
    SchedulerCensus,
    SequenceReleased,
    SpillPages,
    StoreCleared,
    StoreListed,
    StorePages,
    Tick,
    Tokenized,
)
from tests.actors.cache_manager.test_host_tier import Seq, of

SP = SamplingParams()
A = list(range(100, 110))  # 10 tokens: two whole blocks of 4, and 2 more


def make(num_pages=16, num_host_pages=32, page_size=1, block=4, **kw) -> CacheManagerCore:
    return CacheManagerCore(CacheConfig(num_pages=num_pages, page_size=page_size,
                                        num_host_pages=num_host_pages,
                                        store_block_tokens=block, **kw))  # fmt: skip


def serve(core, rid, ids, seq) -> list:
    (m,) = of(core.handle(Tokenized(rid, ids, SP)), Matched)
    n = -(-len(ids) // core.page_size) - len(m.prefix_pages)
    (g,) = of(core.handle(LeaseRequest(seq(), n)), LeaseGranted)
    return core.handle(SequenceReleased(rid, ids, m.prefix_pages + g.pages))


def stored(core, rid, ids, seq) -> StorePages:
    """Serve ids, land its backup and its store write; returns the write."""
    (sp,) = of(serve(core, rid, ids, seq), SpillPages)
    (st,) = of(core.handle(PagesSpilled(sp.copy_id, sp.keys)), StorePages)
    assert core.handle(PagesStored(st.copy_id, st.keys)) == []
    return st


def census_ok(core, seq) -> bool:
    return all(c.ok for c in of(core.handle(SchedulerCensus(seq.n, seq.n, 0, 0)), Census))


def test_block_keys_chain_over_whole_blocks():
    keys = block_keys(0, "", A, 4)
    assert len(keys) == 2 and keys == block_keys(0, "", A[:8], 4)
    assert block_keys(0, "", A[:4], 4) == keys[:1]
    assert block_keys(0, "", [*A[:4], 0, 0, 0, 0], 4)[0] == keys[0]  # a prefix's key
    assert block_keys(0, "", [*A[:4], 0, 0, 0, 0], 4)[1] != keys[1]
    assert block_keys(1, "", A, 4) != keys and block_keys(0, "lora", A, 4) != keys
    assert block_keys(0, "", A[:3], 4) == []


def test_a_landed_backup_writes_its_whole_blocks_once():
    core, seq = make(), Seq()
    (sp,) = of(serve(core, "a", A, seq), SpillPages)
    assert len(sp.host_pages) == 10
    (st,) = of(core.handle(PagesSpilled(sp.copy_id, sp.keys)), StorePages)
    assert st.keys == block_keys(0, "", A, 4) and st.host_pages == sp.host_pages[:8]
    assert core.store.pinned == {h: 1 for h in st.host_pages}
    assert census_ok(core, seq)
    core.handle(PagesStored(st.copy_id, st.keys))
    assert core.store.known.keys() == set(st.keys) and not core.store.pinned
    # a longer sequence backs up its tail only, which completes no new block... the next
    # one of 12 tokens completes the third block: only it is written
    (sp2,) = of(serve(core, "b", [*A, 7, 7], seq), SpillPages)
    (st2,) = of(core.handle(PagesSpilled(sp2.copy_id, sp2.keys)), StorePages)
    assert st2.keys == block_keys(0, "", [*A, 7, 7], 4)[2:]
    assert st2.host_pages == sp.host_pages[8:] + sp2.host_pages
    s = core.statistics()
    assert (s.num_store_blocks, s.num_stored_blocks) == (2, 2)


def test_a_match_reads_the_store_into_host_pages_then_loads_them():
    core, seq = make(), Seq()
    st = stored(core, "a", A, seq)
    core.handle(DropTree("f"))  # the tree is gone, the store is not
    out = core.handle(Tokenized("b", [*A, 1], SP))
    (fp,) = out
    assert isinstance(fp, FetchPages) and fp.keys == st.keys and fp.skip == 0
    assert len(fp.host_pages) == 8 and core.host.ledger.counts[OUT] == 8
    # another request reaching the pages being read waits for the same read
    assert core.handle(Tokenized("c", [*A[:6], 2], SP)) == []
    assert census_ok(core, seq)
    (ld,) = core.handle(PagesFetched(fp.copy_id, fp.keys))  # b loads; c waits on that load
    assert isinstance(ld, LoadPages) and ld.host_pages == fp.host_pages
    mb, mc = core.handle(PagesLoaded(ld.copy_id, ld.keys))
    assert (mb.request.request_id, mb.num_cached_tokens) == ("b", 8)
    assert (mc.request.request_id, mc.num_cached_tokens) == ("c", 6)
    s = core.statistics()
    assert (s.num_fetched_blocks, s.num_store_hit_tokens, s.num_loaded_pages) == (2, 8, 8)
    assert census_ok(core, seq)


def test_a_fresh_core_finds_the_listed_blocks():
    core, seq = make(), Seq()
    st = stored(core, "a", A, seq)
    again = make()
    assert again.handle(StoreListed(st.keys)) == []
    (fp,) = again.handle(Tokenized("b", A, SP))  # 9 of 10 tokens may match: block 0 and 1
    assert isinstance(fp, FetchPages) and fp.keys == st.keys[:2]


def test_a_read_past_the_cached_part_skips_the_pages_it_has():
    core, seq = make(page_size=2), Seq()
    st = stored(core, "a", A, seq)
    again, seq = make(page_size=2), Seq()  # a later server: its tree has the first 6
    serve(again, "x", A[:6], seq)
    again.handle(StoreListed(st.keys))
    (fp,) = of(again.handle(Tokenized("b", [*A, 1], SP)), FetchPages)
    assert fp.keys == st.keys[1:] and fp.skip == 1 and len(fp.host_pages) == 1


def test_a_failed_read_forgets_and_erases_its_blocks_and_matches_again_without_them():
    core, seq = make(), Seq()
    st = stored(core, "a", A, seq)
    core.handle(DropTree("f"))
    (fp,) = core.handle(Tokenized("b", [*A, 1], SP))
    er, m = core.handle(PagesFetched(fp.copy_id, fp.keys, ok=False, error="gone"))
    assert er == EraseBlocks(er.copy_id, st.keys)  # a bad file there would stay forever
    assert isinstance(m, Matched) and m.num_cached_tokens == 0
    assert not core.store.known.keys() & set(st.keys) and census_ok(core, seq)
    assert core.handle(BlocksErased(er.copy_id, er.keys)) == []
    s = core.statistics()
    assert (s.num_store_copies_failed, s.num_store_blocks_evicted) == (1, 0)


def test_new_weights_match_no_earlier_block():
    core, seq = make(), Seq()
    st = stored(core, "a", A, seq)
    core.handle(DropTree("f", weights_changed=True))
    core.handle(StoreListed(st.keys))  # the old files are still there
    (m,) = core.handle(Tokenized("b", [*A, 1], SP))
    assert isinstance(m, Matched) and m.num_cached_tokens == 0
    assert core.store.generation == 1


def test_pages_a_write_reads_stay_until_it_is_answered():
    """Host eviction passes over a host-only prefix whose store write is in flight, and a
    DropTree waits for it."""
    core, seq = make(num_pages=12, num_host_pages=10), Seq()
    (sp,) = of(serve(core, "a", A, seq), SpillPages)
    (st,) = of(core.handle(PagesSpilled(sp.copy_id, sp.keys)), StorePages)
    (g,) = of(core.handle(LeaseRequest(seq(), 12)), LeaseGranted)  # A demoted, host-only
    core.handle(LeaseReturned(g.pages))
    B = list(range(300, 308))
    assert of(core.handle(Tokenized("b", B, SP)), Matched)
    (g,) = of(core.handle(LeaseRequest(seq(), 8)), LeaseGranted)
    out = core.handle(SequenceReleased("b", B, g.pages))
    assert not of(out, SpillPages)  # no host room: A's pages are pinned
    assert core.statistics().num_backups_skipped == 1
    assert core.handle(DropTree("f")) == []  # waits for the write
    out = core.handle(PagesStored(st.copy_id, st.keys))
    assert out and out[-1].ok  # TreeDropped


def test_no_read_where_a_node_the_match_stopped_before_starts():
    """A failed load leaves its node invalid: a match stops before it, and the store
    reads nothing into that place (a second node there would break the tree)."""
    core, seq = make(), Seq()
    st = stored(core, "a", A, seq)
    core.handle(DropTree("f"))
    (fp,) = core.handle(Tokenized("b", [*A, 1], SP))
    (ld,) = core.handle(PagesFetched(fp.copy_id, fp.keys))
    (m,) = core.handle(PagesLoaded(ld.copy_id, ld.keys, ok=False, error="x"))
    assert isinstance(m, Matched) and m.num_cached_tokens == 0  # stops before the invalid
    core.handle(StoreListed(st.keys))  # the blocks known again: still no second node
    (m2,) = core.handle(Tokenized("c", [*A, 2], SP))
    assert isinstance(m2, Matched) and m2.num_cached_tokens == 0
    assert census_ok(core, seq)


def test_a_clear_empties_the_store_and_no_read_follows_it():
    core, seq = make(), Seq()
    st = stored(core, "a", A, seq)
    core.handle(DropTree("f"))
    (er,) = core.handle(ClearStore("c1"))
    assert er == EraseBlocks(er.copy_id, [], everything=True)
    assert not core.store.known and core.statistics().num_store_blocks == 0
    (m,) = core.handle(Tokenized("b", [*A, 1], SP))  # no FetchPages of the erased blocks
    assert isinstance(m, Matched) and m.num_cached_tokens == 0
    (done,) = core.handle(BlocksErased(er.copy_id, []))
    assert done == StoreCleared("c1", ok=True, num_blocks=len(st.keys))
    assert core.handle(BlocksErased(er.copy_id, [])) == []  # answered once
    assert census_ok(core, seq)


def test_a_write_in_flight_at_a_clear_counts_for_nothing_and_later_ones_do():
    """The store runs copies in order: a write sent before the erase lands and is erased
    after it, so its PagesStored must not make its blocks known; a write sent after the
    erase stays."""
    core, seq = make(), Seq()
    (sp,) = of(serve(core, "a", A, seq), SpillPages)
    (st,) = of(core.handle(PagesSpilled(sp.copy_id, sp.keys)), StorePages)
    (er,) = core.handle(ClearStore("c1"))
    assert core.handle(PagesStored(st.copy_id, st.keys)) == []
    assert not core.store.known
    core.handle(BlocksErased(er.copy_id, []))
    B = list(range(200, 210))
    (sp,) = of(serve(core, "b", B, seq), SpillPages)
    (st_b,) = of(core.handle(PagesSpilled(sp.copy_id, sp.keys)), StorePages)
    core.handle(PagesStored(st_b.copy_id, st_b.keys))
    assert core.store.known.keys() == set(st_b.keys) and census_ok(core, seq)


def test_a_write_that_failed_counts_as_failed_though_a_clear_voided_it():
    core, seq = make(), Seq()
    (sp,) = of(serve(core, "a", A, seq), SpillPages)
    (st,) = of(core.handle(PagesSpilled(sp.copy_id, sp.keys)), StorePages)
    core.handle(ClearStore("c1"))
    assert core.handle(PagesStored(st.copy_id, [], ok=False, error="disk full")) == []
    assert core.statistics().num_store_copies_failed == 1 and not core.store.known
    assert census_ok(core, seq)


def test_a_clear_is_refused_without_a_store_and_reports_a_failed_erase():
    (no,) = CacheManagerCore(CacheConfig(num_pages=8, num_host_pages=8)).handle(ClearStore("x"))
    assert no.clear_id == "x" and not no.ok and "--hicache-storage-backend file" in no.reason
    (no,) = CacheManagerCore(CacheConfig(num_pages=8)).handle(ClearStore("y"))
    assert not no.ok
    core = make()
    core.handle(StoreListed([5, 6]))
    (er,) = core.handle(ClearStore("z"))
    (done,) = core.handle(BlocksErased(er.copy_id, [], ok=False, error="read-only file system"))
    assert done == StoreCleared("z", ok=False, num_blocks=2, reason="read-only file system")
    assert not core.store.known  # what is left there is matched no more


def test_best_effort_matches_never_wait_for_the_store():
    """A match the store could extend is answered at once with what the tree holds;
    the read goes on, a second match reaching the blocks being read stops before them,
    and once the read has landed a third one loads them from the host tier."""
    core, seq = make(store_prefetch_policy="best_effort"), Seq()
    st = stored(core, "a", A, seq)
    core.handle(DropTree("f"))
    out = core.handle(Tokenized("b", [*A, 1], SP))
    (fp,) = of(out, FetchPages)
    (mb,) = of(out, Matched)
    assert fp.keys == st.keys and mb.num_cached_tokens == 0
    (mc,) = core.handle(Tokenized("c", [*A, 2], SP))
    assert isinstance(mc, Matched) and mc.num_cached_tokens == 0
    assert core.handle(PagesFetched(fp.copy_id, fp.keys)) == []  # nobody waited
    assert census_ok(core, seq)
    (ld,) = core.handle(Tokenized("d", [*A, 3], SP))
    assert isinstance(ld, LoadPages) and ld.host_pages == fp.host_pages
    (md,) = core.handle(PagesLoaded(ld.copy_id, ld.keys))
    assert md.num_cached_tokens == 8
    assert core.statistics().num_store_hit_tokens == 8


def test_best_effort_keeps_what_the_tree_holds_and_leaves_the_rest_to_the_read():
    """A match is answered with the part the tree holds as ever; only the store's part
    is left to the read."""
    core, seq = make(page_size=2, store_prefetch_policy="best_effort"), Seq()
    st = stored(core, "a", A, seq)
    again, seq = make(page_size=2, store_prefetch_policy="best_effort"), Seq()
    serve(again, "x", A[:6], seq)  # a later server: its tree has the first 6 tokens
    again.handle(StoreListed(st.keys))
    out = again.handle(Tokenized("b", [*A, 1], SP))
    (fp,) = of(out, FetchPages)
    (m,) = of(out, Matched)
    assert fp.skip == 1 and m.num_cached_tokens == 6


def test_a_timeout_match_waits_for_the_store_until_its_ticks_run_out():
    """Under "timeout" a match waits for its read like wait_complete, but the scheduler's
    Ticks end the wait: 1 s + 0.25 s per 1024 tokens from the first Tick after it
    began, then it is answered with what the tree holds; a read landing first is used."""
    core, seq = make(store_prefetch_policy="timeout"), Seq()
    st = stored(core, "a", A, seq)
    core.handle(DropTree("f"))
    (fp,) = core.handle(Tokenized("b", [*A, 1], SP))
    assert isinstance(fp, FetchPages) and fp.keys == st.keys
    s = 1_000_000_000
    assert of(core.handle(Tick(5 * s)), Matched) == []  # the timer starts
    assert of(core.handle(Tick(5 * s + s)), Matched) == []  # 1 s + 0.25 s * 9 / 1024 to go
    (m,) = of(core.handle(Tick(5 * s + 2 * s)), Matched)
    assert m.request.request_id == "b" and m.num_cached_tokens == 0
    assert core.handle(PagesFetched(fp.copy_id, fp.keys)) == []  # nobody waits for it now
    (ld,) = core.handle(Tokenized("c", [*A, 2], SP))  # the read filled the host tier
    assert isinstance(ld, LoadPages)
    assert census_ok(core, seq)
    # a read that lands in time is waited for and used
    core2, seq2 = make(store_prefetch_policy="timeout"), Seq()
    stored(core2, "a", A, seq2)
    core2.handle(DropTree("f"))
    (fp,) = core2.handle(Tokenized("b", [*A, 1], SP))
    core2.handle(Tick(s))
    (ld,) = core2.handle(PagesFetched(fp.copy_id, fp.keys))
    (m,) = core2.handle(PagesLoaded(ld.copy_id, ld.keys))
    assert m.num_cached_tokens == 8 and of(core2.handle(Tick(9 * s)), Matched) == []
    assert not core2._store_timers


def test_a_best_effort_match_is_matched_again_before_admission_once():
    """Its Matched carries tree_version -1 while the read it went on beside is in
    flight, so the scheduler matches it again just before admitting it: right away it
    gets the same match (and a real version, so once only); after the read has landed
    (it waited in the queue) it loads what was read."""
    for landed_first in (False, True):
        core, seq = make(store_prefetch_policy="best_effort"), Seq()
        stored(core, "a", A, seq)
        core.handle(DropTree("f"))
        out = core.handle(Tokenized("b", [*A, 1], SP))
        (fp,) = of(out, FetchPages)
        (m,) = of(out, Matched)
        assert m.tree_version == -1
        if landed_first:
            core.handle(PagesFetched(fp.copy_id, fp.keys))
            (ld,) = core.handle(RefreshMatch("b"))
            (m,) = core.handle(PagesLoaded(ld.copy_id, ld.keys))
            assert m.num_cached_tokens == 8 and m.tree_version >= 0
        else:
            (m,) = core.handle(RefreshMatch("b"))
            assert m.num_cached_tokens == 0 and m.tree_version == core.tree.version
            core.handle(PagesFetched(fp.copy_id, fp.keys))
        assert census_ok(core, seq)
