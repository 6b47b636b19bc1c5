"""KV pressure: retraction, parking, and un-stalling when the cache has no more pages.

When the pages the next step needs cannot be had (the pool is short and the cache
manager's last grant was short since our last release), pages are freed in order of
least work lost: park waiting requests (release their matches: no computation is lost),
else retract running requests (fewest output tokens first, then the longest prompt, as
SGLang; with retraction_policy "priority" the lowest priority first), else end a lone
request that still cannot grow. All of it happens only when no batch is in flight (a
request's pages are never released while a batch writes them). Parked requests return
(Tokenized to the cache manager again) once the pressure passed.

Priority preemption (priority_preemption_threshold): when every slot is taken and the
highest-priority waiting request outranks the lowest-priority running one by at least
the threshold, that running request is retracted (once nothing is in flight) and the
waiting one takes its slot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from shunter.actors.scheduler.req import PARKED, RETRACTED, Req
from shunter.bus.messages import FinishReason, Msg, Tokenized

if TYPE_CHECKING:
    from shunter.actors.scheduler.core import SchedulerCore


def _by_length(r: Req) -> tuple:
    return (r.num_output, -r.num_prompt)


def _by_priority(r: Req) -> tuple:
    return (r.priority, r.num_output, -r.num_prompt)


def victim_order(core: SchedulerCore):
    """Sort key of running requests, the first to retract first (module docstring)."""
    return _by_priority if core.config.retraction_policy == "priority" else _by_length


def preemption_victim(core: SchedulerCore) -> Req | None:
    """The running request a waiting one of higher priority should take the slot of,
    or None (module docstring)."""
    cfg = core.config
    threshold = cfg.priority_preemption_threshold
    if threshold is None or cfg.schedule_policy != "priority" or not core.running:
        return None
    if len(core.running) < cfg.max_running_requests and core.rows.num_free > 0:
        return None
    waiting = [r for r in core.waiting.values() if not r.awaiting_match]
    if not waiting:
        return None
    best = max(r.priority for r in waiting)
    victim = min(core.running.values(), key=_by_priority)
    return victim if best - victim.priority >= threshold else None


def retract(core: SchedulerCore, req: Req, out: list[Msg]) -> None:
    """Give a running request's KV back (prefix kept in the tree); it waits for the
    cache manager's new Matched, then re-queues with its output so far."""
    core._end_running(req, "retracted", out)
    sp = req.sampling
    if sp.logprob_start_len >= 0:
        # Prompt logprobs went out up to position num_computed - 1 (the next one is
        # scored by logits lost with the row): the reopened row asks from there, or
        # for none once the prompt is done, so no position is reported twice. The
        # cache manager's match leaves position num_computed - 1 to compute.
        start = -1 if req.num_output > 0 else max(sp.logprob_start_len, req.num_computed)
        req.sampling = msgspec.structs.replace(sp, logprob_start_len=start)
    req.state = RETRACTED
    req.awaiting_match = True
    req.num_computed = req.num_planned = 0
    req.num_cached = 0
    req.num_retractions += 1
    core.retracted[req.request_id] = req
    core.last_pressure_step = core.step_id
    core._n["retractions"] += 1


def park(core: SchedulerCore, req: Req, out: list[Msg]) -> None:
    """Release a waiting request's match (its lock pins tree pages the running
    requests need); it stays queued here and is matched again by `unpark`."""
    del core.waiting[req.request_id]
    core._release(req, "aborted", out)
    req.state = PARKED
    req.num_computed = req.num_planned = 0
    req.num_cached = 0
    core.retracted[req.request_id] = req
    core.last_pressure_step = core.step_id
    core._n["parked"] += 1


def unpark(core: SchedulerCore, req: Req, out: list[Msg]) -> None:
    """Ask the cache manager to match a parked request again (over its prompt and
    output so far); its Matched puts it back in the waiting queue."""
    out.append(
        Tokenized(req.request_id, list(req.all_ids), req.sampling, req.priority,
                  req.extra_key, req.arrival_ns, req.stream)
    )  # fmt: skip
    req.awaiting_match = True


def unpark_some(core: SchedulerCore, out: list[Msg]) -> None:
    """Bring parked requests back once the pressure has passed: when nothing runs, as
    many as may run, in the policy's order; else the oldest, once retract_decode_steps
    steps went by without a retraction or parking. Not
    while a lease is outstanding: parking cleared `cache_short` without saying whether
    the pages came free, and matches sent now would lock the tree again before the
    grant, so that waiting requests parked in turn could starve the one ahead forever."""
    cfg = core.config
    pool = core.pool
    if (not core.retracted or core.paused_by or core.draining or pool.cache_short
            or pool.outstanding is not None):  # fmt: skip
        return
    idle = not core.running
    if not idle and core.step_id - core.last_pressure_step < cfg.retract_decode_steps:
        return
    if len(core.running) >= cfg.max_running_requests:
        return
    parked = [r for r in core.retracted.values() if r.state == PARKED and not r.awaiting_match]
    if idle:  # as many as could run, in the policy's order: more would only be parked again
        ordered = core.order.order(parked, core.now_ns)[: cfg.max_running_requests]
    else:
        ordered = sorted(parked, key=lambda r: r.enqueue_seq)[:1]
    for r in ordered:
        unpark(core, r, out)


def unstall(core: SchedulerCore, out: list[Msg]) -> None:
    """No running request could take a step for lack of pages and the cache has none
    to give: free some (park locked waiting matches, else retract one request, else
    end a lone one); the lease that follows can then be granted."""
    parkable = [r for r in core.waiting.values() if r.num_cached and not r.awaiting_match]
    for r in parkable:
        park(core, r, out)
    if parkable:
        return
    running = list(core.running.values())
    if len(running) == 1:
        _abort_lone(core, running[0], out)
        return
    victim = min(running, key=victim_order(core))
    retract(core, victim, out)
    _raise_ratio(core)


def unstall_admission(core: SchedulerCore, out: list[Msg]) -> None:
    """Nothing runs and the next request cannot be admitted: the pages it needs are
    pinned by the matches of the requests queued behind it. Park those."""
    order = [r for r in core.order.order(core.waiting.values(), core.now_ns)
             if not r.awaiting_match]  # fmt: skip
    for r in order[1:]:
        if r.num_cached:
            park(core, r, out)


def _abort_lone(core: SchedulerCore, req: Req, out: list[Msg]) -> None:
    core._emit(req, [], finish=FinishReason.ABORT)
    core._n["aborted"] += 1
    core._end_running(req, "aborted", out)


def _raise_ratio(core: SchedulerCore) -> None:
    cfg = core.config
    running = list(core.running.values())
    if running:
        decoded = sum(r.num_output for r in running)
        max_new = sum(r.sampling.max_new_tokens for r in running)
        estimate = (decoded + cfg.retract_decode_steps * len(running)) / max(1, max_new)
        # Raise the reserve: at least back to its initial value (SGLang sets it to
        # this estimate; taking the max never lowers it on a retraction).
        core.new_token_ratio = min(
            1.0, max(core.new_token_ratio, estimate, cfg.init_new_token_ratio)
        )


def retract_for(
    core: SchedulerCore, decodes: list[Req], prefilling: list[Req], need: int, out: list[Msg]
) -> int:
    """Retract running requests until the decodes' page need fits the pool, keeping at
    least one; returns the remaining need. Victims: fewest output tokens first, then the
    longest prompt (SGLang's order: the least decoding work is lost)."""
    cfg = core.config
    ps = cfg.page_size
    victims = sorted(prefilling + decodes, key=victim_order(core))
    if len(victims) == 1:
        # One request alone cannot grow even after the cache was asked since our last
        # release (the rest of the pool is locked by matches): end it rather than stall.
        _abort_lone(core, victims[0], out)
        decodes.clear()
        prefilling.clear()
        return 0
    alive = len(victims)
    for v in victims:
        if need <= len(core.pool) or alive <= 1:
            break
        if v in decodes:
            decodes.remove(v)
            if v.num_planned >= len(v.pages) * ps:
                need -= 1
        else:
            prefilling.remove(v)
        retract(core, v, out)
        alive -= 1
    _raise_ratio(core)
    return need
