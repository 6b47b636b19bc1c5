"""The cache manager core's books: census, DropTree, the figures for /metrics.

Theory of operation
    A mixin of CacheManagerCore (core.py), on top of tiers.py's. SchedulerCensus closes the
    device ledger's books (and the host tier's) at a step boundary; DropTree waits
    while a copy between tiers is in flight, then reclaims every page of the tree
    (locked ones too when include_locked; refused while any is locked otherwise);
    the scheduler's Tick asks for CacheStats, sent when the figures changed since the
    last one or, unchanged, every STATS_REFRESH_NS of Tick time (for late subscribers); `statistics()` is the fuller snapshot tests and benchmarks read. The
    core's docstring says what each of these guarantees.
"""

from __future__ import annotations

from shunter.actors.cache_manager.allocator import ASIDE, FREE, OUT, TREE
from shunter.actors.cache_manager.stats import CacheStatistics, cache_stats, device_census
from shunter.actors.cache_manager.tiers import Tiers
from shunter.bus.messages import (
    AllBlocksCleared,
    CacheStats,
    DropTree,
    Msg,
    SchedulerCensus,
    Tick,
    TreeDropped,
)

# CacheStats go out again at least this often (Tick time), changed or not
STATS_REFRESH_NS = 5_000_000_000


class Books(Tiers):
    _leases_in_flight: dict[int, int]
    _last_stats: CacheStats | None
    _stats_sent_ns: int
    _num_matches: int
    _num_queried: int
    _num_hit: int
    _num_refused: int
    _num_broken: int
    _num_deferred: int

    def _on_census(self, msg: SchedulerCensus) -> list[Msg]:
        flights = self._leases_in_flight
        for seq in [s for s in flights if s <= msg.last_lease_seq]:
            del flights[seq]
        out = device_census(self.ledger, self.tree.num_pages, msg, sum(flights.values()))
        self._num_broken += len(out) - 1
        if self.host is not None:
            host_census = self.host.census(msg.step_id, self.tree)
            self._num_broken += len(host_census) - 1
            out += host_census
        return out

    def _on_drop(self, msg: DropTree) -> list[Msg]:
        if self._copying:
            self._num_deferred += 1
            self._drops.append(msg)
            return []
        return self._drop(msg)

    def _drop(self, msg: DropTree) -> list[Msg]:
        tree = self.tree
        if not msg.include_locked and tree.num_locked_nodes:
            num = sum(1 for r in self.requests.values() if r.node is not None and r.node.lock_ref)
            why = f"{num} requests hold prefix locks; flushing needs an idle engine"
            return [TreeDropped(msg.flip_id, 0, False, why, tree.version)]
        reclaim = [p for p in tree.all_pages() if not self.ledger.is_free(p)]
        if self.host is not None:
            self.host.ledger.free(tree.all_host_pages())
        for req in self.requests.values():
            if req.node is not None:
                req.reclaimed = frozenset(tree.path_pages(req.node))
                req.node = None
        tree.clear()
        self.ledger.free(reclaim)
        if self.store is not None:
            self.store.drop(msg.weights_changed)
        out: list[Msg] = [AllBlocksCleared()] if self.config.emit_kv_events else []
        out.append(TreeDropped(msg.flip_id, len(reclaim), True, "", tree.version))
        return out

    def _on_tick(self, tick: Tick) -> list[Msg]:
        """Matches whose wait for the store timed out, and the figures for /metrics
        when they changed since the last Tick or STATS_REFRESH_NS of Tick time passed
        since they last went out (a gateway that subscribed later, e.g. the one a
        multi-process server starts after the cache manager, gets them then)."""
        out = self._store_timeouts(tick.now_ns) if self._store_timers else []
        stats = cache_stats(self.ledger, self.host, self.store, self._num_queried, self._num_hit,
                            self._num_evicted)  # fmt: skip
        if stats != self._last_stats or tick.now_ns - self._stats_sent_ns >= STATS_REFRESH_NS:
            self._last_stats, self._stats_sent_ns = stats, tick.now_ns
            out.append(stats)
        return out

    def statistics(self) -> CacheStatistics:
        counts = self.ledger.counts
        return CacheStatistics(
            num_pages=self.ledger.num_pages,
            num_free=counts[FREE],
            num_leased=counts[OUT],
            num_aside=counts[ASIDE],
            num_in_tree=counts[TREE],
            num_nodes=len(self.tree.nodes()),
            num_locked_nodes=self.tree.num_locked_nodes,
            num_locked_pages=self.tree.num_locked_pages,
            num_requests=len(self.requests),
            num_leases_in_flight=sum(self._leases_in_flight.values()),
            num_copies_in_flight=(len(self.host.writes) + len(self.host.loads) if self.host else 0)
            + (self.store.num_erases_and_writes if self.store else 0),
            tree_version=self.tree.version,
            num_matches=self._num_matches,
            num_queried_tokens=self._num_queried,
            num_hit_tokens=self._num_hit,
            num_evicted_pages=self._num_evicted,
            num_free_refused=self._num_refused,
            num_census_broken=self._num_broken,
            **self._host_statistics(),
        )

    def _host_statistics(self) -> dict[str, int]:
        if self.host is None:
            return {}
        store = self.store.counters() if self.store is not None else {}
        return self.host.statistics(self.tree) | store | {"num_drops_deferred": self._num_deferred}
