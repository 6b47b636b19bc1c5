"""Scheduler core admission: what is admitted into a batch and how it is prefilled.

Prefill token budget, chunked prefill, the scheduling policies (lpm, lof, random,
priority with aging), stale matches refreshed before admission, admission paused by a
weight flip, and in-batch prefix sharing. Helpers are in conftest.py.
"""

from __future__ import annotations

import pytest

from shunter.bus.messages import (
    LAST_SAMPLED,
    AdmissionPaused,
    ChunkCached,
    FlipBegin,
    FlipDone,
    ForwardBatch,
    RefreshMatch,
    RequestFailed,
    SchedulerCensus,
    Tick,
    TreeDropped,
)
from tests.actors.scheduler.conftest import Feeder, admitted, matched, of


def _last_batch(f):
    return [m for m in f.log if isinstance(m, ForwardBatch)][-1]


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


# ---- match refresh and paused admission -------------------------------------------


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
    # nor one that scores its prompt from the start (it computes every token anyway)
    h = Feeder(max_running_requests=8, page_size=4, in_batch_prefix_sharing=True)
    h.send(FlipBegin("hold", "update_weights"))
    h.send(matched("a", [*shared, 1], max_new=3))
    h.send(matched("b", [*shared, 2], max_new=3, logprob_start_len=0))
    (b,) = of(h.send(FlipDone("hold", 1, True)), ForwardBatch)
    assert admitted(b) == ["a", "b"]


def test_a_full_queue_refuses_new_requests_with_503():
    """max_queued_requests bounds the waiting queue: one more new request fails at once
    (a retracted one coming back is not new, and always re-queues)."""
    f = Feeder(max_running_requests=1, max_queued_requests=2)
    f.send(matched("run", range(4), max_new=50))
    for i in range(2):
        assert not of(f.send(matched(f"w{i}", range(10 * i + 10, 10 * i + 14))), RequestFailed)
    (fail,) = of(f.send(matched("w2", range(40, 44))), RequestFailed)
    assert (fail.request_id, fail.code, fail.http_status) == ("w2", "queue_full", 503)
    assert sorted(f.core.waiting) == ["w0", "w1"] and f.core.statistics().num_failed == 1
