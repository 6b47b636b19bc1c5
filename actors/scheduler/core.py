"""Scheduler core: admission, continuous batching, chunked prefill, retraction, stops.

Theory of operation
    Requests arrive as Matched (from the cache manager: the prompt plus its locked cached
    prefix) and wait in a queue ordered by the policy (policy.py). One batch is in flight
    at a time: when its StepResult arrives the core appends the sampled tokens, applies
    stop conditions, and plans the next ForwardBatch at once, so the executor is never
    idle while there is work. A step is mixed: the (at most one) request whose prefill is
    being chunked continues, new requests are admitted under the budgets, and every
    decoding request computes one token; the executor runs them as one forward.

    Admission (plan.py) walks the waiting queue in policy order and stops at the first
    request that does not fit: max_running_requests; max_prefill_tokens, the new tokens
    of the step (the first request always goes in, however long); the chunk budget
    (chunked_prefill_size: a longer prompt gets a page-aligned piece now, sample=False,
    and continues next step; each finished piece goes to the cache as ChunkCached so
    followers can share it); and KV: the pool's pages for this step's tokens, plus, when
    the pool size is known, a reserve of new_token_ratio * remaining max_new_tokens for
    every running request (SGLang's rem_total_tokens). A request matched before the tree
    last grew gets a RefreshMatch and is skipped this step (never blocks the step).

    KV pages come from a local pool leased from the cache manager (pool.py), topped up
    ahead of need (the running batch's next steps, the next chunk, the next admission;
    a request arriving mid-step has its pages asked for at once) and trimmed when idle,
    so a decode step has no round trip. When the decoding requests need more pages than
    the pool has and the cache cannot grant more:
      1. waiting requests are parked: their matches are released (a match locks tree
         pages; a deep queue of locked prefixes can pin the whole pool) and they are
         sent to the cache manager again (Tokenized) once the pressure has passed;
      2. if none could be parked, running requests are retracted (fewest output tokens
         first, then longest prompt: the least work lost), released with reason
         "retracted" so their computed prefix stays in the tree, and re-queued with
         their output when the cache manager re-matches them (the resumed row re-prefills
         what the match does not cover and continues exactly where it stopped);
      3. a lone request that still cannot grow is ended ("abort") rather than stalled.
    After a retraction or parking the new_token_ratio is raised to at least its initial
    value, then decays back a little every step.

    Overlap (max_batches_in_flight = 2, SGLang's default): decode entries feed
    LAST_SAMPLED, so a step's plan never reads the previous result's tokens, and step
    N+1 is planned as soon as step N is sent; the executor finds N+1 queued when N ends.
    Each request tracks `num_planned` (positions computed or in flight) beside
    `num_computed` (results seen). A request whose last allowed token is in flight gets
    no further entry; one found finished (or aborted) in result N has its final output
    sent at once, its entry in N+1 wasted (token dropped), and is released when N+1's
    result is in (`ending`). Retraction and parking wait until nothing is in flight.
    With max_batches_in_flight = 1 a step is planned when the previous result is in.

Invariants
    - A request is in exactly one of: waiting, running (holds a row), retracted or
      parked (`retracted` dict: holds no match here); finished requests are forgotten.
    - Every Matched received is ended by exactly one SequenceReleased or replaced by a
      newer Matched (cache.py's protocol); a request awaiting a Matched is never released
      until that Matched arrives.
    - A request's pages are released only when no in-flight batch writes them
      (num_inflight == 0); until then an ended request waits in `ending`.
    - Census (sent at every step boundary): len(pool) == num_leased_unused and
      num_held_by_requests == sum of running requests' own (not handed over) pages.
    - No output follows a request's final RequestOutput.
"""

from __future__ import annotations

import zlib
from collections import deque

from shunter.actors.scheduler import plan
from shunter.actors.scheduler.batch import InFlight
from shunter.actors.scheduler.config import SchedulerConfig
from shunter.actors.scheduler.policy import SplitMix64, WaitingOrder
from shunter.actors.scheduler.pool import LeasePool
from shunter.actors.scheduler.req import PARKED, RETRACTED, RUNNING, WAITING, Req, refusal
from shunter.actors.scheduler.results import apply_result
from shunter.actors.scheduler.rows import RowAllocator
from shunter.actors.scheduler.stats import SchedulerStatistics, on_tick, statistics
from shunter.bus.messages import (
    AbortRequest,
    AdmissionPaused,
    ChunkCached,
    FinishReason,
    FlipBegin,
    FlipCutover,
    FlipDone,
    FlipQuiesced,
    LeaseGranted,
    Matched,
    Msg,
    PagesEvictable,
    RequestFailed,
    RequestOutput,
    SchedulerCensus,
    SchedulerConfigured,
    SequenceReleased,
    Shutdown,
    StepResult,
    Tick,
    TokensOut,
    TreeDropped,
)

Inbox = (
    Matched | LeaseGranted | StepResult | AbortRequest | Tick | FlipBegin | FlipCutover
    | FlipDone | Shutdown | TreeDropped | SchedulerConfigured | PagesEvictable
)  # fmt: skip
INBOX_TYPES: tuple[type[Msg], ...] = Inbox.__args__  # type: ignore[attr-defined]


class SchedulerCore:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.waiting: dict[str, Req] = {}  # arrival order
        self.running: dict[str, Req] = {}  # admission order
        self.retracted: dict[str, Req] = {}  # retracted or parked: no match held here
        self.last_pressure_step = -(10**9)  # step of the last retraction or parking
        self.pool = LeasePool()
        self.rows = RowAllocator(config.max_running_requests)
        self.order = WaitingOrder(
            config.schedule_policy,
            aging_per_s=config.priority_aging_per_s,
            lpm_max_queue=config.lpm_max_queue,
            seed=config.seed,
        )
        self.in_flight: deque[InFlight] = deque()  # sent batches, oldest first
        self.ending: dict[str, Req] = {}  # ended, waiting for their batches in flight
        self.step_id = 0
        self.now_ns = 0
        self.version = 0
        self.new_token_ratio = config.init_new_token_ratio
        self.num_held = 0  # pages drawn from the pool into rows, not handed over
        self.paused_by: set[str] = set()  # flip ids (or "shutdown") holding admission
        self.quiesce_pending: set[str] = set()  # flips to tell once nothing runs
        self.retract_all_pending = False
        self.draining = False
        self.tombstones: deque[str] = deque(maxlen=config.max_tombstones)
        self.tombstone_set: set[str] = set()
        # Tree version estimate: the newest Matched.tree_version seen plus our own
        # inserts (ChunkCached, SequenceReleased) sent since; recent inserts are kept
        # so a stale match is refreshed only if an insert could extend it.
        self.version_seen = 0
        self.inserts_since_seen = 0
        self.insert_log: deque[tuple[int, str, list[int]]] = deque(maxlen=256)
        self.enqueue_seq = 0
        self.admission_deficit = 0  # pages the next step's prefills want from the pool
        self.lease_want = 0  # pages the pool should hold (set when a step is planned)
        self.ahead_tokens = 0  # prefill tokens of arrivals leased ahead since then
        self._outputs: list[RequestOutput] = []
        self._boundary = False
        self._last_stats_ns = 0
        self._gen_since_stats = 0
        self._n = dict.fromkeys(
            ("retractions", "parked", "refreshes", "chunks", "finished", "aborted", "failed",
             "prefill_tokens", "generated", "unexpected", "prompt_tokens", "cached_tokens",
             "in_batch_deferred", "preemptions"),
            0,
        )  # fmt: skip

    # ---- the loop ------------------------------------------------------------------

    def handle(self, msg: Inbox) -> list[Msg]:
        out: list[Msg] = []
        match msg:
            case StepResult():
                apply_result(self, msg, out)
            case Matched():
                self._on_matched(msg, out)
            case LeaseGranted():
                if not self.pool.granted(msg):
                    self._n["unexpected"] += 1
            case PagesEvictable():  # a backup landed: pages a short grant lacked are free
                self.pool.pages_released()
            case AbortRequest():
                self._on_abort(msg, out)
            case Tick():
                on_tick(self, msg, out)
            case FlipBegin():
                self.paused_by.add(msg.flip_id)
                self.quiesce_pending.add(msg.flip_id)
                self.retract_all_pending = self.retract_all_pending or msg.retract
                out.append(AdmissionPaused(msg.flip_id, len(self.running), len(self.waiting)))
            case FlipCutover():
                self.version = msg.version
            case FlipDone():
                self.paused_by.discard(msg.flip_id)
                self.quiesce_pending.discard(msg.flip_id)
                self.version = msg.version
            case Shutdown():
                self.draining = True
            case TreeDropped():
                if msg.ok:  # every waiting match lost its pages: re-match before admission
                    self._see_version(msg.tree_version)
                    for r in self.waiting.values():
                        if r.num_cached:
                            r.tree_version = -1
            case SchedulerConfigured():
                pass  # the shell's record of our config; the core was built from it
            case _:
                raise TypeError(f"scheduler core cannot handle {type(msg).__name__}")
        num_planned = 0
        while len(self.in_flight) < self.config.max_batches_in_flight:
            batch = plan.plan_step(self, out)
            if batch is None:
                break
            out.insert(num_planned, batch)
            num_planned += 1
            self._boundary = True
        if not num_planned:  # (planning leases what the pool needs itself)
            if isinstance(msg, Matched) and msg.request.request_id in self.waiting:
                plan.lease_ahead(self, self.waiting[msg.request.request_id], out)
            elif isinstance(msg, LeaseGranted):  # a short grant may leave the pool short
                plan.keep_lease(self, out, self.lease_want)
        if self._outputs:
            out.append(TokensOut(step_id=self.step_id, outputs=self._outputs))
            self._outputs = []
        if self._boundary:
            out.append(self.census())
            self._boundary = False
        if self.quiesce_pending and not (self.running or self.in_flight or self.ending):
            for flip_id in sorted(self.quiesce_pending):
                out.append(FlipQuiesced(flip_id, len(self.waiting)))
            self.quiesce_pending.clear()
        return out

    def census(self) -> SchedulerCensus:
        return SchedulerCensus(
            step_id=self.step_id,
            last_lease_seq=self.pool.last_received_seq,
            num_leased_unused=len(self.pool),
            num_held_by_requests=self.num_held,
        )

    # ---- arrivals and matches ------------------------------------------------------

    def _on_matched(self, m: Matched, out: list[Msg]) -> None:
        rid = m.request.request_id
        self._see_version(m.tree_version)
        req = self.waiting.get(rid) or self.retracted.get(rid)
        if req is not None:
            req.apply_match(m, self.config.page_size)
            req.awaiting_match = False
            if req.state in (RETRACTED, PARKED):
                del self.retracted[rid]
                req.state = WAITING
                self.waiting[rid] = req
            if req.abort_reason is not None:  # aborted while its Matched was on the way
                self._drop_waiting(req, out, emit=False)
            return
        if rid in self.running:
            self._n["unexpected"] += 1  # a running request's match never changes
            return
        req = Req(
            m,
            page_size=self.config.page_size,
            enqueue_seq=self.enqueue_seq,
            enqueued_ns=self.now_ns,
            seed=self._seed_for(m),
            eos_token_ids=self.config.eos_token_ids,
        )
        self.enqueue_seq += 1
        self.waiting[rid] = req
        if rid in self.tombstone_set:  # its abort overtook this Matched
            self.tombstone_set.discard(rid)
            req.abort_reason = "client"
            self._drop_waiting(req, out)
        elif self.draining:
            req.abort_reason = "shutdown"
            self._drop_waiting(req, out)
        elif (problem := refusal(req, self.config, len(self.waiting) - 1)) is not None:
            code, text, status = problem
            out.append(RequestFailed(rid, code, text, status))
            req.abort_reason = code
            self._n["failed"] += 1
            self._drop_waiting(req, out, emit=False)
        elif req.sampling.max_new_tokens <= 0 and req.sampling.logprob_start_len < 0:
            # nothing to generate or score; one asking for prompt logprobs runs its
            # prefill without a sample and ends after it (results.py)
            self._emit(req, [], finish=FinishReason.LENGTH)
            self._release(req, "finished", out)
            del self.waiting[rid]
            self._n["finished"] += 1

    def _seed_for(self, m: Matched) -> int:
        if m.request.sampling.seed is not None:
            return m.request.sampling.seed
        rng = SplitMix64(self.config.seed ^ zlib.crc32(m.request.request_id.encode()))
        return rng.next() >> 1

    def _see_version(self, tree_version: int) -> None:
        if tree_version > self.version_seen:
            self.version_seen = tree_version
            self.inserts_since_seen = 0

    @property
    def tree_version_estimate(self) -> int:
        return self.version_seen + self.inserts_since_seen

    def _note_insert(self, req: Req, token_ids: list[int]) -> None:
        self.inserts_since_seen += 1
        self.insert_log.append((self.tree_version_estimate, req.extra_key, token_ids))

    # ---- aborts --------------------------------------------------------------------

    def _on_abort(self, msg: AbortRequest, out: list[Msg]) -> None:
        rid = msg.request_id
        req = self.waiting.get(rid) or self.running.get(rid) or self.retracted.get(rid)
        if req is None:
            if rid not in self.tombstone_set:  # finished, unknown, or not matched yet
                if len(self.tombstones) == self.tombstones.maxlen:
                    self.tombstone_set.discard(self.tombstones[0])
                self.tombstones.append(rid)
                self.tombstone_set.add(rid)
            return
        if req.abort_reason is not None:
            return  # already ending
        req.abort_reason = msg.reason
        stop = msg.reason == "stop_string"
        self._emit(req, [], finish=FinishReason.STOP if stop else FinishReason.ABORT)
        self._n["finished" if stop else "aborted"] += 1
        if req.state == PARKED and not req.awaiting_match:
            del self.retracted[rid]  # holds no match: nothing to release
        elif req.state == RUNNING:
            self.finish_running(req, "finished" if stop else "aborted", out)
        elif not req.awaiting_match:  # waiting; otherwise ended when its Matched comes
            self._drop_waiting(req, out, emit=False)

    def _drop_waiting(self, req: Req, out: list[Msg], emit: bool = True) -> None:
        """End a waiting request: unlock its match (reason aborted, its prefix only)."""
        del self.waiting[req.request_id]
        if emit:
            self._emit(req, [], finish=FinishReason.ABORT)
            self._n["aborted"] += 1
        self._release(req, "aborted", out)

    # ---- results -------------------------------------------------------------------

    def _cache_chunk(self, req: Req, out: list[Msg]) -> None:
        """A non-final prefill chunk is computed: hand its page-aligned part to the tree."""
        ps = self.config.page_size
        num_aligned_pages = req.num_computed // ps
        if num_aligned_pages <= req.num_tree_pages:
            return
        token_ids = req.all_ids[: req.num_computed]
        out.append(ChunkCached(req.request_id, token_ids, list(req.pages)))
        self.num_held -= num_aligned_pages - req.num_tree_pages
        req.num_tree_pages = num_aligned_pages
        self._note_insert(req, token_ids)
        self._n["chunks"] += 1

    def _emit(
        self,
        req: Req,
        token_ids: list[int],
        logprobs: list[float] | None = None,
        top_logprobs: list | None = None,
        prompt_logprobs: list[float] | None = None,
        *,
        prompt_top: list | None = None,
        finish: str | None = None,
        matched: int | None = None,
    ) -> None:
        self._outputs.append(
            RequestOutput(
                request_id=req.request_id,
                token_ids=token_ids,
                logprobs=logprobs or [],
                top_logprobs=top_logprobs or [],
                prompt_logprobs=prompt_logprobs or [],
                finish_reason=finish,
                matched_stop=matched,
                num_prompt_tokens=req.num_prompt,
                num_cached_tokens=req.num_cached_reported,
                prompt_top_logprobs=prompt_top or [],
            )
        )

    # ---- leaving the running batch -------------------------------------------------

    def finish_running(self, req: Req, reason: str, out: list[Msg]) -> None:
        """End a running request (its final output is out): released at once when no
        batch in flight writes its pages, else when the last of them comes back."""
        if req.end_reason is not None:
            return
        if req.num_inflight == 0:
            self._end_running(req, reason, out)
        else:
            del self.running[req.request_id]
            req.end_reason = reason
            self.ending[req.request_id] = req

    def _end_running(self, req: Req, reason: str, out: list[Msg]) -> None:
        """Finish or abort a running request that no in-flight batch writes."""
        if self.running.pop(req.request_id, None) is None:
            del self.ending[req.request_id]
        self.rows.release(req.row)
        req.row = -1
        self._release(req, reason, out)

    def _release(self, req: Req, reason: str, out: list[Msg]) -> None:
        token_ids = req.all_ids[: req.num_computed]
        out.append(SequenceReleased(req.request_id, token_ids, req.pages, reason))
        self.num_held -= req.num_held_pages
        if req.num_computed > req.num_cached:
            self._note_insert(req, token_ids)
        self.pool.pages_released()
        req.pages = []
        req.num_tree_pages = 0

    def statistics(self) -> SchedulerStatistics:
        return statistics(self)
