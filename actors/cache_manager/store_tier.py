"""The cache manager's file store tier: which blocks the store holds, the copies in flight.

Theory of operation
    A pure helper of CacheManagerCore (core.py), beside host_tier.py; the executor moves
    the bytes (actors/executor/file_store.py). The store sits below the host tier: a
    block goes to it from host pages and comes back into host pages, from where the
    host tier loads it like any host-only prefix.

    A block is `block_tokens` tokens from a multiple of block_tokens in a namespace's
    sequence, keyed by `block_keys`: a blake2b chain over whole blocks, rooted in the
    namespace and the store's generation. A key names the prefix that ends with its
    block, whatever the page layout, and outlives the process: the files of an earlier
    run under the same model are found again (StoreListed at start). A weights flip
    bumps the generation, so no block computed by the old weights is matched again.

    - `after_backup(node)`: once a node's backup to the host has landed, the blocks it
      completes whose every page has a host copy, and which the store neither holds nor
      is being given, are written (StorePages). Their host pages are pinned (`pinned`:
      eviction leaves them in the tree) until PagesStored.
    - `fetch(node, m, tokens)`: a match ending at m, short of what the store holds of
      the request's tokens: the blocks from the one holding m on are read into host
      pages taken now (FetchPages), under a new host-only leaf at the match's end. Its
      pages are pinned (neither host eviction nor a device eviction dropping a node
      above takes the leaf out of the tree) and OUT in the host ledger (the host
      tier's `writes` counts them, so a census and a DropTree see a copy in flight)
      until PagesFetched; a match reaching them waits (`waiting_on`) and is matched
      again then, which loads them.
    - A failed write forgets nothing (the blocks were not known); a failed fetch marks
      the nodes holding its pages invalid and forgets its keys, so no match tries them
      again, and erases their files: a file that is there but bad would otherwise stay,
      uncounted by the cap, and keep a later write of its key from replacing it (a
      write skips a name that exists).
    - A size cap (`max_blocks` > 0): the store holds at most that many blocks, those
      being written counted. A write that would take it past the cap first evicts the
      least recently used blocks (a block is used when it is written or fetched; those
      an earlier run left come before any other, in StoreListed's order, oldest
      first), never one a fetch in flight reads; their files go (EraseBlocks, sent
      before the write, so the store deletes them first). When the blocks being read
      leave too little room, only the write's first blocks that fit are written.
      Recency is the order of `known`, a block moved to its end on each use: no clock.
      StoreListed trims what an earlier run left past the cap alike.
    - `clear(host, clear_id)` (ClearStore): every block file goes (EraseBlocks,
      everything). The store runs its copies in the order they came, so the writes and
      reads sent before the erase finish first and those sent after start after it:
      the core forgets every known block now (no read of one is sent after the erase)
      and `voided` the writes in flight (their PagesStored comes, but their files go).
      Host and device pages keep what they hold.

Invariants
    - `pinned` counts, per host page, the store copies in flight that use it.
    - every fetch's pages are in the host tier's `writes` under its copy id, with a
      `waiters` entry, until it is answered.
    - a key is in `known` only if its file exists once every copy sent so far has run.
    - with a cap, len(known) + len(pending) <= max_blocks after every message, so once
      every copy sent so far has run the store's directory holds at most max_blocks
      block files (and the temp file of the one block being written).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from collections.abc import Callable

from shunter.actors.cache_manager.allocator import OUT, TREE
from shunter.actors.cache_manager.host_tier import HostTier
from shunter.actors.cache_manager.radix import EvictedBlock, Node, RadixTree
from shunter.bus.messages import (
    BlocksErased,
    EraseBlocks,
    FetchPages,
    PagesFetched,
    PagesStored,
    StoreCleared,
    StorePages,
)

PREFETCH_TIMEOUT_NS = 1_000_000_000  # a "timeout" match waits this long for the store,
PREFETCH_TIMEOUT_NS_PER_KI_TOKEN = 250_000_000  # and this much more per 1024 tokens


def prefetch_timeout_ns(num_tokens: int) -> int:
    """How long a match under the "timeout" prefetch policy waits for the store to read
    num_tokens tokens (SGLang's defaults: 1 s, and 0.25 s per 1024 tokens)."""
    return PREFETCH_TIMEOUT_NS + PREFETCH_TIMEOUT_NS_PER_KI_TOKEN * num_tokens // 1024


def block_keys(generation: int, namespace: str, tokens: list[int], block_tokens: int) -> list[int]:
    """One key per whole block of tokens: blake2b of the previous key and the block's
    ids (the first block chains on the namespace and generation), as a signed int64."""
    prev = hashlib.blake2b(f"{generation}\0{namespace}".encode(), digest_size=8).digest()
    keys: list[int] = []
    for i in range(0, len(tokens) - block_tokens + 1, block_tokens):
        prev = hashlib.blake2b(prev + array("q", tokens[i : i + block_tokens]).tobytes(),
                               digest_size=8).digest()  # fmt: skip
        keys.append(int.from_bytes(prev, "little", signed=True))
    return keys


class StoreTier:
    def __init__(self, block_tokens: int, page_size: int, max_blocks: int = 0) -> None:
        assert block_tokens % page_size == 0 and max_blocks >= 0
        self.block_tokens = block_tokens
        self.page_size = page_size
        self.block_pages = block_tokens // page_size
        self.max_blocks = max_blocks  # 0: no cap
        self.generation = 0
        self.known: dict[int, None] = {}  # blocks the store holds, least recently used first
        self.pending: set[int] = set()  # blocks being written
        self.pinned: Counter[int] = Counter()  # host page -> store copies using it
        self.stores: dict[int, tuple[list[int], list[int]]] = {}  # copy id -> keys, pages
        self.fetches: dict[int, tuple[list[int], list[int]]] = {}  # copy id -> keys, pages
        self.page_fetch: dict[int, int] = {}  # host page being fetched -> copy id
        self.clears: dict[int, tuple[str, int]] = {}  # erase's copy id -> clear id, blocks
        self.erases: dict[int, list[int]] = {}  # erase's copy id -> blocks evicted or bad
        self.voided: set[int] = set()  # writes an erase sent after them undoes
        self.num_stored = self.num_fetched = self.num_hit = self.num_failed = 0
        self.num_evicted = 0

    @property
    def num_erases_and_writes(self) -> int:
        """Its copies in flight that the host tier's books do not count (fetches are in
        its `writes`)."""
        return len(self.stores) + len(self.clears) + len(self.erases)

    @property
    def busy(self) -> bool:
        return bool(self.stores or self.fetches)

    def keep(self, node: Node) -> bool:
        """Whether eviction must leave node and what hangs from it: a store copy uses
        host pages there."""
        if not self.pinned:
            return False
        stack = [node]
        while stack:
            n = stack.pop()
            if any(self.pinned[h] for h in n.host_pages):
                return True
            stack.extend(n.children.values())
        return False

    def _pin(self, pages: list[int], by: int) -> None:
        for h in pages:
            self.pinned[h] += by
            if not self.pinned[h]:
                del self.pinned[h]

    def listed(self, host: HostTier, keys: list[int]) -> EraseBlocks | None:
        """The blocks an earlier run left (StoreListed, oldest first): known from now
        on, as less recent than any this run used; past the cap, the oldest go."""
        older = dict.fromkeys(k for k in keys if k not in self.known and k not in self.pending)
        older.update(self.known)
        self.known = older
        return self._make_room(host, 0)

    def drop(self, weights_changed: bool) -> None:
        """The tree was dropped (no copy is in flight then); with new weights, nothing
        stored so far may be matched again: the generation roots every key from now on,
        so no earlier key is matched. The earlier blocks stay known (their files are
        there), the least recent of all, so a cap evicts them first."""
        if weights_changed:
            self.generation += 1

    # -- the cap ------------------------------------------------------------------

    def _use(self, keys: list[int]) -> None:
        """Make keys the most recently used blocks."""
        for k in keys:
            self.known.pop(k, None)
            self.known[k] = None

    def _make_room(self, host: HostTier, num_new: int) -> EraseBlocks | None:
        """Under a cap, evict the least recently used blocks that no fetch in flight
        reads until num_new more blocks fit (or none is left to evict): EraseBlocks of
        them, to send before the write."""
        over = len(self.known) + len(self.pending) + num_new - self.max_blocks
        if not self.max_blocks or over <= 0:
            return None
        reading = {k for keys, _ in self.fetches.values() for k in keys}
        victims: list[int] = []
        for k in self.known:
            if len(victims) == over:
                break
            if k not in reading:
                victims.append(k)
        if not victims:
            return None
        for k in victims:
            del self.known[k]
        self.num_evicted += len(victims)
        return self._erase(host, victims)

    def _erase(self, host: HostTier, keys: list[int]) -> EraseBlocks:
        cid = host.next_copy_id()
        self.erases[cid] = keys
        return EraseBlocks(cid, list(keys))

    # -- writes -------------------------------------------------------------------

    def after_backup(self, tree: RadixTree, host: HostTier,
                     node: Node) -> list[EraseBlocks | StorePages]:  # fmt: skip
        """Write the blocks a node whose backup just landed completes, where the whole
        block has host copies and the store lacks it; under a cap, what it evicts for
        them is erased first."""
        path: list[Node] = []
        n: Node | None = node
        while n is not None and n.parent is not None:
            path.append(n)
            n = n.parent
        path.reverse()
        tokens: list[int] = []
        host_pages: list[int | None] = []
        for p in path:
            tokens += p.key
            host_pages += p.host_pages or [None] * (len(p.key) // self.page_size)
        bt, bp = self.block_tokens, self.block_pages
        start = len(tokens) - len(node.key)
        keys = block_keys(self.generation, node.namespace, tokens, bt)
        out_keys: list[int] = []
        out_pages: list[int] = []
        for j in range(start // bt, len(keys)):
            pages = host_pages[j * bp : (j + 1) * bp]
            if keys[j] in self.known or keys[j] in self.pending or None in pages:
                continue
            if any(host.ledger.owner[h] != TREE for h in pages):  # type: ignore[index]
                continue  # a copy into these host pages has not landed yet
            out_keys.append(keys[j])
            out_pages += pages  # type: ignore[arg-type]
        out: list[EraseBlocks | StorePages] = []
        if self.max_blocks and out_keys:
            erase = self._make_room(host, len(out_keys))
            out += [erase] if erase is not None else []
            room = max(self.max_blocks - len(self.known) - len(self.pending), 0)
            out_keys, out_pages = out_keys[:room], out_pages[: room * bp]  # a prefix's first
        if not out_keys:
            return out
        cid = host.next_copy_id()
        self.stores[cid] = (out_keys, out_pages)
        self.pending.update(out_keys)
        self._pin(out_pages, 1)
        out.append(StorePages(cid, out_keys, out_pages))
        return out

    def stored(self, msg: PagesStored) -> bool:
        """A write's reply; False when it answers no write of ours."""
        entry = self.stores.pop(msg.copy_id, None)
        if entry is None:
            return False
        keys, pages = entry
        self.pending.difference_update(keys)
        self._pin(pages, -1)
        if msg.copy_id in self.voided:  # erased after it: no block known; a failure still counts
            self.voided.discard(msg.copy_id)
            self.num_failed += not msg.ok
        elif msg.ok:
            self._use(keys)
            self.num_stored += len(keys)
        else:
            self.num_failed += 1
        return True

    # -- fetches ------------------------------------------------------------------

    def waiting_on(self, node: Node) -> set[int]:
        """The fetches in flight whose pages the host-only end of a match holds."""
        cids: set[int] = set()
        while self.page_fetch and node.parent is not None and node.host_only:
            cids.update(c for h in node.host_pages if (c := self.page_fetch.get(h)) is not None)
            node = node.parent
        return cids

    def before_fetches(self, node: Node) -> Node:
        """The deepest node of node's path whose host pages no read is still writing:
        a match that does not wait for the store ends there. (A read makes a host-only
        leaf below a match's end, so the nodes being read are the path's last ones.)"""
        while (
            node.parent is not None
            and node.host_only
            and any(h in self.page_fetch for h in node.host_pages)
        ):
            node = node.parent
        return node

    def fetch(self, tree: RadixTree, host: HostTier, node: Node, m: int, tokens: list[int],
              release: Callable[[list[EvictedBlock]], object]) -> FetchPages | None:  # fmt: skip
        """Read the stored blocks past a match (node, ending at m tokens of `tokens`, the
        most it may cover) into host pages under a new host-only leaf; `release` frees
        what host eviction took to make room."""
        bt, ps = self.block_tokens, self.page_size
        if not self.known or len(tokens) < (m // bt + 1) * bt:
            return None
        if node.parent is None:
            node = tree.root(node.namespace)
        if tree.child(node, tokens, m) is not None:
            return None  # a node the match stopped before (not valid) is there already
        keys = block_keys(self.generation, node.namespace, tokens, bt)
        j0 = j = m // bt
        while j < len(keys) and keys[j] in self.known:
            j += 1
        need = (j * bt - m) // ps
        if need > host.ledger.num_free:
            tree.lock(node)  # the match's own host-only nodes stay
            release(tree.evict_host(need - host.ledger.num_free, keep=self.keep))
            tree.unlock(node)
        while j > j0 and (j * bt - m) // ps > host.ledger.num_free:
            j -= 1
        if j == j0:
            return None
        pages = host.ledger.take((j * bt - m) // ps)
        tree.add_host_leaf(node, tokens[m : j * bt], pages)
        cid = host.next_copy_id()
        host.writes[cid] = pages
        host.waiters[cid] = {}
        self.fetches[cid] = (keys[j0:j], pages)
        self._use(keys[j0:j])
        self._pin(pages, 1)
        for h in pages:
            self.page_fetch[h] = cid
        return FetchPages(cid, keys[j0:j], (m - j0 * bt) // ps, pages)

    def fetched(self, tree: RadixTree, host: HostTier,
                msg: PagesFetched) -> tuple[list[str], EraseBlocks | None] | None:  # fmt: skip
        """A fetch's reply: the requests that waited for it, in order, and when it
        failed the erase of its blocks; None when it answers no fetch of ours."""
        entry = self.fetches.pop(msg.copy_id, None)
        if entry is None:
            return None
        keys, pages = entry
        del host.writes[msg.copy_id]
        self._pin(pages, -1)
        for h in pages:
            del self.page_fetch[h]
        host.ledger.move(pages, OUT, TREE)
        erase = None
        if msg.ok:
            self.num_fetched += len(keys)
            self.num_hit += len(pages) * self.page_size
        else:
            self.num_failed += 1
            bad_keys = [k for k in keys if k in self.known]
            for k in bad_keys:
                del self.known[k]
            erase = self._erase(host, bad_keys) if bad_keys else None
            bad = set(pages)
            for n in tree.nodes():
                if n.host_pages and bad.intersection(n.host_pages):
                    n.valid = False
        return list(host.waiters.pop(msg.copy_id)), erase

    # -- clearing -----------------------------------------------------------------

    def clear(self, host: HostTier, clear_id: str) -> EraseBlocks:
        """Empty the store: every block file goes (EraseBlocks, which the store runs
        after the copies sent before it). Nothing known is matched from now on, and the
        writes in flight count for nothing: their files go too."""
        cid = host.next_copy_id()
        self.clears[cid] = (clear_id, len(self.known))
        self.known.clear()
        self.voided.update(self.stores)
        return EraseBlocks(cid, [], everything=True)

    def erased(self, msg: BlocksErased) -> StoreCleared | None:
        """An erase's reply, as its clear's answer; None when it answers no clear (an
        eviction's failure counts as a failed copy: its files may still be there)."""
        if self.erases.pop(msg.copy_id, None) is not None:
            self.num_failed += not msg.ok
            return None
        entry = self.clears.pop(msg.copy_id, None)
        if entry is None:
            return None
        clear_id, num = entry
        return StoreCleared(clear_id, msg.ok, num, msg.error)

    def counters(self) -> dict[str, int]:
        return dict(
            num_store_blocks=len(self.known), num_stored_blocks=self.num_stored,
            num_fetched_blocks=self.num_fetched, num_store_hit_tokens=self.num_hit,
            num_store_copies_failed=self.num_failed, store_block_tokens=self.block_tokens,
            num_store_blocks_evicted=self.num_evicted,
        )  # fmt: skip
