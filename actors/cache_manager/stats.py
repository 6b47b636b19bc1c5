"""Cache manager statistics: the frozen record `CacheManagerCore.statistics()` returns."""

from __future__ import annotations

import msgspec


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

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0
