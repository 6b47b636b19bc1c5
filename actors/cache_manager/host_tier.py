"""The cache manager's host KV tier: the host pool's ledger and the copies in flight.

Theory of operation
    A pure helper of CacheManagerCore (core.py), which owns the tree and the device
    ledger and calls in here. The host pool's pages have their own PageLedger: OUT
    there means a backup (SpillPages) is writing the page, TREE that a node holds it.

    - `backup(node)`: take host pages for a device-resident node (evicting host-only
      leaves LRU when short; no room at all skips it) and ask for the copy.
    - `decide(leaf)`: what device eviction does to a leaf: demote it when its backup
      has landed (the node stays, host-only), skip it while the backup runs or a load
      writes its pages (`blocked` is then set, so a short grant can be owed a
      PagesEvictable), else drop it. Under
      write_back a leaf with no backup gets one now, and it and a leaf whose backup
      runs count toward the eviction's target while it waits (so no more leaves than
      needed are copied); the grant is short and owed a PagesEvictable likewise.
    - `load(node)`: the host-only nodes of a match's path, from the top, get device
      pages as far as free ones reach (the core's `make_room` evicts first), the last
      one split where they run out; LoadPages asks for the copy. Under write_back, when
      the room is still to come from backups eviction started, nothing is loaded: the
      core has the match wait for a backup to land (`waiters` of the spill) and retry. Until PagesLoaded,
      those device pages are `page_load`'s, and a match reaching one waits (`waiters`).
    - `spilled` / `loaded`: a copy's reply. A failed backup forgets its host copy; a
      failed load leaves its nodes invalid (the core matches their waiters again).

Invariants
    - ledger OUT == the pages of `writes` (backups, and the file store's reads:
      store_tier.py); ledger TREE + OUT == tree.num_host_pages.
    - `page_load` maps exactly the device pages of `loads`; every load has a waiters
      entry (possibly empty) until it is answered.
"""

from __future__ import annotations

from collections.abc import Callable

from shunter.actors.cache_manager.allocator import FREE, OUT, TREE, PageLedger
from shunter.actors.cache_manager.radix import EvictedBlock, Node, RadixTree
from shunter.bus.messages import (
    Census,
    CensusBroken,
    LoadPages,
    Msg,
    PagesEvictable,
    PagesLoaded,
    PagesSpilled,
    SpillPages,
)


class HostTier:
    def __init__(self, num_pages: int, page_size: int, write_policy: str) -> None:
        self.ledger = PageLedger(num_pages)
        self.page_size = page_size
        self.selective = write_policy == "write_through_selective"  # at a reuse, not insert
        self.write_back = write_policy == "write_back"  # at eviction, not insert
        self.next_copy = 1
        self.writes: dict[int, list[int]] = {}  # copy id -> host pages being written
        self.loads: dict[int, list[int]] = {}  # copy id -> device pages being loaded
        self.page_load: dict[int, int] = {}  # device page being loaded -> copy id
        # copy id -> requests waiting for it, in order: every load's; a spill's under
        # write_back when a match waits for room
        self.waiters: dict[int, dict[str, None]] = {}
        self.blocked = False  # the last eviction skipped a leaf whose backup is in flight
        # the leaves eviction must not take out of the tree (a file store copy uses host
        # pages under them: store_tier.py), when there is a file store
        self.keep: Callable[[Node], bool] | None = None
        self.write_nodes: dict[int, Node] = {}  # backup copy id -> the node backed up
        self.owe_relief = False  # a short grant awaits a backup landing (PagesEvictable)
        self.num_host_hit = self.num_spilled = self.num_loaded = self.num_demoted = 0
        self.num_skipped = self.num_failed = 0

    @property
    def busy(self) -> bool:
        return bool(self.writes or self.loads)

    def next_copy_id(self) -> int:
        cid = self.next_copy
        self.next_copy += 1
        return cid

    def decide(self, leaf: Node, back_up: Callable[[Node], bool]) -> str:
        """What device eviction does to a leaf (RadixTree.evict). Under write_back a
        leaf with no host copy is backed up now (`back_up(leaf)`: whether a copy
        started) and waited for, as is one whose backup is running. A leaf a load is
        still writing stays: no request may hold it (a waiter that failed over or was
        released lets go), and its pages must not reach another before the copy ends."""
        if self.page_load and any(p in self.page_load for p in leaf.pages):
            self.blocked = True
            return "skip"
        if not leaf.host_pages:
            if self.write_back and leaf.valid and back_up(leaf):
                self.blocked = True
                return "wait"
            return self._drop_unless_kept(leaf)
        if any(self.ledger.owner[h] == OUT for h in leaf.host_pages):
            self.blocked = True
            return "wait" if self.write_back else "skip"
        return "demote" if leaf.valid else self._drop_unless_kept(leaf)

    def _drop_unless_kept(self, leaf: Node) -> str:
        if self.keep is not None and self.keep(leaf):
            self.blocked = True
            return "skip"
        return "drop"

    def backup(self, tree: RadixTree, node: Node,
               release: Callable[[list[EvictedBlock]], object]) -> SpillPages | None:  # fmt: skip
        """Copy a device-resident node to host pages, room permitting; `release` frees
        what host eviction took out of the tree."""
        if node.host_pages or not node.valid:
            return None
        n = len(node.pages)
        if self.ledger.num_free < n:
            release(tree.evict_host(n - self.ledger.num_free, keep=self.keep))
            if self.ledger.num_free < n:
                self.num_skipped += 1
                return None
        host_pages = self.ledger.take(n)
        tree.set_host_pages(node, host_pages)
        cid = self.next_copy_id()
        self.writes[cid] = host_pages
        self.write_nodes[cid] = node
        return SpillPages(cid, list(node.hashes), list(node.pages), host_pages)

    def load(self, tree: RadixTree, device: PageLedger, node: Node,
             make_room: Callable[[Node, int], object]) -> tuple[Node, LoadPages | None]:  # fmt: skip
        """Load back the host-only nodes ending at node (the end of a match); returns
        the deepest device-resident node of the path then, and the copy to ask for.
        `make_room(end, n)` evicts n device pages, keeping end's path: the host-only
        nodes to load as well, which the backups write_back eviction starts could
        otherwise evict from the host to make their room."""
        end = node
        host_path: list[Node] = []
        while node.parent is not None and not node.pages:
            host_path.append(node)
            node = node.parent
        host_path.reverse()
        need = sum(len(n.host_pages) for n in host_path)
        if need > device.num_free:
            make_room(end, need - device.num_free)
            if self.write_back and self.blocked and need > device.num_free:
                return node, None  # room comes as the backups eviction started land
        room = device.num_free
        loaded: list[Node] = []
        for n in host_path:
            if len(n.host_pages) > room:  # load the head that fits, if any
                if room:
                    loaded.append(tree.split(n, room * self.page_size))
                break
            room -= len(n.host_pages)
            loaded.append(n)
        if not loaded:
            return node, None
        cid = self.next_copy_id()
        pages: list[int] = []
        for n in loaded:
            taken = device.take(len(n.host_pages))
            device.move(taken, OUT, TREE)
            tree.attach(n, taken)
            pages += taken
        self.loads[cid] = pages
        self.waiters[cid] = {}
        for p in pages:
            self.page_load[p] = cid
        self.num_host_hit += len(pages) * self.page_size
        load = LoadPages(cid, [h for n in loaded for h in n.hashes],
                         [p for n in loaded for p in n.host_pages], pages)  # fmt: skip
        return loaded[-1], load

    def waits_for(self, pages: list[int]) -> set[int]:
        """The loads in flight that some of these device pages wait for."""
        if not self.page_load:
            return set()
        return {cid for p in pages if (cid := self.page_load.get(p)) is not None}

    def spilled(self, tree: RadixTree, msg: PagesSpilled) -> list[Msg] | None:
        """A backup's reply; None when it answers no backup of ours."""
        if msg.copy_id not in self.write_nodes:
            return None  # (a fetch's pages are in writes too: store_tier.py)
        host_pages = self.writes.pop(msg.copy_id)
        del self.write_nodes[msg.copy_id]
        out: list[Msg] = []
        if self.owe_relief:  # landed or not, its pages can be evicted now
            self.owe_relief = False
            out.append(PagesEvictable(len(host_pages)))
        if msg.ok:
            self.ledger.move(host_pages, OUT, TREE)
            self.num_spilled += len(host_pages)
        else:
            self.num_failed += 1
            lost = set(host_pages)
            for n in tree.nodes():
                if n.host_pages and lost.intersection(n.host_pages):
                    tree.set_host_pages(n, [])
            self.ledger.free(host_pages)
        return out

    def loaded(self, tree: RadixTree, msg: PagesLoaded) -> list[str] | None:
        """A load's reply: the requests that waited for it, in order; None when it
        answers no load of ours. A failed load's nodes are marked invalid."""
        pages = self.loads.pop(msg.copy_id, None)
        if pages is None:
            return None
        for p in pages:
            del self.page_load[p]
        if msg.ok:
            self.num_loaded += len(pages)
        else:
            self.num_failed += 1
            bad = set(pages)
            for n in tree.nodes():
                if n.pages and bad.intersection(n.pages):
                    n.valid = False
        return list(self.waiters.pop(msg.copy_id))

    def census(self, step_id: int, tree: RadixTree) -> list[Msg]:
        """The host tier's Census (and CensusBroken when it does not add up)."""
        hc, total = self.ledger.counts, self.ledger.num_pages
        writing = sum(len(ps) for ps in self.writes.values())
        cached = tree.num_host_pages - writing  # a node's host pages: cached, or being written
        counted = hc[FREE] + writing + cached
        ok = counted == total and hc[TREE] == cached and hc[OUT] == writing
        out: list[Msg] = [Census(step_id, "host", total, hc[FREE], 0, 0, cached, ok, writing)]
        if not ok:
            detail = (f"host ledger {hc[FREE]} free, {hc[OUT]} writing, {hc[TREE]} cached; "
                      f"the tree holds {cached}, backups in flight {writing}")  # fmt: skip
            out.append(CensusBroken(step_id, "host", counted - total, detail))
        return out

    def counters(self) -> dict[str, int]:
        """The figures that cost no walk of the tree (CacheStats' host fields)."""
        c = self.ledger.counts
        return dict(
            num_host_pages=self.ledger.num_pages, num_host_free=c[FREE],
            num_host_in_tree=c[TREE], num_host_writing=c[OUT],
            num_host_hit_tokens=self.num_host_hit, num_spilled_pages=self.num_spilled,
            num_loaded_pages=self.num_loaded, num_copies_failed=self.num_failed,
        )  # fmt: skip

    def statistics(self, tree: RadixTree) -> dict[str, int]:
        return dict(
            self.counters(), num_host_only_nodes=sum(1 for n in tree.nodes() if n.host_only),
            num_demoted_pages=self.num_demoted, num_backups_skipped=self.num_skipped,
        )  # fmt: skip
