"""KV page allocator with a ledger: who owns every page, and an enumerable free set.

Theory of operation
    The cache manager sees pages leave only through leases and come back only through
    LeaseReturned, ChunkCached and SequenceReleased, so it cannot name the request that
    holds a leased page; it names the place instead. Each page has one owner:

        FREE   in the free set, ready to lease
        OUT    leased to the scheduler (in its pool or in a request's row)
        TREE   cached in the radix tree
        ASIDE  handed over by ChunkCached for positions the tree already held with other
               pages; kept for that request (its row still reads them), freed at its
               release

    The free set is a dict used as an ordered set: membership is O(1) and `popitem`
    takes the most recently freed page first (warm pages are reused first). Every free
    checks membership, so a double free raises here; the core validates messages before
    applying them and turns a bad free into a FreeRefused event instead.

Invariants
    - owner[p] == FREE  <=>  p in the free set.
    - counts[o] == number of pages whose owner is o; sum(counts) == num_pages.
    - aside_owner's keys are exactly the ASIDE pages (the core keeps it in step).
"""

from __future__ import annotations

FREE, OUT, TREE, ASIDE = 0, 1, 2, 3
OWNER_NAMES = ("free", "leased", "tree", "aside")
_WHY = {FREE: "already free", TREE: "owned by the prefix tree", ASIDE: "kept aside for"}


class LedgerError(RuntimeError):
    """An owner transition the ledger does not allow (a bug in the caller)."""


class PageLedger:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self.owner = bytearray(num_pages)  # FREE == 0 everywhere
        # popitem() is LIFO: fill high to low so a fresh pool hands out page 0 first.
        self._free: dict[int, None] = dict.fromkeys(range(num_pages - 1, -1, -1))
        self.counts = [num_pages, 0, 0, 0]
        self.aside_owner: dict[int, str] = {}  # ASIDE page -> the request it is kept for

    @property
    def num_free(self) -> int:
        return len(self._free)

    def is_free(self, page: int) -> bool:
        return page in self._free

    def valid(self, page: int) -> bool:
        return 0 <= page < self.num_pages

    def take(self, num_pages: int) -> list[int]:
        """Up to num_pages free pages, now OUT."""
        n = min(num_pages, len(self._free))
        pages = [self._free.popitem()[0] for _ in range(n)]
        for p in pages:
            self.owner[p] = OUT
        self.counts[FREE] -= n
        self.counts[OUT] += n
        return pages

    def move(self, pages: list[int], frm: int, to: int) -> None:
        """Change the owner of pages from frm to to (neither may be FREE)."""
        if frm == FREE or to == FREE:
            raise LedgerError("use take()/free() to leave or enter the free set")
        owner = self.owner
        for p in pages:
            if owner[p] != frm:
                raise LedgerError(
                    f"page {p} is {OWNER_NAMES[owner[p]]}, expected {OWNER_NAMES[frm]}"
                )
            owner[p] = to
        self.counts[frm] -= len(pages)
        self.counts[to] += len(pages)

    def free(self, pages: list[int]) -> None:
        """Return pages to the free set; a page already free raises (double free)."""
        owner, counts, free = self.owner, self.counts, self._free
        for p in pages:
            if p in free:
                raise LedgerError(f"double free of page {p}")
            counts[owner[p]] -= 1
            owner[p] = FREE
            free[p] = None
        counts[FREE] += len(pages)

    def refusals(
        self, pages: list[int], rid: str | None, tree_pages: list[int]
    ) -> list[tuple[int, str]]:
        """(page, why) for each page of pages the sender may not hand back: it must be
        OUT, kept aside for request rid, or tree_pages[i] itself at its position i."""
        owner, num = self.owner, self.num_pages
        k = min(len(tree_pages), len(pages))
        rest = pages[k:]
        if pages[:k] == tree_pages[:k] and (  # fast path: the tree's prefix, then leased
            not rest
            or (
                min(rest) >= 0
                and max(rest) < num
                and bytes(map(owner.__getitem__, rest)).count(OUT) == len(rest)
                and len(set(rest)) == len(rest)
            )
        ):
            return []
        bad: list[tuple[int, str]] = []
        seen: set[int] = set()
        for i, p in enumerate(pages):
            if not 0 <= p < num:
                bad.append((p, "no such page"))
                continue
            if p in seen:
                bad.append((p, "listed twice"))
                continue
            seen.add(p)
            o = owner[p]
            if o == OUT or (o == ASIDE and self.aside_owner[p] == rid):
                continue
            if o == TREE and i < len(tree_pages) and tree_pages[i] == p:
                continue
            why = _WHY[o] + (f" request {self.aside_owner[p]}" if o == ASIDE else "")
            bad.append((p, why))
        return bad

    def pages_owned_by(self, who: int) -> list[int]:
        """Enumerate the pages of one owner (O(num_pages); for checks and tests)."""
        if who == FREE:
            return sorted(self._free)
        return [p for p, o in enumerate(self.owner) if o == who]

    def check(self) -> None:
        """Recount everything from scratch; raises LedgerError on any mismatch."""
        counts = [0, 0, 0, 0]
        for p, o in enumerate(self.owner):
            counts[o] += 1
            if (o == FREE) != (p in self._free):
                raise LedgerError(f"page {p}: owner {OWNER_NAMES[o]} but free-set says otherwise")
        if counts != self.counts or len(self._free) != counts[FREE]:
            raise LedgerError(f"counts {self.counts} != recount {counts}")
        if len(self.aside_owner) != counts[ASIDE] or any(
            self.owner[p] != ASIDE for p in self.aside_owner
        ):
            raise LedgerError("aside_owner does not list exactly the ASIDE pages")
