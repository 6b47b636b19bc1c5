"""Scheduler core across steps: the running batch and its books.

Retraction under KV pressure, rows closed and reused, the page census, step results
(unexpected ones, logprobs), load statistics on ticks, and overlap (two batches in
flight). Helpers are in conftest.py.
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
    FlipBegin,
    FlipDone,
    FlipQuiesced,
    ForwardBatch,
    LeaseGranted,
    LeaseRequest,
    Matched,
    PagesEvictable,
    SamplingParams,
    SchedulerCensus,
    SchedulerStats,
    SequenceReleased,
    StepResult,
    Tick,
    Tokenized,
    TopLogprob,
)
from tests.actors.scheduler.conftest import Feeder, admitted, matched, of, outputs

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


def test_a_grant_short_for_a_backup_in_flight_is_waited_for_not_relieved():
    """The lone request of the test above, but the cache's grant came short only because
    a backup to the host tier holds its evictable pages (awaits_backup): the scheduler
    neither aborts nor parks nor retracts; it waits for PagesEvictable, then asks again
    and the request goes on."""
    f = Feeder(page_size=1, lease_lookahead_steps=1, lease_max_surplus_pages=0)
    b = f.batch(f.send(matched("solo", range(4), max_new=50)))
    f.grant_queue, f.short_awaits_backup = [0, 0], True
    b = f.batch(f.step(b))
    out = f.step(b)
    assert f.batch(out) is None and not outputs(out)[-1].finish_reason
    assert not of(out, SequenceReleased) and list(f.core.running) == ["solo"]
    assert f.core.pool.awaits_backup and f.batch(f.send(Tick(1_000_000))) is None
    f.grant_queue = []  # the backup landed: the next grant is whole
    out = f.send(PagesEvictable(8))
    assert of(out, LeaseRequest) and not f.core.pool.awaits_backup
    b = f.batch(out)
    assert b is not None and b.rows == [f.core.running["solo"].row]
    s = f.core.statistics()
    assert (s.num_retractions, s.num_parked, s.num_aborted) == (0, 0, 0)


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


# ---- step results and statistics --------------------------------------------------


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
    ptop = [[], *[[TopLogprob(i, -0.5)] for i in range(1, 5)]]
    out = f.send(StepResult(b.step_id, [row], [7], [-0.1], top, {row: [-1.0, -2.0, -3.0, -4.0]},
                            prompt_top_logprobs={row: ptop}))  # fmt: skip
    (o,) = outputs(out)
    assert o.token_ids == [7] and o.logprobs == [-0.1] and o.top_logprobs == top
    assert o.prompt_logprobs == [-1.0, -2.0, -3.0, -4.0] and o.prompt_top_logprobs == ptop


def test_a_prompt_scored_without_generating_runs_its_prefill_and_ends():
    """max_new_tokens 0 with prompt logprobs (echo + logprobs, a /generate scoring
    call): the prompt is computed, in chunks, with no sample; the last piece ends it.
    Without prompt logprobs such a request ends at once, computing nothing."""
    f = Feeder(chunked_prefill_size=4)
    assert f.batch(f.send(matched("none", range(10), max_new=0))) is None
    (o,) = outputs(f.log)
    assert o.token_ids == [] and o.finish_reason == "length"
    b = f.batch(f.send(matched("score", range(100, 110), max_new=0, logprob_start_len=0)))
    assert b.sample == [False] and b.num_new_tokens == [4]
    row = b.rows[0]
    (o,) = outputs(f.send(StepResult(b.step_id, [], [], prompt_logprobs={row: [-1.0] * 4})))
    assert o.prompt_logprobs == [-1.0] * 4 and o.finish_reason is None
    pieces = [m for m in f.log if isinstance(m, ForwardBatch)]
    assert [p.num_new_tokens for p in pieces] == [[4], [4]] and pieces[-1].sample == [False]
    out = f.send(StepResult(pieces[-1].step_id, [], [], prompt_logprobs={row: [-2.0] * 4}))
    pieces = [m for m in f.log if isinstance(m, ForwardBatch)]
    assert pieces[-1].num_new_tokens == [2] and pieces[-1].sample == [False]
    out = f.send(StepResult(pieces[-1].step_id, [], [], prompt_logprobs={row: [-3.0] * 2}))
    (o,) = outputs(out)
    assert o.token_ids == [] and o.prompt_logprobs == [-3.0] * 2 and o.finish_reason == "length"
    (rel,) = of(out, SequenceReleased)
    assert rel.token_ids == list(range(100, 110)) and rel.reason == "finished"
    assert not f.core.running and f.core.statistics().num_finished == 2


def test_a_flip_holds_admission_and_says_when_nothing_runs():
    """FlipBegin pauses admission (AdmissionPaused with the counts); FlipQuiesced goes
    out once, when the running requests have finished (drain) or been retracted
    (retract=True) and no batch is in flight; FlipDone lets the waiting ones in."""
    f = Feeder()
    b = f.batch(f.send(matched("run", range(5), max_new=2)))
    (paused,) = of(f.send(FlipBegin("w1", "update_weights")), AdmissionPaused)
    assert (paused.num_running, paused.num_waiting) == (1, 0)
    assert f.batch(f.send(matched("wait", range(10, 15)))) is None  # held back
    out = f.step(b)  # "run" decodes its last token ...
    assert not of(out, FlipQuiesced)
    out = f.step(f.batch(out))  # ... and finishes
    (q,) = of(out, FlipQuiesced)
    assert q.flip_id == "w1" and q.num_waiting == 1 and not f.core.running
    assert not of(f.send(Tick(5)), FlipQuiesced)  # once
    b = f.batch(f.send(FlipDone("w1", 1, True)))
    assert admitted(b) == ["wait"] and b.version == 1
    # retract: the running request goes back to waiting, and it is quiesced at once
    out = f.send(FlipBegin("w2", "update_weights", retract=True))
    assert not of(out, FlipQuiesced)  # "wait"'s prefill is in flight
    out = f.send(StepResult(b.step_id, [b.rows[0]], [7]))
    assert [r.reason for r in of(out, SequenceReleased)] == ["retracted"]
    (q,) = of(out, FlipQuiesced)
    assert q.flip_id == "w2" and not f.core.running and "wait" in f.core.retracted


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


def test_retraction_policy_priority_retracts_the_lowest_priority_first():
    f = Feeder(page_size=1, lease_lookahead_steps=1, lease_max_surplus_pages=0,
               retraction_policy="priority")  # fmt: skip
    f.send(FlipBegin("hold", "x"))
    f.send(matched("old", range(8), max_new=50, priority=1))
    f.send(matched("new", range(10, 26), max_new=50, priority=5))
    b = f.batch(f.send(FlipDone("hold", 0, True)))
    b = f.batch(f.step(b))
    f.grant_queue = [0]
    b = f.batch(f.step(b))
    rel = of(f.step(b), SequenceReleased)
    # "length" would take "new" (the longer prompt, as above); priority takes "old"
    assert [r.request_id for r in rel] == ["old"] and rel[0].reason == "retracted"


def test_prefill_max_requests_bounds_the_requests_prefilled_in_one_step():
    f = Feeder(prefill_max_requests=2, max_running_requests=8)
    f.send(FlipBegin("hold", "x"))
    for k in range(5):
        f.send(matched(f"r{k}", range(10 * k, 10 * k + 6), max_new=3))
    b = f.batch(f.send(FlipDone("hold", 0, True)))
    steps = [admitted(b)]
    while sum(map(len, steps)) < 5:
        b = f.batch(f.step(b))
        steps.append(admitted(b))
    assert steps[0] == ["r0", "r1"] and max(map(len, steps)) == 2
    assert [r for s in steps for r in s] == [f"r{k}" for k in range(5)]


def test_a_higher_priority_arrival_preempts_the_lowest_priority_running_request():
    f = Feeder(schedule_policy="priority", max_running_requests=2, priority_aging_per_s=0.0,
               priority_preemption_threshold=10)  # fmt: skip
    b = f.batch(f.send(matched("a", range(6), max_new=20, priority=0)))
    f.send(matched("b", range(10, 16), max_new=20, priority=5))
    b = f.batch(f.step(b))
    assert set(f.core.running) == {"a", "b"}
    f.send(matched("near", range(20, 26), max_new=20, priority=9))  # 9 above a: it waits
    out = f.step(b)
    for _ in range(2):
        assert not of(out, SequenceReleased)
        out = f.step(f.batch(out))
    f.send(matched("vip", range(30, 36), max_new=20, priority=30))
    for _ in range(3):
        out = f.step(f.batch(out))
        if of(out, SequenceReleased):
            break
    (rel,) = of(out, SequenceReleased)
    assert rel.request_id == "a" and rel.reason == "retracted"
    assert f.core.statistics().num_preemptions == 1
    b = f.batch(out)
    assert admitted(b) == ["vip"] and set(f.core.running) == {"b", "vip"}


def test_the_decode_log_writes_a_line_every_interval_batches():
    from shunter.actors.scheduler.actor import _DecodeLog

    class Lines:
        def __init__(self):
            self.got = []

        def info(self, event, **kw):
            self.got.append((event, kw))

    f = Feeder(num_total_pages=64)
    lines = Lines()
    log = _DecodeLog(3, lines)
    b = f.batch(f.send(matched("a", range(6), max_new=20)))
    for _ in range(7):
        log.step(f.core)
        b = f.batch(f.step(b))
    assert [e for e, _ in lines.got] == ["decode batch"] * 2
    kw = lines.got[-1][1]
    assert kw["running"] == 1 and kw["queued"] == 0 and 0 < kw["token_usage"] <= 1
    assert kw["gen_tok_s"] is None or kw["gen_tok_s"] > 0
    silent = Lines()
    for _ in range(5):
        _DecodeLog(0, silent).step(f.core)
    assert not silent.got


def test_pages_evictable_lets_a_short_pool_ask_again():
    """A grant came short because the cache's evictable pages were still being backed up
    to the host tier; once it says they can go (PagesEvictable), the pool asks again."""
    f = Feeder(page_size=1, lease_lookahead_steps=1, lease_max_surplus_pages=0)
    f.grant_queue = [0]
    out = f.send(matched("a", range(8), max_new=4))
    assert f.batch(out) is None and f.core.pool.cache_short
    assert f.batch(f.send(Tick(1_000_000))) is None  # nothing else makes it ask
    out = f.send(PagesEvictable(8))
    assert of(out, LeaseRequest) and admitted(f.batch(out)) == ["a"]
    assert not f.core.pool.cache_short
