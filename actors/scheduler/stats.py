"""Scheduler statistics: the frozen `statistics()` record and the periodic
SchedulerStats published on every Tick (the core's only clock)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from shunter.bus.messages import Msg, SchedulerStats, Tick

if TYPE_CHECKING:
    from shunter.actors.scheduler.core import SchedulerCore


class SchedulerStatistics(msgspec.Struct, frozen=True):
    num_waiting: int
    num_running: int
    num_retracted: int  # retracted or parked, not in the waiting queue
    num_steps: int
    num_in_flight: int
    num_leased_unused: int
    num_held_pages: int
    num_lease_requests: int
    num_retractions: int
    num_parked: int  # waiting requests whose match was released under KV pressure
    num_refreshes: int
    num_in_batch_deferred: int  # admission passes that deferred a request on a shared prefix
    num_chunks_cached: int
    num_finished: int
    num_aborted: int
    num_failed: int
    num_prefill_tokens: int
    num_generated_tokens: int
    num_unexpected: int  # messages that broke the protocol and were ignored
    new_token_ratio: float
    admission_paused: bool
    version: int
    num_preemptions: int = 0  # running requests retracted for a waiting one of higher priority


def on_tick(core: SchedulerCore, tick: Tick, out: list[Msg]) -> None:
    """Time moves (priority aging reads now_ns); publish the load figures."""
    if tick.now_ns <= core.now_ns:
        core.now_ns = max(core.now_ns, tick.now_ns)
        return
    dt_s = (tick.now_ns - core._last_stats_ns) / 1e9 if core._last_stats_ns else 0.0
    core.now_ns = tick.now_ns
    n = core._n
    out.append(
        SchedulerStats(
            step_id=core.step_id,
            num_running=len(core.running),
            num_waiting=len(core.waiting) + len(core.retracted),
            num_used_pages=core.num_held + sum(r.num_tree_pages for r in core.running.values()),
            num_total_pages=core.config.num_total_pages,
            cache_hit_rate=n["cached_tokens"] / n["prompt_tokens"] if n["prompt_tokens"] else 0.0,
            gen_throughput_tok_s=core._gen_since_stats / dt_s if dt_s > 0 else 0.0,
        )
    )  # fmt: skip
    core._last_stats_ns = tick.now_ns
    core._gen_since_stats = 0


def statistics(core: SchedulerCore) -> SchedulerStatistics:
    n = core._n
    return SchedulerStatistics(
        num_waiting=len(core.waiting),
        num_running=len(core.running),
        num_retracted=len(core.retracted),
        num_steps=core.step_id,
        num_in_flight=len(core.in_flight),
        num_leased_unused=len(core.pool),
        num_held_pages=core.num_held,
        num_lease_requests=core.pool.num_requests,
        num_retractions=n["retractions"],
        num_parked=n["parked"],
        num_preemptions=n["preemptions"],
        num_refreshes=n["refreshes"],
        num_in_batch_deferred=n["in_batch_deferred"],
        num_chunks_cached=n["chunks"],
        num_finished=n["finished"],
        num_aborted=n["aborted"],
        num_failed=n["failed"],
        num_prefill_tokens=n["prefill_tokens"],
        num_generated_tokens=n["generated"],
        num_unexpected=n["unexpected"],
        new_token_ratio=core.new_token_ratio,
        admission_paused=bool(core.paused_by),
        version=core.version,
    )
