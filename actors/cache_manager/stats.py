"""Cache manager statistics: the frozen record `CacheManagerCore.statistics()` returns,
`cache_stats`, the figures it sends for /metrics on each Tick, and the checks' reports:
the device tier's census and a refused free's reason."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from shunter.actors.cache_manager.allocator import ASIDE, FREE, OUT, TREE
from shunter.bus.messages import CacheStats, Census, CensusBroken, FreeRefused, SchedulerCensus

if TYPE_CHECKING:
    from shunter.actors.cache_manager.allocator import PageLedger
    from shunter.actors.cache_manager.host_tier import HostTier
    from shunter.actors.cache_manager.store_tier import StoreTier


class CacheStatistics(msgspec.Struct, frozen=True, kw_only=True):
    num_pages: int
    num_free: int
    num_leased: int  # OUT: with the scheduler, unused or in rows
    num_aside: int  # handed over by ChunkCached, positions already cached
    num_in_tree: int
    num_nodes: int
    num_locked_nodes: int
    num_locked_pages: int
    num_requests: int  # matched and not yet released
    num_leases_in_flight: int
    num_copies_in_flight: int
    tree_version: int
    num_matches: int
    num_queried_tokens: int
    num_hit_tokens: int
    num_evicted_pages: int
    num_free_refused: int
    num_census_broken: int
    # the host tier (all 0 when it is off)
    num_host_pages: int = 0
    num_host_free: int = 0
    num_host_in_tree: int = 0  # host copies the tree holds
    num_host_writing: int = 0  # host pages a backup in flight is writing
    num_host_only_nodes: int = 0  # evicted from the device, kept on the host
    num_host_hit_tokens: int = 0  # matched tokens that had to be loaded back
    num_spilled_pages: int = 0  # backed up to the host (copies answered ok)
    num_loaded_pages: int = 0  # loaded back to the device (copies answered ok)
    num_demoted_pages: int = 0  # device pages evicted whose host copy stays
    num_backups_skipped: int = 0  # no host room even after host eviction
    num_copies_failed: int = 0
    num_drops_deferred: int = 0  # DropTree held until the copies in flight were done
    # the file store below the host tier (all 0 when it is off)
    num_store_blocks: int = 0  # blocks it holds, as far as this process knows
    num_stored_blocks: int = 0  # written by this process
    num_fetched_blocks: int = 0  # read back into host pages
    num_store_hit_tokens: int = 0  # matched tokens read back from it
    num_store_copies_failed: int = 0
    store_block_tokens: int = 0  # 0: no store
    num_store_blocks_evicted: int = 0  # erased to keep it under its size cap

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0


def cache_stats(ledger: PageLedger, host: HostTier | None, store: StoreTier | None,
                num_queried: int, num_hit: int, num_evicted: int) -> CacheStats:  # fmt: skip
    """The core's figures for /metrics (bus/messages/cache.py CacheStats)."""
    counts = ledger.counts
    tier = host.counters() if host is not None else {}
    if store is not None:
        tier |= store.counters()
    return CacheStats(
        num_pages=ledger.num_pages, num_free=counts[FREE], num_in_tree=counts[TREE],
        num_queried_tokens=num_queried, num_hit_tokens=num_hit, num_evicted_pages=num_evicted,
        **tier,
    )  # fmt: skip


def device_census(ledger: PageLedger, num_tree_pages: int, msg: SchedulerCensus,
                  in_flight: int) -> list[Census | CensusBroken]:  # fmt: skip
    """The device tier's Census for the scheduler's count `msg`, and a CensusBroken when
    free + leased unused + held + in the tree is not every page. `in_flight`: pages of
    grants the scheduler had not seen when it counted."""
    counts = ledger.counts
    assert counts[TREE] == num_tree_pages, (counts, num_tree_pages)
    total = ledger.num_pages
    leased_unused = msg.num_leased_unused + in_flight
    held = msg.num_held_by_requests + counts[ASIDE]
    counted = counts[FREE] + leased_unused + held + counts[TREE]
    ok = counted == total
    out: list[Census | CensusBroken] = [
        Census(msg.step_id, "device", total, counts[FREE], leased_unused, held, counts[TREE], ok)
    ]
    if not ok:
        detail = (
            f"{counts[OUT]} pages are leased out by the ledger; the scheduler reports "
            f"{msg.num_leased_unused} leased unused + {msg.num_held_by_requests} held "
            f"(+ {in_flight} granted after lease {msg.last_lease_seq})"
        )
        out.append(CensusBroken(msg.step_id, "device", counted - total, detail))
    return out


def refusal(bad: list[tuple[int, str]], claimed_by: str) -> FreeRefused:
    """FreeRefused for (page, why) pairs: the reasons grouped, a few pages named each."""
    groups: dict[str, list[int]] = {}
    for p, why in bad:
        groups.setdefault(why, []).append(p)
    reason = "; ".join(
        f"{why}: {ps[:8]}{'...' if len(ps) > 8 else ''}" for why, ps in groups.items()
    )
    return FreeRefused([p for p, _ in bad], claimed_by, reason)
