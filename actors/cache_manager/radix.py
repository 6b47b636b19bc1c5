"""Radix tree over token ids, page-aligned, one root per namespace (extra_key).

Theory of operation
    A node holds an edge: `key` (token ids, a whole number of pages long) and the KV
    `pages` holding them (one per page_size tokens). Children are keyed by their first
    page: the token id itself when page_size is 1, else the tuple of the first page's
    ids. `match` walks from the namespace's root comparing whole slices (a list
    compare runs in C; a per-token Python loop would not), splitting the last edge at a
    page boundary when the match ends inside it. `insert` is a match followed by one new
    leaf for the part not yet cached, so the tree never holds two pages for one
    position. Locks are reference counts on every node from the locked node up to (not
    including) the root. Eviction pops unlocked leaves in LRU order of `last_access`, a
    logical time the owner sets (`now`), never a clock, ties to the older node id; or,
    with the "lfu" policy, fewest `hit_count` first (matches through the node, counted
    from its insert), then as LRU.

    Host tier. A node may also hold `host_pages`: a copy of its pages in the host pool
    (as many as its pages, position for position). Device eviction then only demotes a
    node: its device pages go, the node stays with its host copy ("host-only"), and a
    later match can reach into it (`through_host`) for the owner to load it back
    (`attach`). The device-resident nodes are closed upwards: a host-only node's
    descendants are all host-only, so a match's device part is a prefix of its path.
    `leaves` are the device-resident nodes without device-resident children (what device
    eviction takes); `host_leaves` are the host-only nodes without children (what host
    eviction takes). A node whose load failed is not `valid`: matches stop before it,
    inserts count its positions as cached, and eviction drops it with its subtree.

    Each page also gets a block hash: a chain over page token ids (blake2b of the parent
    hash and the page's ids, truncated to a signed int64; the first page of a namespace
    hashes the namespace instead of a parent), the same in every process (Python's
    `hash()` is salted per process and is not used).

Invariants
    - len(node.key) == len(node.pages) * page_size for every device-resident non-root
      node, == len(node.host_pages) * page_size for a host-only one, and host_pages is
      either empty or as long as the key in pages; roots are empty. `num_pages` is the
      sum of len(node.pages) over all nodes, `num_host_pages` of len(node.host_pages).
    - a host-only node's children are host-only; a locked node is device-resident.
    - node.lock_ref == number of locks held at or below node; a locked node is never
      evicted, and neither is an ancestor of one (it is not a leaf).
    - `leaves` is exactly the set of device-resident non-root nodes without
      device-resident children; `host_leaves` of host-only nodes without children.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections.abc import Callable
from typing import NamedTuple


def block_hash(parent: int | None, token_ids: list[int], namespace: str = "") -> int:
    """Hash of one page: chained on its parent's hash (None for a namespace's first page)."""
    if parent is None:
        head = b"\x00" + namespace.encode()
    else:
        head = b"\x01" + parent.to_bytes(8, "little", signed=True)
    digest = hashlib.blake2b(head + array("q", token_ids).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


class Node:
    __slots__ = (
        "children",
        "hashes",
        "hit_count",
        "host_pages",
        "key",
        "last_access",
        "lock_ref",
        "namespace",
        "node_id",
        "pages",
        "parent",
        "valid",
    )

    def __init__(self, node_id: int, namespace: str, parent: Node | None) -> None:
        self.node_id = node_id
        self.namespace = namespace
        self.parent = parent
        self.key: list[int] = []
        self.pages: list[int] = []
        self.host_pages: list[int] = []  # its copy in the host pool, or none
        self.hashes: list[int] = []  # one per page, empty when hashing is off
        self.children: dict[int | tuple[int, ...], Node] = {}
        self.lock_ref = 0
        self.last_access = 0
        self.hit_count = 0  # request lookups that reached through it, and its own insert
        self.valid = True  # False: its device pages hold nothing usable (a failed load)

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def host_only(self) -> bool:
        """Evicted from the device; its tokens live on in its host copy."""
        return not self.pages and bool(self.host_pages)

    def __repr__(self) -> str:
        return f"Node({self.node_id}, ns={self.namespace!r}, {len(self.key)} tok, lock={self.lock_ref})"


class MatchResult(NamedTuple):
    node: Node  # deepest node fully covered by the match (a root when nothing matched)
    pages: list[int]  # the tree's device pages for the matched tokens (device part)
    num_tokens: int  # matched tokens, a multiple of page_size (host part included)


class InsertResult(NamedTuple):
    node: Node  # the node ending exactly at the inserted length
    num_cached_tokens: int  # tokens that were already in the tree
    cached_pages: list[int]  # the tree's pages for those tokens
    new_node: Node | None  # the leaf that was added, if any tokens were new


class EvictedBlock(NamedTuple):
    pages: list[int]  # device pages freed
    hashes: list[int]  # blocks that left the tree (none when a node was only demoted)
    host_pages: list[int] = []  # host pages freed


EVICTION_POLICIES = ("lru", "lfu")


class RadixTree:
    def __init__(self, page_size: int = 1, hash_blocks: bool = True,
                 eviction_policy: str = "lru") -> None:  # fmt: skip
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction_policy must be lru or lfu, got {eviction_policy!r}")
        self.page_size = page_size
        self.eviction_policy = eviction_policy
        self.hash_blocks = hash_blocks
        self.now = 0  # logical time stamped on touched nodes; set by the owner
        self.version = 0  # inserts that added tokens, plus one per clear()
        self.num_pages = 0
        self.num_host_pages = 0
        self.num_locked_nodes = 0
        self.num_locked_pages = 0
        self.roots: dict[str, Node] = {}
        self.leaves: set[Node] = set()
        self.host_leaves: set[Node] = set()
        self._next_id = 0

    # -- lookups ------------------------------------------------------------------

    def root(self, namespace: str) -> Node:
        node = self.roots.get(namespace)
        if node is None:
            node = self.roots[namespace] = self._new_node(namespace, None)
        return node

    def _new_node(self, namespace: str, parent: Node | None) -> Node:
        self._next_id += 1
        return Node(self._next_id, namespace, parent)

    def _child_key(self, tokens: list[int], pos: int) -> int | tuple[int, ...]:
        if self.page_size == 1:
            return tokens[pos]
        return tuple(tokens[pos : pos + self.page_size])

    def _common_len(self, key: list[int], tokens: list[int], pos: int, end: int) -> int:
        """Tokens (page-aligned) shared by key and tokens[pos:end]; the first page is
        known to match (the child was found by it)."""
        ps = self.page_size
        n = min(len(key), end - pos)
        if (key if n == len(key) else key[:n]) == tokens[pos : pos + n]:
            return n
        lo, hi = ps, n  # prefix of lo matches, prefix of hi does not
        while hi - lo > ps:
            mid = (lo + hi) // 2
            mid -= mid % ps
            if mid <= lo:
                mid = lo + ps
            if key[lo:mid] == tokens[pos + lo : pos + mid]:
                lo = mid
            else:
                hi = mid
        return lo

    def match(self, namespace: str, tokens: list[int], *, split: bool = True,
              hit: bool = False, through_host: bool = False,
              valid_only: bool = True) -> MatchResult:  # fmt: skip
        """Longest cached page-aligned prefix of tokens. With split, an edge the match
        ends inside is split so that the result's node ends exactly at the match. With
        hit, a request's lookup: each node it reaches counts one more hit (LFU). The
        match stops before a host-only node unless through_host (then num_tokens counts
        the host part too, and pages are the device part's), and before a node that is
        not valid unless valid_only is False."""
        ps = self.page_size
        end = len(tokens) - len(tokens) % ps
        node = self.roots.get(namespace)
        if node is None:  # nothing cached in this namespace: a detached empty root
            return MatchResult(Node(0, namespace, None), [], 0)
        pages: list[int] = []
        pos = 0
        now = self.now
        while pos < end:
            child = node.children.get(self._child_key(tokens, pos))
            if (
                child is None
                or (valid_only and not child.valid)
                or (not through_host and not child.pages)
            ):
                break
            m = self._common_len(child.key, tokens, pos, end)
            if m < len(child.key):
                if not split:
                    child.last_access = now
                    child.hit_count += hit
                    pages += child.pages[: m // ps]
                    pos += m
                    break
                child = self.split(child, m)
            child.last_access = now
            child.hit_count += hit
            pages += child.pages
            pos += m
            node = child
        return MatchResult(node, pages, pos)

    def child(self, node: Node, tokens: list[int], pos: int) -> Node | None:
        """node's child whose edge starts with the page of tokens at pos, if any."""
        return node.children.get(self._child_key(tokens, pos))

    def path_pages(self, node: Node) -> list[int]:
        """The pages from the root down to node (the tokens node's path covers)."""
        parts: list[list[int]] = []
        while node.parent is not None:
            parts.append(node.pages)
            node = node.parent
        return [p for part in reversed(parts) for p in part]

    # -- changes ------------------------------------------------------------------

    def split(self, child: Node, m: int) -> Node:
        """Cut child's edge after m tokens (0 < m < its length, page-aligned); returns
        the new upper node."""
        ps = self.page_size
        parent = child.parent
        assert parent is not None and 0 < m < len(child.key) and m % ps == 0
        head = self._new_node(child.namespace, parent)
        k = m // ps
        head.key, child.key = child.key[:m], child.key[m:]
        head.pages, child.pages = child.pages[:k], child.pages[k:]
        head.hashes, child.hashes = child.hashes[:k], child.hashes[k:]
        if child.host_pages:
            head.host_pages, child.host_pages = child.host_pages[:k], child.host_pages[k:]
        head.valid = child.valid
        head.lock_ref = child.lock_ref
        head.last_access = child.last_access
        head.hit_count = child.hit_count
        if head.lock_ref:
            self.num_locked_nodes += 1
        parent.children[self._child_key(head.key, 0)] = head
        head.children[self._child_key(child.key, 0)] = child
        child.parent = head
        return head

    def insert(self, namespace: str, tokens: list[int], pages: list[int]) -> InsertResult:
        """Cache tokens (page-aligned) held in pages (one per page of tokens). Positions
        already cached on the device keep the tree's pages; the caller frees the
        duplicates. Host-only nodes on the way take the given pages as their device
        pages (`attach`): those count as new, like the new leaf's."""
        ps = self.page_size
        if len(tokens) % ps or len(pages) != len(tokens) // ps:
            raise ValueError(
                f"insert needs whole pages: {len(tokens)} tokens, {len(pages)} pages, "
                f"page_size {ps}"
            )
        self.root(namespace)
        found = self.match(namespace, tokens, through_host=True, valid_only=False)
        num_cached = len(found.pages) * ps
        if num_cached < found.num_tokens:  # host-only nodes on the way: attach, top down
            host_path: list[Node] = []
            n = found.node
            while not n.pages and n.parent is not None:
                host_path.append(n)
                n = n.parent
            at = len(found.pages)
            for n in reversed(host_path):
                self.attach(n, pages[at : at + len(n.host_pages)])
                at += len(n.host_pages)
        if found.num_tokens == len(tokens):
            return InsertResult(found.node, num_cached, found.pages, None)
        parent = found.node
        leaf = self._new_node(namespace, parent)
        leaf.key = tokens[found.num_tokens :]
        leaf.pages = pages[found.num_tokens // ps :]
        leaf.last_access = self.now
        leaf.hit_count = 1
        if self.hash_blocks:
            prev = parent.hashes[-1] if parent.hashes else None
            for i in range(0, len(leaf.key), ps):
                prev = block_hash(prev, leaf.key[i : i + ps], namespace)
                leaf.hashes.append(prev)
        parent.children[self._child_key(leaf.key, 0)] = leaf
        self.leaves.discard(parent)
        self.leaves.add(leaf)
        self.num_pages += len(leaf.pages)
        self.version += 1
        return InsertResult(leaf, num_cached, found.pages, leaf)

    def add_host_leaf(self, parent: Node, tokens: list[int], host_pages: list[int]) -> Node:
        """A new host-only leaf under parent (a node of the tree, or a root) holding
        tokens (whole pages, none of them a child's first) in host_pages."""
        ps = self.page_size
        assert tokens and len(tokens) == len(host_pages) * ps
        assert self.child(parent, tokens, 0) is None
        leaf = self._new_node(parent.namespace, parent)
        leaf.key = list(tokens)
        leaf.host_pages = list(host_pages)
        leaf.last_access = self.now
        if self.hash_blocks:
            prev = parent.hashes[-1] if parent.hashes else None
            for i in range(0, len(tokens), ps):
                prev = block_hash(prev, tokens[i : i + ps], parent.namespace)
                leaf.hashes.append(prev)
        parent.children[self._child_key(tokens, 0)] = leaf
        self.host_leaves.discard(parent)
        self.host_leaves.add(leaf)
        self.num_host_pages += len(host_pages)
        self.version += 1
        return leaf

    def attach(self, node: Node, pages: list[int]) -> None:
        """Give a host-only node device pages again (a load-back, or an insert of the
        same tokens); its parent must be device-resident."""
        assert node.host_only and node.lock_ref == 0 and len(pages) == len(node.host_pages)
        parent = node.parent
        assert parent is not None and (parent.pages or parent.parent is None)
        node.pages = list(pages)
        self.num_pages += len(pages)
        self.host_leaves.discard(node)
        self.leaves.discard(parent)
        self.leaves.add(node)

    def set_host_pages(self, node: Node, host_pages: list[int]) -> None:
        """Record (or, with [], forget) a device-resident node's host copy."""
        assert node.pages and (not host_pages or len(host_pages) == len(node.pages))
        self.num_host_pages += len(host_pages) - len(node.host_pages)
        node.host_pages = list(host_pages)

    def lock(self, node: Node) -> None:
        while node.parent is not None:
            if node.lock_ref == 0:
                self.num_locked_nodes += 1
                self.num_locked_pages += len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node.parent is not None:
            assert node.lock_ref > 0, f"unlock of unlocked {node!r}"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.num_locked_nodes -= 1
                self.num_locked_pages -= len(node.pages)
            node = node.parent

    def evictable_pages(self) -> int:
        return self.num_pages - self.num_locked_pages

    def _evict_key(self, n: Node) -> tuple:
        if self.eviction_policy == "lfu":
            return (n.hit_count, n.last_access, n.node_id, n)
        return (n.last_access, n.node_id, n)

    def evict(self, num_pages: int,
              decide: Callable[[Node], str] | None = None) -> list[EvictedBlock]:  # fmt: skip
        """Take device pages from unlocked leaves until at least num_pages came out or
        nothing unlocked is left, least recently used first ("lru"), or least often hit
        first, then least recently ("lfu"). Whole nodes go. `decide(leaf)` says what
        happens to each: "drop" (the default: it leaves the tree with its host-only
        subtree), "demote" (it keeps its host copy and becomes host-only), "skip" (it
        stays as it is this time) or "wait" (it stays, but its pages count toward
        num_pages: they come free once its backup lands)."""
        heap = [self._evict_key(n) for n in self.leaves if n.lock_ref == 0]
        heapq.heapify(heap)
        out: list[EvictedBlock] = []
        freed = 0
        while freed < num_pages and heap:
            leaf = heapq.heappop(heap)[-1]
            parent = leaf.parent
            assert parent is not None and leaf.pages and leaf.lock_ref == 0
            what = decide(leaf) if decide is not None else "drop"
            if what in ("skip", "wait"):
                freed += len(leaf.pages) if what == "wait" else 0
                continue
            freed += len(leaf.pages)
            self.leaves.discard(leaf)
            if what == "demote":
                assert leaf.host_pages and leaf.valid
                out.append(EvictedBlock(leaf.pages, []))
                self.num_pages -= len(leaf.pages)
                leaf.pages = []
                if not leaf.children:
                    self.host_leaves.add(leaf)
            else:
                out.append(self._remove(leaf))
            if parent.parent is not None:
                if not any(c.pages for c in parent.children.values()):
                    self.leaves.add(parent)
                    if parent.lock_ref == 0:
                        heapq.heappush(heap, self._evict_key(parent))
            elif not parent.children and parent.namespace:
                del self.roots[parent.namespace]  # empty namespace: forget its root
        return out

    def evict_host(self, num_pages: int,
                   keep: Callable[[Node], bool] | None = None) -> list[EvictedBlock]:  # fmt: skip
        """Remove unlocked host-only leaves until at least num_pages host pages came
        out or none is left, in the order `evict` uses, except those `keep` names. (A
        host-only node is locked while a load that reaches it makes room on the
        device; `keep` names those whose host pages a file store copy uses.)"""
        heap = [self._evict_key(n) for n in self.host_leaves]
        heapq.heapify(heap)
        out: list[EvictedBlock] = []
        freed = 0
        while freed < num_pages and heap:
            leaf = heapq.heappop(heap)[-1]
            parent = leaf.parent
            assert parent is not None and leaf.host_only and not leaf.children
            if leaf.lock_ref or (keep is not None and keep(leaf)):
                continue
            out.append(self._remove(leaf))
            freed += len(out[-1].host_pages)
            if parent.parent is None:
                if not parent.children and parent.namespace:
                    del self.roots[parent.namespace]
            elif parent.host_only and not parent.children:
                self.host_leaves.add(parent)
                heapq.heappush(heap, self._evict_key(parent))
        return out

    def _remove(self, top: Node) -> EvictedBlock:
        """Take an unlocked node out of the tree with its subtree (which must be
        host-only); its parent's leaf status is the caller's."""
        parent = top.parent
        assert parent is not None and top.lock_ref == 0
        del parent.children[self._child_key(top.key, 0)]
        pages, hashes, host = list(top.pages), [], []
        stack = [top]
        while stack:
            n = stack.pop()
            assert n is top or not n.pages, "a device-resident node under an evicted one"
            hashes += n.hashes
            host += n.host_pages
            self.host_leaves.discard(n)
            stack.extend(n.children.values())
        self.leaves.discard(top)
        self.num_pages -= len(pages)
        self.num_host_pages -= len(host)
        return EvictedBlock(pages, hashes, host)

    def all_pages(self) -> list[int]:
        return [p for node in self.nodes() for p in node.pages]

    def all_host_pages(self) -> list[int]:
        return [p for node in self.nodes() for p in node.host_pages]

    def nodes(self) -> list[Node]:
        """Every non-root node, parents before children."""
        out: list[Node] = []
        stack = list(self.roots.values())
        while stack:
            node = stack.pop()
            if node.parent is not None:
                out.append(node)
            stack.extend(node.children.values())
        return out

    def clear(self) -> None:
        """Forget every node (locked ones too); the caller reclaims their pages."""
        self.roots.clear()
        self.leaves.clear()
        self.host_leaves.clear()
        self.num_pages = self.num_host_pages = 0
        self.num_locked_nodes = self.num_locked_pages = 0
        self.version += 1
