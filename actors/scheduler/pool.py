"""The scheduler's local pool of leased KV pages.

The cache manager leases free pages to the scheduler ahead of need (LeaseRequest ->
LeaseGranted), so a step draws the pages it appends from this pool with no round trip.
At most one lease request is outstanding. A grant smaller than asked means the cache
could not free more (everything else is held or locked): `cache_short` stays set until
the scheduler itself gives pages back (a release, a retraction) or the cache manager
says that pages became evictable (PagesEvictable: a backup to the host tier that held
them landed); this keeps a short cache from being asked every step. A short grant that
`awaits_backup` will be followed by that PagesEvictable: the scheduler waits for it
rather than parking, retracting or aborting requests to free pages.

Invariants
    - Every page is in the pool at most once; pages leave it only into a request's row
      (`take`) or back to the cache manager (`give_back`).
    - last_received_seq is the seq of the newest grant received (census: grants up to
      it have arrived, later ones are still in flight).
"""

from __future__ import annotations

from shunter.bus.messages import LeaseGranted, LeaseRequest, LeaseReturned


class LeasePool:
    __slots__ = ("awaits_backup", "cache_short", "last_received_seq", "next_seq", "num_grants",
                 "num_requests", "outstanding", "pages")  # fmt: skip

    def __init__(self) -> None:
        self.pages: list[int] = []
        self.next_seq = 1
        self.outstanding: tuple[int, int] | None = None  # (lease_seq, num_pages asked)
        self.last_received_seq = 0
        self.cache_short = False
        self.awaits_backup = False  # cache_short until a backup in flight lands
        self.num_requests = 0
        self.num_grants = 0

    def __len__(self) -> int:
        return len(self.pages)

    def request(self, num_pages: int) -> LeaseRequest:
        assert self.outstanding is None and num_pages > 0
        seq = self.next_seq
        self.next_seq += 1
        self.outstanding = (seq, num_pages)
        self.num_requests += 1
        return LeaseRequest(lease_seq=seq, num_pages=num_pages)

    def granted(self, msg: LeaseGranted) -> bool:
        """Take a grant's pages. False if it answers no outstanding request (its pages are
        still taken: the cache manager's ledger says they are ours now)."""
        self.pages.extend(msg.pages)
        self.num_grants += 1
        self.last_received_seq = max(self.last_received_seq, msg.lease_seq)
        if self.outstanding is None or self.outstanding[0] != msg.lease_seq:
            return False
        self.cache_short = len(msg.pages) < self.outstanding[1]
        self.awaits_backup = self.cache_short and msg.awaits_backup
        self.outstanding = None
        return True

    def take(self, n: int) -> list[int]:
        assert 0 <= n <= len(self.pages)
        if n == 0:
            return []
        taken = self.pages[-n:]
        del self.pages[-n:]
        return taken

    def give_back(self, n: int) -> LeaseReturned:
        return LeaseReturned(pages=self.take(n))

    def pages_released(self) -> None:
        """The scheduler freed pages on the cache manager's side, or a backup landed: a
        lease may succeed again."""
        self.cache_short = self.awaits_backup = False
