"""Cache manager core with a host tier, message by message: write-through backups,
demotion on eviction, load-back with the Matched held for it, failed copies, drops held
for the copies in flight, host eviction, the selective policy, the host census."""

from __future__ import annotations

import pytest

from shunter.actors.cache_manager.allocator import FREE, OUT, TREE
from shunter.actors.cache_manager.config import CacheConfig
from shunter.actors.cache_manager.core import CacheManagerCore
from shunter.bus.messages import (
    BlockRemoved,
    BlockStored,
    Census,
    DropTree,
    LeaseGranted,
    LeaseRequest,
    LeaseReturned,
    LoadPages,
    Matched,
    PagesEvictable,
    PagesLoaded,
    PagesSpilled,
    SamplingParams,
    SchedulerCensus,
    SequenceReleased,
    SpillPages,
    Tokenized,
    TreeDropped,
)

SP = SamplingParams()
A = list(range(100, 108))  # 8 tokens
B = list(range(200, 206))


def make(num_pages=10, num_host_pages=16, page_size=1, **kw) -> CacheManagerCore:
    return CacheManagerCore(CacheConfig(num_pages=num_pages, page_size=page_size,
                                        num_host_pages=num_host_pages, **kw))  # fmt: skip


def of(out, kind):
    return [o for o in out if isinstance(o, kind)]


class Seq:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> int:
        self.n += 1
        return self.n


def serve(core, rid, ids, seq) -> tuple[list[int], list]:
    """Match, lease, compute and finish one request; returns its pages and the
    release's output."""
    (m,) = of(core.handle(Tokenized(rid, ids, SP)), Matched)
    n = -(-len(ids) // core.page_size) - len(m.prefix_pages)
    (g,) = of(core.handle(LeaseRequest(seq(), n)), LeaseGranted)
    pages = m.prefix_pages + g.pages
    return pages, core.handle(SequenceReleased(rid, ids, pages))


def squeeze(core, seq) -> list:
    """Lease every page the cache can free and give them back (evicts all it can)."""
    out = core.handle(LeaseRequest(seq(), core.ledger.num_pages))
    (g,) = of(out, LeaseGranted)
    core.handle(LeaseReturned(g.pages))
    return out


def test_insert_backs_up_and_eviction_demotes_once_the_backup_landed():
    core, seq = make(), Seq()
    pages, out = serve(core, "a", A, seq)
    (st,) = of(out, BlockStored)
    (sp,) = of(out, SpillPages)
    assert sp.device_pages == pages and sp.keys == st.block_hashes and len(sp.host_pages) == 8
    assert core.host.ledger.counts[OUT] == 8
    # the backup is in flight: its pages stay, the short grant is owed a PagesEvictable
    (g,) = of(core.handle(LeaseRequest(seq(), 10)), LeaseGranted)
    assert len(g.pages) == 2 and g.num_evicted_pages == 0 and g.awaits_backup
    core.handle(LeaseReturned(g.pages))
    assert core.handle(PagesSpilled(sp.copy_id, sp.keys)) == [PagesEvictable(8)]
    assert core.host.ledger.counts[TREE] == 8
    out = squeeze(core, seq)
    assert not of(out, BlockRemoved)  # demoted, not gone: the blocks are still cached
    (node,) = core.tree.nodes()
    assert node.host_only and node.host_pages == sp.host_pages
    assert core.tree.num_pages == 0 and core.ledger.num_free == 10
    s = core.statistics()
    assert (s.num_spilled_pages, s.num_demoted_pages, s.num_host_only_nodes) == (8, 8, 1)


def demoted(core, seq, ids=A):
    _, out = serve(core, "a", ids, seq)
    (sp,) = of(out, SpillPages)
    core.handle(PagesSpilled(sp.copy_id, sp.keys))
    squeeze(core, seq)
    return sp


def test_a_match_into_the_host_tier_waits_for_its_load():
    core, seq = make(), Seq()
    sp = demoted(core, seq)
    out = core.handle(Tokenized("b", [*A, 1], SP))
    (ld,) = out
    assert isinstance(ld, LoadPages) and ld.host_pages == sp.host_pages and ld.keys == sp.keys
    # a second request reaching the pages being loaded waits for the same load
    assert core.handle(Tokenized("c", [*A[:5], 2], SP)) == []
    assert core.requests["b"].waiting == core.requests["c"].waiting == {ld.copy_id}
    mb, mc = core.handle(PagesLoaded(ld.copy_id, ld.keys))
    assert (mb.request.request_id, mb.num_cached_tokens, mb.prefix_pages) == (
        "b",
        8,
        ld.device_pages,
    )
    assert (mc.request.request_id, mc.num_cached_tokens) == ("c", 5)
    assert mc.prefix_pages == ld.device_pages[:5]
    s = core.statistics()
    assert (s.num_loaded_pages, s.num_host_hit_tokens, s.num_hit_tokens) == (8, 8, 13)
    # loaded pages are device pages of the tree again, still backed up: no new copy
    (node, _) = sorted(core.tree.nodes(), key=lambda n: -len(n.key))
    assert node.pages == ld.device_pages[:5] and node.host_pages == sp.host_pages[:5]
    _, out = serve(core, "d", [*A, 1, 2], seq)
    (sp2,) = of(out, SpillPages)
    assert len(sp2.device_pages) == 2 and out[-1] == sp2  # only the new tail, after its event


def test_a_load_goes_as_far_as_the_device_pool_reaches():
    core, seq = make(num_pages=10), Seq()
    demoted(core, seq)
    core.handle(LeaseRequest(seq(), 7))  # 3 pages left free
    (ld,) = core.handle(Tokenized("b", [*A, 1], SP))
    assert len(ld.device_pages) == 3
    (m,) = core.handle(PagesLoaded(ld.copy_id, ld.keys))
    assert m.num_cached_tokens == 3 and m.prefix_pages == ld.device_pages


def test_a_failed_load_matches_its_waiters_again_short_of_it():
    core, seq = make(), Seq()
    demoted(core, seq)
    (ld,) = core.handle(Tokenized("b", [*A, 1], SP))
    (m,) = core.handle(PagesLoaded(ld.copy_id, ld.keys, ok=False, error="copy failed"))
    assert m.num_cached_tokens == 0 and m.prefix_pages == []
    assert core.statistics().num_copies_failed == 1
    (node,) = core.tree.nodes()
    assert not node.valid and node.pages == ld.device_pages
    # the bad node is never matched, and eviction drops it with its host copy
    (m,) = core.handle(Tokenized("c", [*A, 1], SP))
    assert m.num_cached_tokens == 0
    core.handle(SequenceReleased("b", [], []))
    core.handle(SequenceReleased("c", [], []))
    out = squeeze(core, seq)
    assert of(out, BlockRemoved) and core.tree.nodes() == []
    assert core.ledger.num_free == 10 and core.host.ledger.num_free == 16


def test_pages_a_load_writes_are_not_evicted_before_it_lands():
    """The request that started a load lets go of its node before the load lands
    (released, or matched again after another load failed): eviction must not hand the
    load's device pages to anyone until the copy has written them (the late write would
    land in another request's KV). The short grant gets a PagesEvictable then."""
    core, seq = make(), Seq()
    demoted(core, seq)
    (ld,) = core.handle(Tokenized("b", [*A, 1], SP))
    core.handle(SequenceReleased("b", [], [], reason="aborted"))
    (g,) = of(core.handle(LeaseRequest(seq(), 10)), LeaseGranted)
    assert not set(g.pages) & set(ld.device_pages) and g.awaits_backup
    core.handle(LeaseReturned(g.pages))
    assert of(core.handle(PagesLoaded(ld.copy_id, ld.keys)), PagesEvictable)
    (g,) = of(core.handle(LeaseRequest(seq(), 10)), LeaseGranted)
    assert set(ld.device_pages) <= set(g.pages)


def test_a_failed_backup_forgets_the_host_copy():
    core, seq = make(), Seq()
    _, out = serve(core, "a", A, seq)
    (sp,) = of(out, SpillPages)
    (g,) = of(core.handle(LeaseRequest(seq(), 10)), LeaseGranted)  # short: backup running
    core.handle(LeaseReturned(g.pages))
    out = core.handle(PagesSpilled(sp.copy_id, sp.keys, ok=False, error="no"))
    assert out == [PagesEvictable(8)]  # its pages can be dropped now
    (node,) = core.tree.nodes()
    assert node.host_pages == [] and core.host.ledger.num_free == 16
    out = squeeze(core, seq)
    assert of(out, BlockRemoved) and core.tree.nodes() == []


def test_host_eviction_makes_room_lru_and_no_room_skips_the_backup():
    core, seq = make(num_pages=20, num_host_pages=10), Seq()
    demoted(core, seq, A)  # 8 host pages, host-only
    _, out = serve(core, "b", B, seq)  # 6 more: the host-only A goes
    (rm,) = of(out, BlockRemoved)
    (sp,) = of(out, SpillPages)
    assert len(rm.block_hashes) == 8 and len(sp.host_pages) == 6
    core.handle(PagesSpilled(sp.copy_id, sp.keys))
    _, out = serve(core, "c", list(range(300, 306)), seq)  # no host-only leaf left to evict
    assert not of(out, SpillPages) and core.statistics().num_backups_skipped == 1


def test_drop_waits_for_the_copies_in_flight():
    core, seq = make(num_pages=16), Seq()
    _, out = serve(core, "a", A, seq)
    (sp,) = of(out, SpillPages)
    assert core.handle(DropTree("f")) == []
    # no copy starts while it waits: a new insert is not backed up
    _, out = serve(core, "b", B, seq)
    assert not of(out, SpillPages)
    out = core.handle(PagesSpilled(sp.copy_id, sp.keys))
    (dropped,) = of(out, TreeDropped)
    assert dropped.ok and dropped.num_pages_reclaimed == 14
    assert (
        core.tree.nodes() == [] and core.host.ledger.num_free == 16 and core.ledger.num_free == 16
    )
    assert core.statistics().num_drops_deferred == 1


def test_selective_policy_backs_up_on_the_second_hit():
    core, seq = make(write_policy="write_through_selective"), Seq()
    _, out = serve(core, "a", A, seq)
    assert not of(out, SpillPages)
    out = core.handle(Tokenized("b", [*A, 1], SP))
    (sp,) = of(out, SpillPages)
    (m,) = of(out, Matched)
    assert sp.device_pages == m.prefix_pages


def test_write_back_copies_at_eviction_and_the_short_grant_waits_for_the_copy():
    """Under write_back nothing is copied as it enters the tree; eviction backs up as
    many least recent leaves as it needs (not more), grants short saying it awaits a
    backup, answers the landing with PagesEvictable, and then demotes them: a later
    match loads them back from the host."""
    core, seq = make(num_pages=16, write_policy="write_back"), Seq()
    pages_a, out = serve(core, "a", A, seq)
    _, out_b = serve(core, "b", B, seq)
    assert not of(out + out_b, SpillPages) and core.ledger.num_free == 2
    out = core.handle(LeaseRequest(seq(), 4))
    (g,) = of(out, LeaseGranted)
    (sp,) = of(out, SpillPages)  # A, the least recent leaf, covers the 2 pages short
    assert sp.device_pages == pages_a and len(g.pages) == 2 and g.awaits_backup
    assert core.ledger.counts[TREE] == 14 and core.host.ledger.counts[OUT] == 8
    again = core.handle(LeaseRequest(seq(), 2))  # asked again before it landed: it waits
    (g2,) = of(again, LeaseGranted)
    assert g2.pages == [] and g2.awaits_backup and not of(again, SpillPages)
    assert of(core.handle(PagesSpilled(sp.copy_id, sp.keys)), PagesEvictable)
    (g3,) = of(core.handle(LeaseRequest(seq(), 2)), LeaseGranted)
    assert len(g3.pages) == 2 and set(g3.pages) <= set(pages_a)  # A demoted
    assert g3.num_evicted_pages == 8 and not g3.awaits_backup
    core.handle(LeaseReturned(g.pages + g3.pages))
    (ld,) = of(core.handle(Tokenized("c", [*A, 1], SP)), LoadPages)
    assert ld.host_pages == sp.host_pages and ld.keys == sp.keys


def a_host_only(core, seq) -> SpillPages:
    """Serve A on a write_back core, then lease and return every page: A is backed up
    at its eviction and demoted, host-only; returns its backup."""
    serve(core, "a", A, seq)
    (g,) = of(out := core.handle(LeaseRequest(seq(), 8)), LeaseGranted)
    (sp,) = of(out, SpillPages)
    core.handle(PagesSpilled(sp.copy_id, sp.keys))
    (g2,) = of(core.handle(LeaseRequest(seq(), 6)), LeaseGranted)
    core.handle(LeaseReturned(g.pages + g2.pages))
    return sp


def test_write_back_match_waits_for_the_backup_that_makes_room_for_its_load():
    """A match reaching host-only pages when the device is full of leaves not yet backed
    up: the eviction for its load starts their backup, the match waits (no Matched, no
    partial load), and once the backup lands it is matched again and loads it all."""
    core, seq = make(num_pages=10, num_host_pages=32, write_policy="write_back"), Seq()
    sp = a_host_only(core, seq)  # the device free
    pages_b, _ = serve(core, "b", B, seq)
    out = core.handle(Tokenized("c", [*A, 1], SP))
    (sp_b,) = of(out, SpillPages)
    assert sp_b.device_pages == pages_b and not of(out, Matched) and not of(out, LoadPages)
    out = core.handle(PagesSpilled(sp_b.copy_id, sp_b.keys))
    (ld,) = of(out, LoadPages)
    assert ld.host_pages == sp.host_pages and not of(out, Matched)
    (m,) = of(core.handle(PagesLoaded(ld.copy_id, ld.keys)), Matched)
    assert m.num_cached_tokens == 8 and m.prefix_pages == ld.device_pages


def test_write_back_load_keeps_its_host_pages_from_the_backups_its_room_starts():
    """The host is full with A's copy and the device with B, never backed up. A match
    for A needs B's pages: evicting B starts no backup that would evict A from the host
    for room (A is being loaded), so B is dropped and A comes back whole."""
    core, seq = make(num_pages=10, num_host_pages=8, write_policy="write_back"), Seq()
    sp = a_host_only(core, seq)  # the host full
    serve(core, "b", B, seq)
    out = core.handle(Tokenized("c", [*A, 1], SP))
    (ld,) = of(out, LoadPages)
    assert not of(out, SpillPages) and ld.host_pages == sp.host_pages
    assert core.host.ledger.counts[TREE] == 8 and core.tree.match("", B).num_tokens == 0
    (m,) = of(core.handle(PagesLoaded(ld.copy_id, ld.keys)), Matched)
    assert m.num_cached_tokens == 8 and m.prefix_pages == ld.device_pages
    assert all(c.ok for c in of(core.handle(SchedulerCensus(1, seq.n, 0, 0)), Census))


def test_write_back_drops_what_the_host_has_no_room_for():
    core, seq = make(num_pages=10, num_host_pages=4, write_policy="write_back"), Seq()
    serve(core, "a", A, seq)
    out = core.handle(LeaseRequest(seq(), 10))
    (g,) = of(out, LeaseGranted)
    assert not of(out, SpillPages) and len(g.pages) == 10 and not g.awaits_backup
    assert core.tree.nodes() == []


def test_host_census_counts_writes_in_flight():
    core, seq = make(), Seq()
    _, out = serve(core, "a", A, seq)
    (sp,) = of(out, SpillPages)
    dev, host = core.handle(SchedulerCensus(1, seq.n, 0, 0))
    assert dev.tier == "device" and dev.ok
    assert host == Census(1, "host", 16, 8, 0, 0, 0, True, 8)
    core.handle(PagesSpilled(sp.copy_id, sp.keys))
    _, host = core.handle(SchedulerCensus(2, seq.n, 0, 0))
    assert (host.free, host.cached_in_tree, host.copying, host.ok) == (8, 8, 0, True)
    s = core.statistics()
    assert (s.num_host_free, s.num_host_in_tree, s.num_host_writing) == (8, 8, 0)


def test_an_insert_over_host_only_positions_takes_its_pages_as_theirs():
    """A request that computed tokens the host tier holds (its match could not load
    them: no room) inserts them: the host-only node takes its pages, none are freed."""
    core, seq = make(num_pages=10), Seq()
    sp = demoted(core, seq)
    (g,) = of(core.handle(LeaseRequest(seq(), 10)), LeaseGranted)  # every page leased
    (m,) = core.handle(Tokenized("b", [*A, 1], SP))
    assert m.num_cached_tokens == 0  # nothing free to load into
    pages = g.pages[:9]
    out = core.handle(SequenceReleased("b", [*A, 1], pages))
    ns = sorted(core.tree.nodes(), key=lambda n: len(n.key))
    assert [len(n.key) for n in ns] == [1, 8]
    assert ns[1].pages == pages[:8] and ns[1].host_pages == sp.host_pages
    assert core.ledger.counts[TREE] == 9 and core.ledger.counts[OUT] == 1
    assert [o.device_pages for o in of(out, SpillPages)] == [pages[8:]]
    assert core.ledger.counts[FREE] == 0


def test_config_checks_the_host_tier():
    with pytest.raises(ValueError, match="write_around"):
        CacheConfig(num_pages=4, num_host_pages=4, write_policy="write_around")
    with pytest.raises(ValueError, match="num_host_pages"):
        CacheConfig(num_pages=4, num_host_pages=-1)
    for policy in ("write_through_selective", "write_back"):
        cfg = CacheConfig(num_pages=4, num_host_pages=8, write_policy=policy)
        assert CacheConfig.from_info(cfg.to_info()) == cfg
