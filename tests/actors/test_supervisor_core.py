"""Supervisor core fed by hand: staged start, deaths, watchdog, stalls, drain."""

from __future__ import annotations

import pytest

from shunter.actors.supervisor_core import (
    NS,
    ActorSpec,
    Exit,
    Exited,
    HealthChanged,
    Publish,
    StartActors,
    Started,
    StopActor,
    SupervisorConfig,
    SupervisorCore,
    Terminate,
    Tick,
)
from shunter.bus.messages import (
    AbortRequest,
    ActorDied,
    GenerateRequest,
    Heartbeat,
    Ready,
    RequestFailed,
    SamplingParams,
    Shutdown,
    TextDelta,
    TextDeltas,
)

ACTORS = [ActorSpec("executor.0", "executor", 0), ActorSpec("cache", "cache", 1),
          ActorSpec("scheduler", "scheduler", 1), ActorSpec("gateway", "gateway", 2)]  # fmt: skip


def _core(watchdog_s=10.0, shutdown_s=5.0, start_s=20.0):
    cfg = SupervisorConfig(ACTORS, watchdog_timeout_s=watchdog_s, shutdown_timeout_s=shutdown_s,
                           start_timeout_s=start_s,
                           tick_interval_s=1.0)  # fmt: skip
    return SupervisorCore(cfg)


def _ready(actor_id, kind="x"):
    return Ready(kind, actor_id)


def _serving_core(**kw):
    core = _core(**kw)
    t = 0
    core.start(t)
    for stage in (["executor.0"], ["cache", "scheduler"], ["gateway"]):
        for a in stage:
            core.handle(Started(a), t)
        for a in stage:
            core.handle(_ready(a), t)
    assert core.state == "serving"
    return core


def _gen(rid):
    return GenerateRequest(rid, SamplingParams(), text="hi")


def _published(actions):
    return [a.msg for a in actions if isinstance(a, Publish)]


# ---- core ----------------------------------------------------------------------------


def test_stages_start_in_order_and_serving_after_the_last_ready():
    core = _core()
    assert core.start(0) == [HealthChanged("starting"), StartActors(["executor.0"])]
    assert core.handle(Started("executor.0"), 0) == []
    assert core.handle(_ready("executor.0"), 1) == [StartActors(["cache", "scheduler"])]
    core.handle(Started("cache"), 1)
    core.handle(Started("scheduler"), 1)
    assert core.handle(_ready("cache"), 2) == []  # scheduler not ready yet: no gateway
    assert core.handle(_ready("cache"), 2) == []  # a repeated Ready changes nothing
    assert core.handle(_ready("scheduler"), 3) == [StartActors(["gateway"])]
    core.handle(Started("gateway"), 3)
    assert core.handle(_ready("gateway"), 4) == [HealthChanged("serving")]
    assert core.statistics().num_ready == 4
    assert core.ready_info["executor.0"].actor_id == "executor.0"


def test_death_during_start_up_exits_1():
    core = _core()
    core.start(0)
    core.handle(Started("executor.0"), 0)
    out = core.handle(Exited("executor.0", "raised LoadError: bad file"), 5)
    assert _published(out) == [
        ActorDied("executor.0", "executor.0 stopped: raised LoadError: bad file")
    ]
    assert out[-1] == Exit(1, "start-up failed: executor.0 stopped: raised LoadError: bad file")
    assert core.handle(Tick(), 6) == []  # nothing after Exit


def test_not_ready_within_the_start_timeout_is_a_failed_start():
    core = _core(watchdog_s=1.0, start_s=10.0)
    core.start(0)
    core.handle(Started("executor.0"), 0)
    for t in range(1, 11):
        assert core.handle(Tick(), t * NS) == []
    out = core.handle(Tick(), 11 * NS)
    assert StopActor("executor.0") in out
    assert out[-1] == Exit(1, "start-up failed: executor.0 not ready after 10 s")


def test_death_while_serving_fails_in_flight_requests_and_turns_unhealthy():
    core = _serving_core()
    core.handle(_gen("r1"), 0)
    core.handle(_gen("r2"), 0)
    core.handle(TextDeltas([TextDelta("r2", "x", [1], finish_reason="stop")]), 0)
    core.handle(_gen("r3"), 0)
    core.handle(RequestFailed("r3", "invalid_request", "bad"), 0)
    assert core.statistics().num_in_flight == 1
    out = core.handle(Exited("scheduler", "exit code -9"), 1)
    assert _published(out) == [
        ActorDied("scheduler", "scheduler stopped: exit code -9"),
        RequestFailed("r1", "actor_died", "scheduler stopped: exit code -9", http_status=503),
    ]
    assert out[-1] == HealthChanged("unhealthy", "scheduler stopped: exit code -9")
    assert not any(isinstance(a, Exit) for a in out)
    assert core.handle(Exited("scheduler", "again"), 2) == []  # dies once
    # requests opened after the death are failed by the next death, not forgotten
    core.handle(_gen("r4"), 3)
    out = core.handle(Exited("cache", "exit code 1"), 4)
    assert RequestFailed(
        "r4", "actor_died", "cache stopped: exit code 1", http_status=503
    ) in _published(out)
    s = core.statistics()
    assert (s.num_dead, s.num_failed_by_death, s.state) == (2, 2, "unhealthy")


def test_missed_heartbeats_kill_the_actor():
    core = _serving_core(watchdog_s=3.0)
    for t in range(1, 8):  # ticks every second, as configured: no stall
        core.handle(Heartbeat("executor.0", t), t * NS)
        core.handle(Heartbeat("cache", t), t * NS)
        core.handle(Heartbeat("gateway", t), t * NS)
        out = core.handle(Tick(), t * NS)
        if t < 4:
            assert out == []
        else:
            # the scheduler's deadline was 0 + 3 s: at t=4 it is dead, once
            assert (out != []) == (t == 4)
    assert core.statistics().num_dead == 1


def test_hung_actor_gets_stop_and_died():
    core = _serving_core(watchdog_s=3.0)
    for t in range(1, 5):
        for a in ("executor.0", "cache", "gateway"):
            core.handle(Heartbeat(a, t), t * NS)
        out = core.handle(Tick(), t * NS)
    assert out[0] == StopActor("scheduler")
    assert _published(out) == [ActorDied("scheduler", "scheduler sent no heartbeat for 3 s")]


def test_observer_stall_is_not_blamed_on_actors():
    core = _serving_core(watchdog_s=5.0)  # everyone's deadline: 5 s
    core.handle(Tick(), 1 * NS)
    # the observer's loop was blocked for 20 s: the next tick comes late
    assert core.handle(Tick(), 21 * NS) == []
    assert core.statistics().stall_ns == 18 * NS  # 20 s late minus 2 tick intervals
    assert core.handle(Tick(), 22 * NS) == []  # deadlines moved to 23 s: still alive
    for a in ("executor.0", "cache", "gateway"):
        core.handle(Heartbeat(a, 1), 22 * NS)
    assert core.handle(Tick(), 23 * NS) == []
    out = core.handle(Tick(), 24 * NS)
    assert _published(out) == [ActorDied("scheduler", "scheduler sent no heartbeat for 5 s")]


def test_gateway_death_stops_the_server():
    core = _serving_core()
    out = core.handle(Exited("gateway", "raised OSError: port in use"), 1)
    assert out[-1] == Exit(1, "gateway stopped: raised OSError: port in use")


def test_drain_waits_for_in_flight_then_exits_0():
    core = _serving_core(shutdown_s=5.0)
    core.handle(_gen("r1"), 0)
    out = core.handle(Terminate("SIGTERM"), 1 * NS)
    assert out == [HealthChanged("draining", "SIGTERM"),
                   Publish(Shutdown("SIGTERM", drain_timeout_s=5.0))]  # fmt: skip
    # a request arriving now is refused and aborted
    out = core.handle(_gen("late"), 1 * NS)
    assert _published(out) == [
        RequestFailed("late", "shutting_down", "the server is shutting down", http_status=503),
        AbortRequest("late", reason="shutdown"),
    ]
    assert core.handle(TextDeltas([TextDelta("r1", "a", [1])]), 2 * NS) == []  # not final yet
    out = core.handle(TextDeltas([TextDelta("r1", "b", [2], finish_reason="length")]), 2 * NS)
    assert out[-1] == Exit(0, "drained: no request in flight")
    assert core.statistics().num_refused_while_draining == 1


def test_an_aborted_request_does_not_hold_the_drain():
    core = _serving_core()
    core.handle(_gen("r1"), 0)
    core.handle(_gen("r2"), 0)
    core.handle(Terminate("SIGTERM"), 0)
    assert core.handle(AbortRequest("r1", reason="disconnect"), 1) == []
    out = core.handle(RequestFailed("r2", "internal", "x"), 2)
    assert out[-1] == Exit(0, "drained: no request in flight")


def test_drain_is_bounded_by_the_shutdown_timeout():
    core = _serving_core(shutdown_s=2.0)
    core.handle(_gen("r1"), 0)
    core.handle(Terminate("SIGTERM"), 0)
    assert core.handle(Tick(), 1 * NS) == []
    out = core.handle(Tick(), 2 * NS)
    reason = "drain timed out with 1 request(s) in flight"
    assert _published(out) == [RequestFailed("r1", "shutting_down", reason, http_status=503)]
    assert out[-1] == Exit(0, reason)


def test_drain_with_nothing_in_flight_exits_at_once_and_second_signal_forces():
    core = _serving_core()
    assert core.handle(Terminate("SIGTERM"), 0)[-1] == Exit(0, "drained: no request in flight")
    core = _serving_core()
    core.handle(_gen("r1"), 0)
    core.handle(Terminate("SIGTERM"), 0)
    assert core.handle(Terminate("SIGINT"), 0)[-1] == Exit(
        0, "second SIGINT: stopping without waiting"
    )


def test_actor_death_during_drain_fails_the_rest_and_finishes_the_drain():
    core = _serving_core()
    core.handle(_gen("r1"), 0)
    core.handle(Terminate("SIGTERM"), 0)
    out = core.handle(Exited("executor.0", "exit code -9"), 1)
    assert RequestFailed(
        "r1", "actor_died", "executor.0 stopped: exit code -9", http_status=503
    ) in _published(out)
    assert out[-1] == Exit(0, "drained: no request in flight")


def test_config_validation():
    with pytest.raises(ValueError, match="no actors"):
        SupervisorConfig([])
    with pytest.raises(ValueError, match="actor ids repeat"):
        SupervisorConfig([ActorSpec("a", "x"), ActorSpec("a", "y")])
