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

    Each page also gets a block hash: a chain over page token ids (blake2b of the parent
    hash and the page's ids, truncated to a signed int64; the first page of a namespace
    hashes the namespace instead of a parent), the same in every process (Python's
    `hash()` is salted per process and is not used).

Invariants
    - len(node.key) == len(node.pages) * page_size for every non-root node; roots are
      empty. `num_pages` is the sum of len(node.pages) over all nodes.
    - node.lock_ref == number of locks held at or below node; a locked node is never
      evicted, and neither is an ancestor of one (it is not a leaf).
    - `leaves` is exactly the set of non-root nodes without children.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
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
        "key",
        "last_access",
        "lock_ref",
        "namespace",
        "node_id",
        "pages",
        "parent",
    )

    def __init__(self, node_id: int, namespace: str, parent: Node | None) -> None:
        self.node_id = node_id
        self.namespace = namespace
        self.parent = parent
        self.key: list[int] = []
        self.pages: list[int] = []
        self.hashes: list[int] = []  # one per page, empty when hashing is off
        self.children: dict[int | tuple[int, ...], Node] = {}
        self.lock_ref = 0
        self.last_access = 0
        self.hit_count = 0  # request lookups that reached through it, and its own insert

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def __repr__(self) -> str:
        return f"Node({self.node_id}, ns={self.namespace!r}, {len(self.key)} tok, lock={self.lock_ref})"


class MatchResult(NamedTuple):
    node: Node  # deepest node fully covered by the match (a root when nothing matched)
    pages: list[int]  # the tree's pages for the matched tokens
    num_tokens: int  # matched tokens, a multiple of page_size


class InsertResult(NamedTuple):
    node: Node  # the node ending exactly at the inserted length
    num_cached_tokens: int  # tokens that were already in the tree
    cached_pages: list[int]  # the tree's pages for those tokens
    new_node: Node | None  # the leaf that was added, if any tokens were new


class EvictedBlock(NamedTuple):
    pages: list[int]
    hashes: list[int]


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
        self.num_locked_nodes = 0
        self.num_locked_pages = 0
        self.roots: dict[str, Node] = {}
        self.leaves: set[Node] = set()
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
              hit: bool = False) -> MatchResult:  # fmt: skip
        """Longest cached page-aligned prefix of tokens. With split, an edge the match
        ends inside is split so that the result's node ends exactly at the match. With
        hit, a request's lookup: each node it reaches counts one more hit (LFU)."""
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
            if child is None:
                break
            m = self._common_len(child.key, tokens, pos, end)
            if m < len(child.key):
                if not split:
                    child.last_access = now
                    child.hit_count += hit
                    pages += child.pages[: m // ps]
                    pos += m
                    break
                child = self._split(child, m)
            child.last_access = now
            child.hit_count += hit
            pages += child.pages
            pos += m
            node = child
        return MatchResult(node, pages, pos)

    def path_pages(self, node: Node) -> list[int]:
        """The pages from the root down to node (the tokens node's path covers)."""
        parts: list[list[int]] = []
        while node.parent is not None:
            parts.append(node.pages)
            node = node.parent
        return [p for part in reversed(parts) for p in part]

    # -- changes ------------------------------------------------------------------

    def _split(self, child: Node, m: int) -> Node:
        """Cut child's edge after m tokens; returns the new upper node."""
        ps = self.page_size
        parent = child.parent
        assert parent is not None and 0 < m < len(child.key) and m % ps == 0
        head = self._new_node(child.namespace, parent)
        k = m // ps
        head.key, child.key = child.key[:m], child.key[m:]
        head.pages, child.pages = child.pages[:k], child.pages[k:]
        head.hashes, child.hashes = child.hashes[:k], child.hashes[k:]
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
        already cached keep the tree's pages; the caller frees the duplicates."""
        ps = self.page_size
        if len(tokens) % ps or len(pages) != len(tokens) // ps:
            raise ValueError(
                f"insert needs whole pages: {len(tokens)} tokens, {len(pages)} pages, "
                f"page_size {ps}"
            )
        self.root(namespace)
        found = self.match(namespace, tokens)
        if found.num_tokens == len(tokens):
            return InsertResult(found.node, found.num_tokens, found.pages, None)
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
        return InsertResult(leaf, found.num_tokens, found.pages, leaf)

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

    def evict(self, num_pages: int) -> list[EvictedBlock]:
        """Remove unlocked leaves until at least num_pages pages came out or nothing
        unlocked is left, least recently used first ("lru"), or least often hit first,
        then least recently ("lfu"). Whole nodes go."""
        heap = [self._evict_key(n) for n in self.leaves if n.lock_ref == 0]
        heapq.heapify(heap)
        out: list[EvictedBlock] = []
        freed = 0
        while freed < num_pages and heap:
            leaf = heapq.heappop(heap)[-1]
            parent = leaf.parent
            assert parent is not None and not leaf.children and leaf.lock_ref == 0
            del parent.children[self._child_key(leaf.key, 0)]
            self.leaves.discard(leaf)
            self.num_pages -= len(leaf.pages)
            freed += len(leaf.pages)
            out.append(EvictedBlock(leaf.pages, leaf.hashes))
            if parent.parent is not None and not parent.children:
                self.leaves.add(parent)
                if parent.lock_ref == 0:
                    heapq.heappush(heap, self._evict_key(parent))
            elif parent.parent is None and not parent.children and parent.namespace:
                del self.roots[parent.namespace]  # empty namespace: forget its root
        return out

    def all_pages(self) -> list[int]:
        return [p for node in self.nodes() for p in node.pages]

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
        self.num_pages = self.num_locked_nodes = self.num_locked_pages = 0
        self.version += 1
