"""Supervisor shell with small actors on the real in-process bus (real tasks, real
heartbeats, real timeouts)."""

from __future__ import annotations

import contextlib

import anyio
import pytest

from shunter.actors.supervisor import (
    EmbeddedActor,
    LoopWatchdog,
    Supervisor,
    run_with_heartbeats,
)
from shunter.actors.supervisor_core import (
    ActorSpec,
    SupervisorConfig,
)
from shunter.bus.inproc import InProcHub
from shunter.bus.messages import (
    ActorDied,
    GenerateRequest,
    Ready,
    RequestFailed,
    SamplingParams,
    TextDelta,
    TextDeltas,
)

# ---- shell on the in-process bus -----------------------------------------------------


def _echo_actor(actor_id, bus, *, ready=True, crash_on=None):
    """A small engine: Ready, then answers GenerateRequest text with one final delta.
    A request whose text equals crash_on makes it raise; "hold" is never answered."""

    async def main():
        async with bus.subscribe(types=(GenerateRequest,)) as sub:
            if ready:
                await bus.publish(Ready("echo", actor_id))
            async for r in sub:
                req = r.msg
                if req.text == crash_on:
                    raise RuntimeError("boom")
                if req.text != "hold":
                    delta = TextDelta(req.request_id, req.text.upper(), [1], finish_reason="stop")
                    await bus.publish(TextDeltas([delta]))

    return main


@contextlib.asynccontextmanager
async def _deployment(specs, make_main, *, watchdog_s=5.0, shutdown_s=2.0, beats=True,
                      start_s=10.0):  # fmt: skip
    """Run a Supervisor over embedded test actors; yields (supervisor, client bus)."""
    hub = InProcHub()
    cfg = SupervisorConfig(specs, watchdog_timeout_s=watchdog_s, shutdown_timeout_s=shutdown_s,
                           start_timeout_s=start_s, tick_interval_s=0.05)  # fmt: skip
    sup_bus = hub.connect("supervisor")

    async def launch(spec, ready_info):
        bus = hub.connect(spec.actor_id)
        main = make_main(spec, bus, ready_info)
        body = (lambda: run_with_heartbeats(spec.actor_id, main, bus, 0.05)) if beats else main
        handle = EmbeddedActor(spec.actor_id, body)
        actors_tg.start_soon(handle.run)
        return handle

    sup = Supervisor(cfg, sup_bus, {s.kind: launch for s in specs}, handle_signals=False,
                     stop_grace_s=0.5)  # fmt: skip
    async with anyio.create_task_group() as actors_tg:
        yield sup, hub.connect("client")
        actors_tg.cancel_scope.cancel()


async def _ask(client, rid, text, timeout_s=2.0):
    outcome = None
    with anyio.fail_after(timeout_s):
        async with client.subscribe(types=(TextDeltas, RequestFailed)) as sub:
            await client.publish(GenerateRequest(rid, SamplingParams(), text=text))
            async for r in sub:
                m = r.msg
                if isinstance(m, RequestFailed) and m.request_id == rid:
                    return m
                if isinstance(m, TextDeltas):
                    for d in m.deltas:
                        if d.request_id == rid and d.finish_reason:
                            return d
    return outcome


async def _wait_health(sup, state, timeout_s=3.0):
    with anyio.fail_after(timeout_s):
        while sup.health != state:
            await anyio.sleep(0.01)


SPECS = [ActorSpec("a", "a", 0), ActorSpec("b", "b", 1)]


@pytest.mark.anyio
async def test_shell_starts_stages_serves_and_drains_on_terminate():
    started = []

    def make_main(spec, bus, ready_info):
        started.append((spec.actor_id, sorted(ready_info)))
        return (
            _echo_actor(spec.actor_id, bus) if spec.actor_id == "b" else _ready_then_idle(spec, bus)
        )

    async with _deployment(SPECS, make_main) as (sup, client):
        async with anyio.create_task_group() as tg:
            result = {}

            async def run():
                result["code"] = await sup.run()

            tg.start_soon(run)
            await _wait_health(sup, "serving")
            assert started == [("a", []), ("b", ["a"])]  # b saw a's Ready info before starting
            d = await _ask(client, "r1", "hello")
            assert d.text == "HELLO"
            # a held request keeps the drain open until the shutdown timeout
            held = anyio.Event()

            async def hold():
                result["held"] = await _ask(client, "r2", "hold", timeout_s=5.0)
                held.set()

            tg.start_soon(hold)
            await anyio.sleep(0.1)
            await sup.terminate()
            assert sup.health == "draining"
            refused = await _ask(client, "r3", "hold")  # only the supervisor can answer it
            assert (refused.code, refused.http_status) == ("shutting_down", 503)
        assert result["code"] == 0
        assert (result["held"].code, result["held"].http_status) == ("shutting_down", 503)
        assert sup.exit.reason == "drain timed out with 1 request(s) in flight"
        assert sup.statistics().num_heartbeats > 0


def _ready_then_idle(spec, bus):
    async def main():
        await bus.publish(Ready("idle", spec.actor_id))
        await anyio.sleep_forever()

    return main


@pytest.mark.anyio
async def test_shell_crash_while_serving_fails_in_flight_and_reports_unhealthy():
    def make_main(spec, bus, ready_info):
        if spec.actor_id == "a":
            return _echo_actor("a", bus, crash_on="crash")
        return _ready_then_idle(spec, bus)

    async with _deployment(SPECS, make_main) as (sup, client):
        died = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(sup.run)
            await _wait_health(sup, "serving")

            async def watch():
                async with client.subscribe(types=(ActorDied,)) as sub:
                    async for r in sub:
                        died.append(r.msg)

            tg.start_soon(watch)
            await anyio.sleep(0.05)

            result = {}

            async def pending():
                result["r1"] = await _ask(client, "r1", "hold")

            tg.start_soon(pending)
            await anyio.sleep(0.1)
            failed = await _ask(client, "r2", "crash")
            assert (failed.code, failed.http_status) == ("actor_died", 503)
            await _wait_health(sup, "unhealthy")
            await anyio.sleep(0.05)
            assert result["r1"].code == "actor_died"  # the held request did not hang
            assert [d.actor_id for d in died] == ["a"]
            assert "raised RuntimeError: boom" in died[0].reason
            await sup.terminate()
            tg.cancel_scope.cancel()  # the watcher
        assert sup.exit.code == 0


@pytest.mark.anyio
async def test_shell_actor_without_heartbeats_is_declared_dead():
    def make_main(spec, bus, ready_info):
        return _ready_then_idle(spec, bus)

    async with _deployment(SPECS, make_main, watchdog_s=0.5, beats=False) as (sup, _client):
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(sup.run)
                await _wait_health(sup, "serving")
                await _wait_health(sup, "unhealthy")
                assert "sent no heartbeat for 0.5 s" in sup.health_reason
                await sup.terminate()


@pytest.mark.anyio
async def test_shell_start_failure_exits_1_without_starting_later_stages():
    started = []

    def make_main(spec, bus, ready_info):
        started.append(spec.actor_id)

        async def main():
            raise FileNotFoundError("no weights")

        return main

    async with _deployment(SPECS, make_main) as (sup, _):
        with anyio.fail_after(5):
            code = await sup.run()
        assert code == 1
        assert started == ["a"]
        assert sup.exit.reason == "start-up failed: a stopped: raised FileNotFoundError: no weights"


@pytest.mark.anyio
async def test_shell_start_timeout_exits_1():
    def make_main(spec, bus, ready_info):
        async def main():
            await anyio.sleep_forever()  # never Ready

        return main

    async with _deployment(SPECS, make_main, start_s=0.3) as (sup, _):
        with anyio.fail_after(5):
            code = await sup.run()
        assert (code, sup.exit.reason) == (1, "start-up failed: a not ready after 0.3 s")


@pytest.fixture
def anyio_backend():
    return "asyncio"


STALL_SCRIPT = """
import time, anyio
from shunter.actors.supervisor import LoopWatchdog

async def main():
    async with anyio.create_task_group() as tg:
        tg.start_soon(LoopWatchdog(0.6, interval_s=0.1).run)
        await anyio.sleep(0.5)  # turning: no stall
        time.sleep(30)  # a synchronous call blocks the loop

anyio.run(main)
"""


def test_loop_watchdog_ends_a_process_whose_loop_is_blocked():
    import subprocess
    import sys
    import time

    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", STALL_SCRIPT], capture_output=True, text=True,
                       timeout=60)  # fmt: skip
    assert r.returncode == LoopWatchdog.STALL_EXIT_CODE, r.stderr
    assert time.monotonic() - t0 < 20  # not the 30 s the loop was blocked for
    assert "event loop stalled" in r.stdout + r.stderr
    assert "in main" in r.stderr  # the dump shows where the loop is stuck
    with pytest.raises(ValueError):
        LoopWatchdog(1.0, interval_s=2.0)
