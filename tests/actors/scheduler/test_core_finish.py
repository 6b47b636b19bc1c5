"""Scheduler core: how requests end.

Stop conditions (eos, min/max new tokens, stop ids, context length), aborts (waiting,
running, before the match, stop strings), a failed step, and shutdown draining.
Helpers are in conftest.py.
"""

from __future__ import annotations

from shunter.bus.messages import (
    AbortRequest,
    RequestFailed,
    SequenceReleased,
    Shutdown,
    StepResult,
)
from tests.actors.scheduler.conftest import Feeder, matched, of, outputs

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


# ---- shutdown ---------------------------------------------------------------------


def test_shutdown_drains_running_requests_and_refuses_new_ones():
    f = Feeder()
    b = f.batch(f.send(matched("run", range(5), max_new=2)))
    f.send(Shutdown("sigterm", drain_timeout_s=5.0))
    out = f.send(matched("late", range(10, 15)))
    assert [o.finish_reason for o in outputs(out)] == ["abort"]
    assert of(out, SequenceReleased)[0].request_id == "late"
    b = f.batch(f.step(b))
    assert outputs(f.step(b))[-1].finish_reason == "length"  # the running one finished
