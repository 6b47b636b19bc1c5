"""Scheduler core on its own: messages in, messages out, no event loop.

The cache manager's side is played by hand here (Matched, LeaseGranted built in the
test), which is what the core's contract is written against; test_cluster.py runs it
with the real cache manager core.
"""

from __future__ import annotations

import math

import pytest

from shunter.actors.scheduler.config import SchedulerConfig
from shunter.actors.scheduler.core import SchedulerCore
from shunter.bus.messages import (
    LAST_SAMPLED,
    AbortRequest,
    AdmissionPaused,
    ChunkCached,
    FlipBegin,
    FlipDone,
    ForwardBatch,
    LeaseGranted,
    LeaseRequest,
    Matched,
    RefreshMatch,
    RequestFailed,
    SamplingParams,
    SchedulerCensus,
    SchedulerStats,
    SequenceReleased,
    Shutdown,
    StepResult,
    Tick,
    Tokenized,
    TokensOut,
    TopLogprob,
    TreeDropped,
)


def matched(rid, ids, *, cached=0, pages=(), version=0, max_new=4, priority=0, **sp):
    sampling = SamplingParams(max_new_tokens=max_new, **sp)
    t = Tokenized(rid, list(ids), sampling, priority=priority)
    return Matched(t, cached, list(pages), version)


class Feeder:
    """Drives a SchedulerCore by hand: grants every lease from a page counter (unless
    told to grant fewer) and answers batches with chosen tokens."""

    def __init__(self, **cfg):
        cfg.setdefault("lease_min_pages", 1)
        self.core = SchedulerCore(SchedulerConfig(**cfg))
        self.next_page = 1000
        self.grant_queue: list[int] = []  # sizes of the next grants; then in full
        self.log: list = []

    def send(self, msg):
        out = self.core.handle(msg)
        self.log.extend(out)
        for m in list(out):
            if isinstance(m, LeaseRequest):
                n = min(m.num_pages, self.grant_queue.pop(0)) if self.grant_queue else m.num_pages
                pages = list(range(self.next_page, self.next_page + n))
                self.next_page += n
                out += self.send(LeaseGranted(m.lease_seq, pages))
        return out

    @staticmethod
    def batch(out) -> ForwardBatch | None:
        bs = [m for m in out if isinstance(m, ForwardBatch)]
        assert len(bs) <= 1
        return bs[0] if bs else None

    def step(self, batch: ForwardBatch, token=7, tokens=None):
        rows = [r for r, s in zip(batch.rows, batch.sample) if s]
        toks = tokens if tokens is not None else [token] * len(rows)
        return self.send(StepResult(batch.step_id, rows, toks))


def outputs(out):
    return [o for m in out if isinstance(m, TokensOut) for o in m.outputs]


def of(out, cls):
    return [m for m in out if isinstance(m, cls)]


def _last_batch(f):
    return [m for m in f.log if isinstance(m, ForwardBatch)][-1]


def admitted(batch: ForwardBatch) -> list[str]:
    return [o.request_id for o in batch.opens]


# ---- prefill budget ---------------------------------------------------------------

PROMPTS = [40, 30, 20, 50]


def _greedy_groups(prompts, budget):
    groups, cur, total = [], [], 0
    for i, n in enumerate(prompts):
        if cur and total + n > budget:
            groups.append(cur)
            cur, total = [], 0
        cur.append(f"r{i}")
        total += n
    return [*groups, cur]


@pytest.mark.parametrize("budget", [10, 40, 69, 70, 90, 139, 140, 1000])
def test_max_prefill_tokens_bounds_the_admitted_set(budget):
    f = Feeder(max_prefill_tokens=budget, chunked_prefill_size=-1)
    reqs = [matched(f"r{i}", range(100, 100 + n), max_new=50) for i, n in enumerate(PROMPTS)]
    b = _queue_then_release(f, reqs)
    groups = []
    while b is not None and b.opens:
        groups.append(admitted(b))
        new_tokens = [n for n, s in zip(b.num_new_tokens, b.start_pos) if s == 0]
        assert len(new_tokens) == len(b.opens)
        assert sum(new_tokens) <= budget or len(b.opens) == 1  # the first always goes in
        b = f.batch(f.step(b))
    assert groups == _greedy_groups(PROMPTS, budget)


def test_all_waiting_at_once_are_admitted_up_to_the_budget():
    f = Feeder(max_prefill_tokens=75, chunked_prefill_size=-1)
    f.send(FlipBegin("hold", "update_weights"))  # pause admission while they queue
    for i, n in enumerate(PROMPTS):
        f.send(matched(f"r{i}", range(100, 100 + n)))
    b = f.batch(f.send(FlipDone("hold", 0, True)))
    assert admitted(b) == ["r0", "r1"]  # 40 + 30 <= 75; adding 20 would exceed
    assert sum(b.num_new_tokens) == 70


def test_first_request_is_admitted_even_when_longer_than_the_budget():
    f = Feeder(max_prefill_tokens=16, chunked_prefill_size=-1)
    b = f.batch(f.send(matched("long", range(100))))
    assert admitted(b) == ["long"] and b.num_new_tokens == [100] and b.sample == [True]


# ---- chunked prefill --------------------------------------------------------------


def test_chunked_prefill_splits_on_page_boundaries_and_caches_each_chunk():
    f = Feeder(chunked_prefill_size=16, page_size=4, max_prefill_tokens=1000)
    ids = list(range(500, 550))  # 50 tokens
    b = f.batch(f.send(matched("c", ids)))
    starts, sizes, samples, chunks = [], [], [], []
    while b is not None and b.sample[0] is False:
        starts.append(b.start_pos[0])
        sizes.append(b.num_new_tokens[0])
        samples.append(b.sample[0])
        out = f.step(b)
        chunks += of(out, ChunkCached)
        b = f.batch(out)
    assert starts == [0, 16, 32] and sizes == [16, 16, 16]
    assert b.start_pos == [48] and b.num_new_tokens == [2] and b.sample == [True]
    assert b.input_ids == ids[48:]
    assert [len(c.token_ids) for c in chunks] == [16, 32, 48]
    assert chunks[-1].token_ids == ids[:48] and len(chunks[-1].pages) == 12
    # after the last chunk the request decodes with LAST_SAMPLED
    b = f.batch(f.step(b, token=9))
    assert b.input_ids == [LAST_SAMPLED] and b.start_pos == [50]
    # census: chunk-cached pages left the scheduler's held count
    census = of(f.log, SchedulerCensus)[-1]
    assert census.num_held_by_requests == 13 - 12  # page of positions 48..51 only


def test_chunk_budget_is_shared_and_a_second_request_waits_for_the_chunked_one():
    f = Feeder(chunked_prefill_size=32, max_prefill_tokens=1000)
    f.send(FlipBegin("hold", "x"))
    f.send(matched("a", range(20)))
    f.send(matched("b", range(100, 150)))
    b = f.batch(f.send(FlipDone("hold", 0, True)))
    assert admitted(b) == ["a", "b"] and b.num_new_tokens == [20, 12] and b.sample == [True, False]


# ---- policies ---------------------------------------------------------------------


def _queue_then_release(f, msgs):
    f.send(FlipBegin("hold", "x"))
    for m in msgs:
        f.send(m)
    return f.batch(f.send(FlipDone("hold", 0, True)))


def test_lpm_prefers_the_longer_cached_prefix():
    reqs = [matched("short", range(40)), matched("long", range(40), cached=32, pages=range(32))]
    f = Feeder(schedule_policy="lpm", max_running_requests=1)
    assert admitted(_queue_then_release(f, reqs)) == ["long"]
    f = Feeder(schedule_policy="fcfs", max_running_requests=1)
    assert admitted(_queue_then_release(f, reqs)) == ["short"]
    # beyond the queue bound lpm is plain fcfs
    f = Feeder(schedule_policy="lpm", max_running_requests=1, lpm_max_queue=1)
    assert admitted(_queue_then_release(f, reqs)) == ["short"]


def test_lof_prefers_the_longest_output():
    reqs = [matched("few", range(10), max_new=4), matched("many", range(10), max_new=64)]
    f = Feeder(schedule_policy="lof", max_running_requests=1)
    assert admitted(_queue_then_release(f, reqs)) == ["many"]


def test_random_policy_is_seeded():
    def first(seed):
        f = Feeder(schedule_policy="random", max_running_requests=1, seed=seed)
        return admitted(_queue_then_release(f, [matched(f"r{i}", range(5)) for i in range(8)]))

    assert first(1) == first(1)
    assert len({first(s)[0] for s in range(12)}) > 1


def _priority_run(aging_per_s, seconds=40):
    """One request is served per second (max_new 1, one running at a time); two
    priority-10 requests arrive every second; a priority-0 one arrives at t=1.
    Returns the admission order and each request's arrival second."""
    f = Feeder(schedule_policy="priority", max_running_requests=1, priority_aging_per_s=aging_per_s)
    arrived = {}
    for t in range(seconds):
        f.send(Tick(t * 1_000_000_000 + 1))
        for k in range(2):  # two arrive per second, one is served: the queue grows
            rid = f"high{t}.{k}"
            f.send(
                matched(rid, range(10 * (2 * t + k), 10 * (2 * t + k) + 6), max_new=1, priority=10)
            )
            arrived[rid] = t
        if t == 1:
            f.send(matched("low", range(1000, 1006), max_new=1, priority=0))
            arrived["low"] = t
        if f.core.in_flight:
            f.step(_last_batch(f))
    order = [o.request_id for m in f.log if isinstance(m, ForwardBatch) for o in m.opens]
    return order, arrived


def test_priority_with_aging_serves_a_low_priority_request_within_its_bound():
    aging = 1.0
    order, arrived = _priority_run(aging)
    assert "low" in order
    bound_s = (10 - 0) / aging  # never overtaken by a request arriving > bound after it
    before = order[: order.index("low")]
    assert not [r for r in before if arrived[r] > arrived["low"] + bound_s]
    # and high-priority requests that came later did go first while it was young
    assert [r for r in before if arrived[r] > arrived["low"]]


def test_priority_without_aging_starves_the_low_priority_request():
    order, _ = _priority_run(0.0)
    assert "low" not in order  # the bound above is what aging buys


# ---- stop conditions --------------------------------------------------------------


def _run_one(tokens, max_context_len=8192, **kw):
    f = Feeder(eos_token_ids=(2,), max_context_len=max_context_len)
    b = f.batch(f.send(matched("s", range(10, 14), **kw)))
    outs = []
    for t in tokens:
        out = f.step(b, token=t)
        outs += outputs(out)
        b = f.batch(out)
        if b is None:
            break
    return outs, f


def test_eos_stops_with_matched_stop():
    outs, f = _run_one([5, 6, 2, 9], max_new=10)
    assert [o.token_ids for o in outs] == [[5], [6], [2]]
    assert outs[-1].finish_reason == "stop" and outs[-1].matched_stop == 2
    rel = of(f.log, SequenceReleased)[-1]
    assert rel.reason == "finished" and rel.token_ids == [10, 11, 12, 13, 5, 6]


def test_min_new_tokens_defers_stop_tokens():
    outs, _ = _run_one([2, 2, 2, 2], max_new=10, min_new_tokens=3)
    assert len(outs) == 3 and outs[-1].finish_reason == "stop"


def test_ignore_eos_keeps_other_stop_ids():
    outs, _ = _run_one([2, 2, 77, 5], max_new=10, ignore_eos=True, stop_token_ids=[2, 77])
    assert [o.token_ids[0] for o in outs] == [2, 2, 77] and outs[-1].matched_stop == 77


def test_max_new_tokens_and_context_length_end_with_length():
    outs, _ = _run_one([5] * 10, max_new=3)
    assert len(outs) == 3 and outs[-1].finish_reason == "length" and outs[-1].matched_stop is None
    outs, _ = _run_one([5] * 10, max_new=100, max_context_len=7)
    assert len(outs) == 3 and outs[-1].finish_reason == "length"  # 4 prompt + 3 = 7


def test_prompt_at_the_context_length_is_refused_and_its_match_released():
    f = Feeder(max_context_len=8)
    out = f.send(matched("big", range(8)))
    (fail,) = of(out, RequestFailed)
    assert fail.code == "context_length_exceeded"
    (rel,) = of(out, SequenceReleased)
    assert rel.reason == "aborted" and f.batch(out) is None


# ---- aborts -------------------------------------------------------------------------


def test_abort_is_idempotent_and_abort_after_finish_is_a_no_op():
    f = Feeder(max_running_requests=1)
    b = f.batch(f.send(matched("run", range(5), max_new=2)))
    f.send(matched("wait", range(5), cached=4, pages=[1, 2, 3, 4]))
    # waiting: released at once (its match unlocked), final "abort"
    out = f.send(AbortRequest("wait"))
    (rel,) = of(out, SequenceReleased)
    assert rel.reason == "aborted" and rel.pages == [1, 2, 3, 4] and rel.token_ids == [0, 1, 2, 3]
    assert [o.finish_reason for o in outputs(out)] == ["abort"]
    assert f.send(AbortRequest("wait")) == []
    # running and in flight: final output now, release after the step's result
    out = f.send(AbortRequest("run"))
    assert [o.finish_reason for o in outputs(out)] == ["abort"] and not of(out, SequenceReleased)
    assert f.send(AbortRequest("run")) == []
    out = f.step(b, token=5)
    assert not outputs(out)  # nothing after the final output
    (rel,) = of(out, SequenceReleased)
    assert rel.reason == "aborted" and rel.token_ids == [0, 1, 2, 3, 4]
    # a finished request: no-op
    f2 = Feeder()
    b = f2.batch(f2.send(matched("done", range(3), max_new=1)))
    assert outputs(f2.step(b))[0].finish_reason == "length"
    assert f2.send(AbortRequest("done")) == []
    assert f2.core.statistics().num_aborted == 0


def test_abort_that_overtakes_its_match_ends_it_on_arrival():
    f = Feeder()
    assert f.send(AbortRequest("early")) == []
    out = f.send(matched("early", range(5)))
    (rel,) = of(out, SequenceReleased)
    assert rel.reason == "aborted" and f.batch(out) is None and not f.core.waiting


def test_stop_string_abort_finishes_with_stop_and_caches():
    f = Feeder()
    b = f.batch(f.send(matched("s", range(5), max_new=10)))
    b = f.batch(f.step(b, token=5))
    out = f.send(AbortRequest("s", reason="stop_string", matched_stop="\n"))
    assert outputs(out)[0].finish_reason == "stop"
    (rel,) = of(f.step(b, token=6), SequenceReleased)
    assert rel.reason == "finished" and rel.token_ids == [0, 1, 2, 3, 4, 5]


def test_failed_step_fails_its_requests():
    f = Feeder()
    b = f.batch(f.send(matched("x", range(5))))
    out = f.send(StepResult(b.step_id, [], [], error="CUDA error"))
    assert outputs(out)[0].finish_reason == "error"
    assert of(out, RequestFailed)[0].http_status == 500
    assert of(out, SequenceReleased)[0].reason == "aborted"


# ---- retraction, rows, census ------------------------------------------------------


def test_retraction_under_kv_pressure_frees_and_requeues():
    f = Feeder(page_size=1, lease_lookahead_steps=1, lease_max_surplus_pages=0)
    f.send(FlipBegin("hold", "x"))
    f.send(matched("old", range(8), max_new=50))
    f.send(matched("new", range(10, 26), max_new=50))
    b = f.batch(f.send(FlipDone("hold", 0, True)))
    b = f.batch(f.step(b))  # both decode now
    f.grant_queue = [0]  # the next lease finds the cache exhausted
    b = f.batch(f.step(b))
    assert len(b.rows) == 2 and len(f.core.pool) == 0 and f.core.pool.cache_short
    ratio = f.core.new_token_ratio
    out = f.step(b)
    rel = of(out, SequenceReleased)
    # both have 3 outputs; the longer prompt ("new") goes first; "old" keeps running
    assert [r.request_id for r in rel] == ["new"] and rel[0].reason == "retracted"
    assert rel[0].token_ids == [*range(10, 26), 7, 7]
    assert f.core.new_token_ratio > ratio
    assert "new" in f.core.retracted and f.batch(out).rows == [f.core.running["old"].row]
    # the cache manager re-matches it over its computed tokens; it re-queues, and is
    # admitted again with a prefill of what the match does not cover (outputs included)
    f.send(Matched(Tokenized("new", list(range(10, 26)), SamplingParams(max_new_tokens=50)),
                   16, list(range(900, 916)), 3))  # fmt: skip
    assert "new" in f.core.waiting and f.core.statistics().num_retractions == 1
    out = f.step(f.batch(out))
    reopen = f.batch(out)
    (o,) = reopen.opens
    assert o.request_id == "new" and o.num_prefix_tokens == 16 and o.prefix_pages[0] == 900
    assert o.num_output_tokens == 3  # its outputs so far, for penalties and its seed stream
    i = reopen.rows.index(o.row_idx)
    assert reopen.start_pos[i] == 16 and reopen.num_new_tokens[i] == 3
    assert reopen.input_ids[:3] == [7, 7, 7] and reopen.sample[i]


def test_a_lone_request_that_cannot_grow_is_aborted_not_stalled():
    f = Feeder(page_size=1, lease_lookahead_steps=1, lease_max_surplus_pages=0)
    b = f.batch(f.send(matched("solo", range(4), max_new=50)))
    f.grant_queue = [0, 0]
    b = f.batch(f.step(b))
    out = f.step(b)
    assert outputs(out)[-1].finish_reason == "abort"
    assert of(out, SequenceReleased)[-1].reason == "aborted" and not f.core.running


def test_rows_are_closed_in_the_next_batch_and_reused_after():
    f = Feeder(max_running_requests=2)
    b = f.batch(f.send(matched("a", range(3), max_new=1)))
    f.send(matched("b", range(10, 13), max_new=3))
    row_a = b.opens[0].row_idx
    b = f.batch(f.step(b))  # "a" finished; "b" admitted; a's row closes with this batch
    assert b.closes == [row_a] and admitted(b) == ["b"] and b.opens[0].row_idx != row_a
    f.send(matched("c", range(20, 23)))
    b2 = f.batch(f.step(b))
    assert admitted(b2) == ["c"] and b2.opens[0].row_idx == row_a and b2.closes == []


def test_census_counts_pool_and_held_pages_every_step():
    core = SchedulerCore(SchedulerConfig(page_size=4, lease_min_pages=1))
    next_page = 100

    def feed(msg):
        nonlocal next_page
        out = core.handle(msg)
        census = of(out, SchedulerCensus)
        if census:  # taken after everything else the core did for this message
            held = sum(len(r.pages) - r.num_tree_pages for r in core.running.values())
            assert census[-1].num_held_by_requests == held == core.num_held
            assert census[-1].num_leased_unused == len(core.pool)
        for m in of(out, LeaseRequest):
            out += feed(LeaseGranted(m.lease_seq, list(range(next_page, next_page + m.num_pages))))
            next_page += m.num_pages
        return out

    out = feed(matched("a", range(10), cached=4, pages=[50], max_new=8))
    n = 0
    while (b := Feeder.batch(out)) is not None:
        n += 1
        out = feed(StepResult(b.step_id, [r for r, s in zip(b.rows, b.sample) if s], [7]))
    assert n == 8 and core.num_held == 0 and of(out, SchedulerCensus)


def test_stale_match_is_refreshed_before_admission_without_blocking_the_step():
    f = Feeder(max_running_requests=4, chunked_prefill_size=8)
    shared = list(range(100, 124))
    b = f.batch(f.send(matched("lead", [*shared, 1], max_new=3)))
    f.send(matched("follow", [*shared, 2], version=0))
    out = f.step(b)  # the leader's first chunk went into the tree
    assert of(out, ChunkCached)
    # the follower's match predates that insert and shares its prefix: refresh first
    # (it could not be admitted this step anyway: the chunk budget is the leader's)
    b = f.batch(out)
    out = f.step(b)
    assert [m.request_id for m in of(f.log, RefreshMatch)] == ["follow"]
    assert f.core.waiting["follow"].awaiting_match
    f.send(matched("follow", [*shared, 2], cached=16, pages=range(16), version=2))
    assert not f.core.waiting["follow"].awaiting_match


def test_pause_and_resume_admission():
    f = Feeder()
    out = f.send(FlipBegin("f1", "update_weights"))
    assert of(out, AdmissionPaused)[0].flip_id == "f1"
    assert f.batch(f.send(matched("a", range(4)))) is None
    assert f.core.statistics().admission_paused
    assert admitted(f.batch(f.send(FlipDone("f1", 2, True)))) == ["a"]
    assert _last_batch(f).version == 2


def test_unexpected_results_are_counted_not_applied():
    f = Feeder()
    f.send(matched("a", range(4)))
    assert f.send(StepResult(999, [0], [1])) == []
    assert f.core.statistics().num_unexpected == 1
    assert math.isclose(f.core.statistics().new_token_ratio, 0.7)


def test_logprobs_and_prompt_logprobs_are_passed_through():
    f = Feeder()
    b = f.batch(
        f.send(matched("lp", range(5), max_new=3, return_logprob=True, top_logprobs_num=1,
                       logprob_start_len=0))
    )  # fmt: skip
    row = b.rows[0]
    top = [[TopLogprob(7, -0.1)]]
    out = f.send(StepResult(b.step_id, [row], [7], [-0.1], top, {row: [-1.0, -2.0, -3.0, -4.0]}))
    (o,) = outputs(out)
    assert o.token_ids == [7] and o.logprobs == [-0.1] and o.top_logprobs == top
    assert o.prompt_logprobs == [-1.0, -2.0, -3.0, -4.0]


def test_shutdown_drains_running_requests_and_refuses_new_ones():
    f = Feeder()
    b = f.batch(f.send(matched("run", range(5), max_new=2)))
    f.send(Shutdown("sigterm", drain_timeout_s=5.0))
    out = f.send(matched("late", range(10, 15)))
    assert [o.finish_reason for o in outputs(out)] == ["abort"]
    assert of(out, SequenceReleased)[0].request_id == "late"
    b = f.batch(f.step(b))
    assert outputs(f.step(b))[-1].finish_reason == "length"  # the running one finished


def test_tree_drop_makes_waiting_matches_refresh_before_admission():
    f = Feeder(max_running_requests=1, refresh_stale_matches=False)
    b = f.batch(f.send(matched("a", range(5), max_new=2)))
    f.send(matched("b", range(10, 20), cached=8, pages=range(8)))
    f.send(TreeDropped("flip", 8, True, "", 9))
    b = f.batch(f.step(b))
    assert f.batch(f.step(b)) is None  # "b" is not admitted on its reclaimed pages...
    (refresh,) = of(f.log, RefreshMatch)
    assert refresh.request_id == "b"
    out = f.send(matched("b", range(10, 20), version=9))  # ...but on its new match
    assert admitted(f.batch(out)) == ["b"] and f.batch(out).opens[0].num_prefix_tokens == 0


def test_ticks_publish_load_statistics():
    f = Feeder()
    f.send(Tick(1_000_000_000))
    b = f.batch(f.send(matched("a", range(5), max_new=10)))
    for _ in range(4):
        b = f.batch(f.step(b))
    f.send(matched("w", range(20, 30)))
    (stats,) = of(f.send(Tick(2_000_000_000)), SchedulerStats)
    assert stats.num_running == 2 or stats.num_running + stats.num_waiting == 2
    assert stats.gen_throughput_tok_s == pytest.approx(4.0)  # 4 tokens in one second
    assert f.core.now_ns == 2_000_000_000


# ---- overlap (two batches in flight) -------------------------------------------------


def test_overlap_plans_the_next_step_before_the_result_and_drops_a_finished_entry():
    f = Feeder(max_batches_in_flight=2, eos_token_ids=(2,))
    out = f.send(matched("a", range(10, 14), max_new=10))
    b1, b2 = [m for m in out if isinstance(m, ForwardBatch)]
    assert b1.start_pos == [0] and b1.num_new_tokens == [4] and b1.sample == [True]
    assert b2.start_pos == [4] and b2.input_ids == [LAST_SAMPLED]  # planned before b1's result
    assert f.core.statistics().num_in_flight == 2
    # b1's token is eos: the request ends now; b2 is in flight and still writes its pages
    out = f.step(b1, token=2)
    assert [o.finish_reason for o in outputs(out)] == ["stop"]
    assert not of(out, SequenceReleased) and "a" in f.core.ending
    out = f.step(b2, token=99)
    assert not outputs(out)  # the wasted entry's token is dropped
    (rel,) = of(out, SequenceReleased)
    assert rel.reason == "finished" and rel.token_ids == [10, 11, 12, 13, 2]
    assert not f.core.ending and f.core.num_held == 0


def test_overlap_plans_no_entry_past_the_last_allowed_token():
    f = Feeder(max_batches_in_flight=2)
    out = f.send(matched("one", range(3), max_new=1))
    batches = [m for m in out if isinstance(m, ForwardBatch)]
    assert len(batches) == 1  # its only token is in flight: nothing more to plan
    assert outputs(f.step(batches[0]))[0].finish_reason == "length"
    assert of(f.log, SequenceReleased)[-1].reason == "finished"


def test_overlap_abort_waits_for_every_batch_in_flight():
    f = Feeder(max_batches_in_flight=2)
    out = f.send(matched("x", range(3), max_new=10))
    b1, b2 = [m for m in out if isinstance(m, ForwardBatch)]
    out = f.send(AbortRequest("x"))
    assert [o.finish_reason for o in outputs(out)] == ["abort"] and not of(out, SequenceReleased)
    assert not of(f.step(b1), SequenceReleased)
    (rel,) = of(f.step(b2), SequenceReleased)
    assert rel.reason == "aborted" and rel.token_ids == [0, 1, 2, 7]


# ---- in-batch prefix sharing ----------------------------------------------------------


def _same_prefix_burst(f, shared, tails):
    """Requests that are all waiting when admission next runs (held by a flip)."""
    f.send(FlipBegin("hold", "update_weights"))
    for i, tail in enumerate(tails):
        f.send(matched(f"r{i}", [*shared, *tail], max_new=3))
    return f.send(FlipDone("hold", 1, True))


def test_requests_arriving_together_compute_their_shared_prefix_once():
    f = Feeder(max_running_requests=8, page_size=4, in_batch_prefix_sharing=True)
    shared = list(range(100, 140))  # 40 tokens = 10 pages
    _same_prefix_burst(f, shared, [[1, 2], [3, 4], [5, 6]])
    first = _last_batch(f)
    assert admitted(first) == ["r0"]  # r1, r2 wait for r0's prefix
    assert f.core.statistics().num_in_batch_deferred >= 2
    out = f.step(first)
    # r0's prompt is computed: its 10 full pages go to the tree at once ...
    (chunk,) = of(out, ChunkCached)
    assert chunk.request_id == "r0" and chunk.token_ids == [*shared, 1, 2]
    # ... and the waiting requests, whose matches predate it, re-match
    refreshed = sorted(m.request_id for m in of(f.log, RefreshMatch))
    assert refreshed == ["r1", "r2"]
    cached_pages = list(chunk.pages[:10])
    for rid, tail in (("r1", [3, 4]), ("r2", [5, 6])):
        f.send(matched(rid, [*shared, *tail], cached=40, pages=cached_pages, version=2,
                       max_new=3))  # fmt: skip
    f.step(_last_batch(f))  # r0's decode step in flight comes back: admission runs
    opens = [o for b in of(f.log, ForwardBatch) for o in b.opens if o.request_id != "r0"]
    assert sorted(o.request_id for o in opens) == ["r1", "r2"]
    assert all(o.num_prefix_tokens == 40 for o in opens)  # only their tails computed


def test_in_batch_sharing_off_prefills_them_all_together():
    f = Feeder(max_running_requests=8, page_size=4)
    shared = list(range(100, 140))
    _same_prefix_burst(f, shared, [[1, 2], [3, 4], [5, 6]])
    assert sorted(o.request_id for b in of(f.log, ForwardBatch) for o in b.opens) == [
        "r0", "r1", "r2"]  # fmt: skip
    assert f.core.statistics().num_in_batch_deferred == 0


def test_short_or_cached_shares_do_not_defer():
    f = Feeder(max_running_requests=8, page_size=4, in_batch_prefix_sharing=True,
               in_batch_prefix_min_tokens=16)  # fmt: skip
    _same_prefix_burst(f, list(range(100, 112)), [[1, 2], [3, 4]])  # 12 shared < 16
    assert sorted(o.request_id for b in of(f.log, ForwardBatch) for o in b.opens) == ["r0", "r1"]
    # a request whose match already covers the shared prefix is not held back either
    g = Feeder(max_running_requests=8, page_size=4, in_batch_prefix_sharing=True)
    shared = list(range(100, 140))
    g.send(FlipBegin("hold", "update_weights"))
    g.send(matched("a", [*shared, 1], max_new=3))
    g.send(matched("b", [*shared, 2], cached=40, pages=range(10), max_new=3))
    (b,) = of(g.send(FlipDone("hold", 1, True)), ForwardBatch)
    assert admitted(b) == ["a", "b"]
