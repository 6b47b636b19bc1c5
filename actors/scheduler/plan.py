"""Planning one step: KV for the decodes (retracting if it cannot be had), chunked
prefill continuation, admission under the budgets, decode entries, lease upkeep.

Functions here read and change a SchedulerCore's state; they are split from core.py
only to keep each file readable. See core.py for the theory of operation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shunter.actors.scheduler import pressure
from shunter.actors.scheduler.batch import BatchBuilder, InFlight
from shunter.actors.scheduler.req import RUNNING, Req
from shunter.bus.messages import ForwardBatch, Msg, RefreshMatch, RowOpen

if TYPE_CHECKING:
    from shunter.actors.scheduler.core import SchedulerCore


def plan_step(core: SchedulerCore, out: list[Msg]) -> ForwardBatch | None:
    """The next batch, or None when there is nothing to run (or KV must come first).
    Messages besides the batch (releases, refreshes, leases) go to `out`."""
    cfg = core.config
    ps = cfg.page_size
    pool = core.pool
    if core.retract_all_pending:
        if core.in_flight:
            return None  # let the batches in flight finish first
        for req in list(core.running.values()):
            pressure.retract(core, req, out)
        core.retract_all_pending = False
    if core.waiting and not core.paused_by and not core.draining:
        victim = pressure.preemption_victim(core)
        if victim is not None:
            if core.in_flight:
                return None  # its pages are written by a batch in flight: wait for it
            pressure.retract(core, victim, out)
            core._n["preemptions"] += 1

    decodes: list[Req] = []
    prefilling: list[Req] = []
    need = 0  # a decode at position p needs a new page when p starts one
    max_context_len = cfg.max_context_len
    for r in core.running.values():
        if r.sample_planned:
            k = r.inflight_samples
            if k and (r.num_output + k >= r.sampling.max_new_tokens
                      or len(r.all_ids) + k >= max_context_len):  # fmt: skip
                continue  # the tokens in flight are its last ones
            decodes.append(r)
            if r.num_planned >= len(r.pages) * ps:
                need += 1
        else:
            prefilling.append(r)
    if need > len(pool):
        if pool.outstanding is not None:
            return None  # the grant is on its way
        if not pool.cache_short:
            out.append(pool.request(max(cfg.lease_min_pages, need - len(pool) + core.lease_want)))
            return None
        if core.in_flight:
            return None  # relieve the pressure once nothing in flight writes its pages
        if pool.awaits_backup:
            return None  # the pages come free when a backup to the host lands (PagesEvictable)
        # The cache could not grant more since our last release. First unpin the tree
        # pages that waiting requests' matches lock (no work is lost), then retract.
        parkable = [r for r in core.waiting.values() if r.num_cached and not r.awaiting_match]
        for r in parkable:
            pressure.park(core, r, out)
        if not parkable:
            need = pressure.retract_for(core, decodes, prefilling, need, out)
        if need > len(pool):
            if pool.outstanding is None:
                out.append(pool.request(max(cfg.lease_min_pages, need - len(pool))))
            return None

    builder = BatchBuilder()
    pages_left = len(pool) - need
    prefill_left = cfg.max_prefill_tokens
    chunk_left = cfg.chunk_tokens  # None: unbounded
    core.admission_deficit = 0
    for r in prefilling:  # the chunked prefill in progress continues first
        if r.num_planned == len(r.all_ids):
            continue  # a prompt scored without a sample: its last piece is in flight
        n, num_pages = _extend_size(r, chunk_left, pages_left, ps, by_pages=True)
        if n <= 0:  # no page for it now: the lease below brings them for the next step
            core.admission_deficit += _extend_size(r, chunk_left, None, ps, by_pages=False)[1]
            continue
        _add_extend(core, builder, r, n, num_pages)
        prefill_left -= n
        pages_left -= num_pages
        if chunk_left is not None:
            chunk_left -= n

    pressure.unpark_some(core, out)
    if (
        core.waiting
        and not core.paused_by
        and not core.draining
        and len(core.running) < cfg.max_running_requests
        and core.rows.num_free > 0
    ):
        _admit(core, builder, out, prefill_left, chunk_left, pages_left)

    core.num_held += builder.add_decodes(decodes, pool.pages, ps)
    if (not len(builder) and pool.cache_short and not pool.awaits_backup
            and pool.outstanding is None and not core.in_flight):  # fmt: skip
        if core.running:
            pressure.unstall(core, out)  # running requests wait for pages the cache cannot give
        elif core.admission_deficit and not core.paused_by:
            pressure.unstall_admission(core, out)

    core.lease_want = _want(core, builder)
    core.ahead_tokens = 0
    keep_lease(core, out, core.lease_want)
    if not len(builder):
        return None
    core.step_id += 1
    batch = builder.build(core.step_id, core.rows.take_closes(), core.version)
    core.in_flight.append(InFlight(core.step_id, batch, builder.entries, builder.decodes))
    return batch


def _admit(
    core: SchedulerCore,
    builder: BatchBuilder,
    out: list[Msg],
    prefill_left: int,
    chunk_left: int | None,
    pages_left: int,
) -> None:
    """Admit waiting requests in policy order until one does not fit (then stop: a
    later, smaller request must not overtake it)."""
    cfg = core.config
    ps = cfg.page_size
    ratio = core.new_token_ratio
    clip = cfg.max_reserve_tokens_per_request
    rem_total: float | None = None
    if cfg.num_total_pages:
        rem_total = float(cfg.num_total_pages * ps)
        for r in core.running.values():
            rem_total -= len(r.pages) * ps + ratio * min(r.remaining_new_tokens(), clip)
    num_slots = min(cfg.max_running_requests - len(core.running), core.rows.num_free)
    if cfg.prefill_max_requests is not None:  # the prefills continuing count too
        num_slots = min(num_slots, cfg.prefill_max_requests - len(builder))
    order = core.order.order(core.waiting.values(), core.now_ns)
    sharers: _Sharers | None = None  # made on the first candidate (a decode step has none)
    stop_at = len(order)  # first candidate left for a later step
    lookahead = True  # size the lease for the next step's admission when we stop
    for i, r in enumerate(order):
        if num_slots <= 0:
            stop_at, lookahead = i, False
            break
        if r.awaiting_match:
            continue
        if _needs_refresh(core, r):
            out.append(RefreshMatch(r.request_id))
            r.awaiting_match = True
            r.refresh_version = core.tree_version_estimate
            core._n["refreshes"] += 1
            continue
        if cfg.in_batch_prefix_sharing and sharers is None:
            sharers = _Sharers(core)
        if sharers is not None and sharers.defers(r):
            core._n["in_batch_deferred"] += 1
            continue  # its shared prefix is being computed: re-match it once cached
        first = len(builder) == 0
        extend = len(r.all_ids) - r.num_planned
        if (not first and extend > prefill_left) or prefill_left <= 0 or chunk_left == 0:
            stop_at = i  # the budget is spent; the first request of a step always goes in
            break
        cost = extend + ratio * min(r.remaining_new_tokens(), clip)
        if rem_total is not None and cost > rem_total and not (first and not core.running):
            stop_at, lookahead = i, False  # KV reserved for the running requests' growth
            break
        n, num_pages = _extend_size(r, chunk_left, None, ps, by_pages=False)
        if n <= 0:
            stop_at = i  # what is left of the chunk budget is less than a page
            break
        if num_pages > pages_left:
            if first and not core.running and core.pool.cache_short and pages_left > 0:
                # Nothing runs and the cache has no more: progress with what there is.
                n, num_pages = _extend_size(r, chunk_left, pages_left, ps, by_pages=True)
            if num_pages > pages_left or n <= 0:
                stop_at = i  # the lease below brings its pages for the next step
                break
        _open(core, builder, r)
        _add_extend(core, builder, r, n, num_pages)
        if sharers is not None:
            sharers.add(r)
        num_slots -= 1
        prefill_left -= n
        pages_left -= num_pages
        if rem_total is not None:
            rem_total -= cost
        if chunk_left is not None:
            chunk_left -= n
        if n < extend:
            stop_at, lookahead = i + 1, False  # the step's chunked prefill takes the rest
            break
    if lookahead and stop_at < len(order):
        core.admission_deficit += _next_admission_pages(core, order[stop_at:], num_slots)


class _Sharers:
    """Prompts whose prefix is being computed and is not in the tree yet: the running
    requests whose prefill has not come back, plus those admitted in this step (see
    SchedulerConfig.in_batch_prefix_sharing). Indexed by their first
    in_batch_prefix_min_tokens tokens, so most candidates cost one dict lookup."""

    def __init__(self, core: SchedulerCore) -> None:
        cfg = core.config
        self.ps = cfg.page_size
        self.key_len = max(cfg.in_batch_prefix_min_tokens, 1)
        self.by_key: dict[tuple, list[Req]] = {}
        for r in core.running.values():
            if not r.row_sampled:
                self.add(r)

    def _key(self, r: Req) -> tuple | None:
        if r.num_prompt < self.key_len:
            return None
        return (r.extra_key, *r.all_ids[: self.key_len])

    def add(self, r: Req) -> None:
        key = self._key(r)
        if key is not None:
            self.by_key.setdefault(key, []).append(r)

    def defers(self, r: Req) -> bool:
        """Whether r shares at least key_len uncached tokens, in whole pages, with one
        of the prompts being computed: both start with the same tokens up to `end`, the
        first page boundary that far past r's match (one slice compare each, in C)."""
        key = self._key(r)
        if key is None:
            return False
        end = -(-(r.num_cached + max(self.key_len, self.ps)) // self.ps) * self.ps
        if end > r.num_prompt - 1:  # r's last prompt token is always computed
            return False
        start_lp = r.sampling.logprob_start_len
        if start_lp >= 0 and end > start_lp - 1:  # scored tokens are computed anyway
            return False
        head = r.all_ids[:end]
        return any(
            o.num_prompt >= end and o.all_ids[:end] == head for o in self.by_key.get(key, ())
        )


def _next_admission_pages(core: SchedulerCore, order: list[Req], num_slots: int) -> int:
    """Pages the next step's admission would draw (its first request and what fits the
    prefill budget after it), so the lease brings them while this step runs."""
    cfg = core.config
    ps = cfg.page_size
    prefill_left = cfg.max_prefill_tokens
    chunk_left = cfg.chunk_tokens
    total = 0
    for r in order:
        if num_slots <= 0 or prefill_left <= 0 or chunk_left == 0:
            break
        if r.awaiting_match:
            continue
        extend = len(r.all_ids) - r.num_planned
        if total and extend > prefill_left:
            break
        n, num_pages = _extend_size(r, chunk_left, None, ps, by_pages=False)
        total += num_pages
        num_slots -= 1
        prefill_left -= n
        if chunk_left is not None:
            chunk_left -= n
        if n < extend:
            break
    return total


def _open(core: SchedulerCore, builder: BatchBuilder, r: Req) -> None:
    row = core.rows.alloc()
    r.row = row
    r.row_sampled = False
    r.sample_planned = False
    r.state = RUNNING
    del core.waiting[r.request_id]
    core.running[r.request_id] = r
    builder.opens.append(
        RowOpen(row, r.request_id, list(r.pages), r.num_cached, r.sampling, r.seed,
                r.all_ids[: r.num_cached], r.num_output)
    )  # fmt: skip
    if r.num_retractions == 0:
        r.num_cached_reported = r.num_cached
        core._n["prompt_tokens"] += r.num_prompt
        core._n["cached_tokens"] += r.num_cached


def _extend_size(
    r: Req, chunk_left: int | None, pages_left: int | None, ps: int, *, by_pages: bool
) -> tuple[int, int]:
    """(tokens, new pages) of r's next prefill piece. A piece shorter than the rest of
    the prompt ends on a page boundary (so ChunkCached hands over whole pages)."""
    start = r.num_planned
    remaining = len(r.all_ids) - start
    n = remaining if chunk_left is None else min(remaining, chunk_left)
    if by_pages and pages_left is not None:
        n = min(n, (len(r.pages) + pages_left) * ps - start)
    if n < remaining:
        n = (start + n) // ps * ps - start
    if n <= 0:
        return 0, 0
    return n, max(0, -(-(start + n) // ps) - len(r.pages))


def _add_extend(core: SchedulerCore, builder: BatchBuilder, r: Req, n: int, num_pages: int):
    pages = core.pool.take(num_pages)
    r.pages.extend(pages)
    core.num_held += num_pages
    last = r.num_planned + n == len(r.all_ids)
    builder.add_extend(r, n, pages, sample=last and r.sampling.max_new_tokens > 0)


MAX_INSERTS_SCANNED = 64


def _needs_refresh(core: SchedulerCore, r: Req) -> bool:
    """Whether the tree may have grown along r's prompt since r was matched: one of our
    own inserts since then starts with r's matched prefix plus at least one more page."""
    if r.tree_version < 0:
        return True  # the tree was dropped under its match: its prefix pages are gone
    if not core.config.refresh_stale_matches:
        return False
    est = core.tree_version_estimate
    if r.tree_version >= est or r.refresh_version >= est:
        return False
    start = r.num_cached
    probe = start + core.config.page_size
    if probe > len(r.all_ids) - 1:
        return False  # no longer match is possible (one token must stay to compute)
    next_page = r.all_ids[start:probe]
    seen = max(r.tree_version, r.refresh_version)  # inserts up to here were checked
    log = core.insert_log
    for i, (version, extra_key, token_ids) in enumerate(reversed(log)):
        if version <= seen:
            r.refresh_version = est  # nothing relevant: do not scan these again
            return False
        if i == MAX_INSERTS_SCANNED:
            return True  # too many to check cheaply: re-matching costs one round trip
        if (
            extra_key == r.extra_key
            and token_ids[start:probe] == next_page  # cheap reject first
            and token_ids[:start] == r.all_ids[:start]
        ):
            return True
    return len(log) == log.maxlen  # history older than the log: assume it may have grown


def _want(core: SchedulerCore, builder: BatchBuilder) -> int:
    """Pages the pool should hold: the running batch's next few decode steps, the next
    piece of a chunked prefill in this batch, plus what the last admission lacked."""
    cfg = core.config
    ps = cfg.page_size
    steps = len(core.running) * cfg.lease_lookahead_steps
    want = -(-steps // ps) + core.admission_deficit
    chunk = cfg.chunk_tokens
    for r, _, sample in builder.entries:
        if not sample:  # a chunk: lease its successor's pages while this one runs
            start = r.num_planned  # already advanced past this chunk
            end = len(r.all_ids) if chunk is None else min(len(r.all_ids), start + chunk)
            want += max(0, -(-end // ps) - len(r.pages))
    return want


def lease_ahead(core: SchedulerCore, req: Req, out: list[Msg]) -> None:
    """While a batch is in flight a request arrived: if it will be in the next step's
    admission (no more waiting than free rows, the prefill budget not yet spoken for),
    lease its pages now so they are in the pool when that step is planned. O(1) per
    arrival, so a burst of arrivals costs no sorting."""
    cfg = core.config
    num_slots = min(cfg.max_running_requests - len(core.running), core.rows.num_free)
    if cfg.prefill_max_requests is not None:
        num_slots = min(num_slots, cfg.prefill_max_requests)
    if len(core.waiting) > num_slots or core.paused_by or core.draining:
        return
    if core.ahead_tokens >= cfg.max_prefill_tokens:
        return
    n, num_pages = _extend_size(req, cfg.chunk_tokens, None, cfg.page_size, by_pages=False)
    core.ahead_tokens += n
    core.lease_want += num_pages
    keep_lease(core, out, core.lease_want)


def keep_lease(core: SchedulerCore, out: list[Msg], want: int) -> None:
    """Ask for pages when the pool is below `want`, give back a surplus above it."""
    cfg = core.config
    pool = core.pool
    if pool.outstanding is not None:
        return
    if len(pool) < want and not pool.cache_short:
        out.append(pool.request(max(cfg.lease_min_pages, want - len(pool))))
    elif len(pool) > want + cfg.lease_max_surplus_pages:
        out.append(pool.give_back(len(pool) - want - cfg.lease_max_surplus_pages // 2))
