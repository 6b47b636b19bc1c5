"""Radix tree: splits, dedupe, page alignment, namespaces, LRU and LFU, block hashes, host
copies (demote, attach, host eviction, invalid nodes)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shunter.actors.cache_manager.radix import RadixTree, block_hash


def test_match_splits_the_edge_it_ends_inside():
    t = RadixTree()
    t.insert("", [1, 2, 3, 4, 5, 6], [10, 11, 12, 13, 14, 15])
    assert len(t.nodes()) == 1
    m = t.match("", [1, 2, 3, 9])
    assert (m.num_tokens, m.pages) == (3, [10, 11, 12])
    assert m.node.key == [1, 2, 3] and m.node.pages == [10, 11, 12]
    (child,) = m.node.children.values()
    assert child.key == [4, 5, 6] and child.pages == [13, 14, 15] and child.parent is m.node
    assert t.leaves == {child} and t.num_pages == 6
    # a match without split leaves the tree alone
    t2 = RadixTree()
    t2.insert("", [1, 2, 3, 4], [0, 1, 2, 3])
    m2 = t2.match("", [1, 2, 7], split=False)
    assert (m2.num_tokens, m2.pages) == (2, [0, 1]) and len(t2.nodes()) == 1


def test_insert_reports_cached_prefix_and_keeps_tree_pages():
    t = RadixTree()
    first = t.insert("", [1, 2, 3, 4], [0, 1, 2, 3])
    assert first.num_cached_tokens == 0 and first.new_node is not None
    second = t.insert("", [1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12])
    assert second.num_cached_tokens == 4 and second.cached_pages == [0, 1, 2, 3]
    assert second.new_node.pages == [11, 12]  # positions 0..3 keep the tree's pages
    assert sorted(t.all_pages()) == [0, 1, 2, 3, 11, 12]
    again = t.insert("", [1, 2, 3], [5, 5, 5])
    assert again.num_cached_tokens == 3 and again.new_node is None
    assert t.version == 2  # only inserts that added tokens count


def test_page_size_16_alignment():
    t = RadixTree(page_size=16)
    toks = list(range(40))
    with pytest.raises(ValueError, match="whole pages"):
        t.insert("", toks, [0, 1, 2])
    t.insert("", toks[:32], [5, 6])
    assert t.match("", toks[:31]).pages == [5]  # 31 tokens: one whole page
    assert t.match("", toks).num_tokens == 32
    # a mismatch inside the second page matches only the first page
    assert t.match("", [*toks[:20], 999, *toks[21:]]).pages == [5]
    # and splits at the page boundary: 16 | 16
    keys = sorted(len(n.key) for n in t.nodes())
    assert keys == [16, 16]
    # first-page keys distinguish children that share a first token
    t.insert("", toks[:16] + [0] * 16, [5, 9])
    assert t.match("", toks[:16] + [0] * 16).pages == [5, 9]
    assert t.match("", toks[:32]).pages == [5, 6]


def test_binary_search_finds_the_exact_divergence():
    t = RadixTree(page_size=2)
    key = list(range(1000))
    t.insert("", key, list(range(500)))
    for cut in (2, 4, 100, 998):
        probe = key[:cut] + [-1] * 10
        assert t.match("", probe, split=False).num_tokens == cut
    assert t.match("", [*key[:501], -1], split=False).num_tokens == 500


def test_namespaces_do_not_share():
    t = RadixTree()
    t.insert("lora-a", [1, 2, 3], [0, 1, 2])
    assert t.match("", [1, 2, 3]).num_tokens == 0
    assert t.match("lora-b", [1, 2, 3]).num_tokens == 0
    assert t.match("lora-a", [1, 2, 3]).pages == [0, 1, 2]
    t.insert("", [1, 2, 3], [3, 4, 5])
    assert t.match("", [1, 2, 3]).pages == [3, 4, 5]
    (a,) = t.roots["lora-a"].children.values()
    (b,) = t.roots[""].children.values()
    assert a.hashes != b.hashes  # the namespace seeds the hash chain


def test_lru_eviction_order_and_locks():
    t = RadixTree()
    t.now = 1
    a = t.insert("", [1, 1], [0, 1]).node
    t.now = 2
    b = t.insert("", [2, 2], [2, 3]).node
    t.now = 3
    c = t.insert("", [3, 3], [4, 5]).node
    t.now = 4
    t.match("", [1, 1])  # touch a: b is now the least recently used
    t.lock(c)
    assert t.num_locked_nodes == 1 and t.evictable_pages() == 4
    out = t.evict(1)
    assert [e.pages for e in out] == [[2, 3]]  # whole node b
    out = t.evict(10)
    assert [e.pages for e in out] == [[0, 1]]  # c is locked: only a goes
    assert t.nodes() == [c]
    t.unlock(c)
    assert t.evict(10)[0].pages == [4, 5] and t.num_pages == 0
    assert a.parent is not None and b.parent is not None


def test_lfu_eviction_takes_the_least_often_matched_first_then_the_least_recent():
    t = RadixTree(eviction_policy="lfu")
    for now, tokens in enumerate(([1, 1], [2, 2], [3, 3]), start=1):
        t.now = now
        t.insert("", tokens, [10 * now, 10 * now + 1])
    t.now = 4
    for _ in range(3):
        t.match("", [1, 1], hit=True)  # the oldest, matched most: it stays longest
    t.match("", [3, 3], hit=True)
    t.match("", [2, 2])  # a lookup that is no request's (a release's check): no hit
    t.insert("", [2, 2], [20, 21])  # nor is inserting what is there
    assert [e.pages for e in t.evict(1)] == [[20, 21]]  # [2, 2]: one hit (its insert)
    assert [e.pages for e in t.evict(1)] == [[30, 31]]  # [3, 3]: two hits
    assert [e.pages for e in t.evict(1)] == [[10, 11]]
    with pytest.raises(ValueError, match="eviction_policy"):
        RadixTree(eviction_policy="slru")


def test_evicting_a_leaf_exposes_its_parent():
    t = RadixTree()
    t.now = 1
    t.insert("", [1, 2, 3, 4], [0, 1, 2, 3])
    t.now = 2
    t.insert("", [1, 2, 9], [0, 1, 7])  # splits [1,2] | [3,4] and adds [9]
    t.now = 3
    t.match("", [1, 2, 3, 4])
    out = t.evict(1)
    assert [e.pages for e in out] == [[7]]
    out = t.evict(3)  # [3,4] then its parent [1,2], now a leaf
    assert [e.pages for e in out] == [[2, 3], [0, 1]]
    assert t.leaves == set() and t.num_pages == 0


def test_lock_survives_split():
    t = RadixTree()
    n = t.insert("", [1, 2, 3, 4], [0, 1, 2, 3]).node
    t.lock(n)
    m = t.match("", [1, 2, 5])  # splits the locked edge
    assert m.node.lock_ref == 1 and n.lock_ref == 1 and t.num_locked_nodes == 2
    assert t.evict(10) == []
    t.unlock(n)
    assert t.num_locked_nodes == 0 and t.num_locked_pages == 0


def test_block_hash_chain_is_stable_across_processes():
    h1 = block_hash(None, [1, 2, 3, 4], "")
    h2 = block_hash(h1, [5, 6, 7, 8], "")
    assert h1 != block_hash(None, [1, 2, 3, 4], "lora")
    assert -(2**63) <= h1 < 2**63
    code = (
        "from shunter.actors.cache_manager.radix import block_hash as b;"
        "h=b(None,[1,2,3,4],'');print(h, b(h,[5,6,7,8],''))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        env={"PYTHONHASHSEED": "12345"},
    )  # fmt: skip
    assert out.stdout.split() == [str(h1), str(h2)]
    t = RadixTree(page_size=4)
    leaf = t.insert("", [1, 2, 3, 4, 5, 6, 7, 8], [0, 1]).new_node
    assert leaf.hashes == [h1, h2]


def test_radix_bench_runs_a_shared_prefix_workload():
    from shunter.actors.cache_manager.bench import radix_bench

    r = radix_bench(200, num_prefixes=4, prefix_len=128, suffix_len=16, output_len=8, page_size=4)
    # every request after the first of its prefix hits the whole prefix (128 of 144)
    assert 0.8 < r.hit_rate < 128 / 144
    assert r.num_evicted_pages > 0  # the pool holds ~64 requests: the tail is evicted
    assert r.tree_ops_per_s > 0 and r.core_requests_per_s > 0


def test_host_copies_demote_attach_and_go_leaf_first():
    """A backed-up leaf is demoted, not removed: device matches stop before it, a match
    through the host tier reaches it, attach gives it device pages again; host eviction
    takes host-only leaves first, and dropping a device leaf takes its host-only subtree."""
    t = RadixTree(page_size=2)
    t.insert("", [1, 2, 3, 4], [0, 1])
    t.insert("", [1, 2, 3, 4, 5, 6, 7, 8], [0, 1, 2, 3])
    top, low = t.nodes()  # parents first
    t.set_host_pages(low, [10, 11])
    t.set_host_pages(top, [12, 13])
    assert t.num_host_pages == 4 and t.leaves == {low}
    out = t.evict(1, lambda n: "demote")
    assert [(b.pages, b.hashes, b.host_pages) for b in out] == [([2, 3], [], [])]
    assert low.host_only and t.leaves == {top} and t.host_leaves == {low}
    assert t.num_pages == 2
    m = t.match("", [1, 2, 3, 4, 5, 6, 9])
    assert (m.num_tokens, m.pages, m.node) == (4, [0, 1], top)
    m = t.match("", [1, 2, 3, 4, 5, 6, 9], through_host=True)  # splits the host-only edge
    assert (m.num_tokens, m.pages) == (6, [0, 1]) and m.node.host_pages == [10]
    t.attach(m.node, [7])
    assert m.node.pages == [7] and t.leaves == {m.node} and t.num_pages == 3
    (rest,) = m.node.children.values()
    assert rest.host_only and t.host_leaves == {rest}
    (gone,) = t.evict_host(1)
    assert gone.host_pages == [11] and len(gone.hashes) == 1 and t.host_leaves == set()
    t.set_host_pages(m.node, [])
    (dropped,) = t.evict(1)  # no decide: dropped with its subtree
    assert dropped.pages == [7] and t.leaves == {top}


def test_an_insert_over_host_only_positions_attaches_and_an_invalid_node_is_skipped():
    t = RadixTree()
    t.insert("", [1, 2, 3], [0, 1, 2])
    (n,) = t.nodes()
    t.set_host_pages(n, [5, 6, 7])
    t.evict(3, lambda x: "demote")
    ins = t.insert("", [1, 2, 3, 4], [8, 9, 10, 11])
    assert (ins.num_cached_tokens, ins.cached_pages) == (0, [])
    assert n.pages == [8, 9, 10] and n.host_pages == [5, 6, 7] and ins.new_node.pages == [11]
    n.valid = False
    assert t.match("", [1, 2, 3, 4]).num_tokens == 0
    assert t.match("", [1, 2, 3, 4], valid_only=False).num_tokens == 4
