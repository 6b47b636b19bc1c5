"""The scheduler shell on the real in-process bus, with the real cache manager actor, a
model-free executor actor, and the real recorder; then the recording replays identically
through the scheduler core (`busctl replay --actor scheduler`'s check)."""

from __future__ import annotations

import json
from functools import partial

import anyio
import pytest

from shunter.actors.cache_manager.actor import run as run_cache
from shunter.actors.cache_manager.config import CacheConfig
from shunter.actors.scheduler.actor import CORE_INBOX
from shunter.actors.scheduler.actor import run as run_scheduler
from shunter.actors.scheduler.config import SchedulerConfig
from shunter.actors.scheduler.core import SchedulerCore
from shunter.actors.scheduler.sim import SimExecutor, mix64
from shunter.bus.inproc import InProcHub
from shunter.bus.log import record
from shunter.bus.messages import (
    AbortRequest,
    Census,
    CensusBroken,
    ForwardBatch,
    FreeRefused,
    HealthPing,
    HealthPong,
    SamplingParams,
    SchedulerCensus,
    SchedulerConfigured,
    SchedulerStats,
    Shutdown,
    Tokenized,
    TokensOut,
)
from shunter.bus.replay import register_core, replay
from shunter.bus.transport import Bus

NUM_PAGES = 96


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def run_executor(bus: Bus, page_size: int, *, task_status=anyio.TASK_STATUS_IGNORED):
    exe = SimExecutor(page_size, NUM_PAGES, lambda rid, pos: mix64(pos) % 300 + 10)
    async with bus.subscribe("sched.batch", types=(ForwardBatch,)) as sub:
        await sub.wait_connected()
        task_status.started()
        async for received in sub:
            await bus.publish(exe.handle(received.msg))


@pytest.mark.anyio
async def test_scheduler_actor_serves_requests_and_its_recording_replays(tmp_path):
    hub = InProcHub()
    cfg = SchedulerConfig(page_size=2, chunked_prefill_size=8, max_running_requests=4,
                          num_total_pages=NUM_PAGES, lease_min_pages=4)  # fmt: skip
    driver = hub.connect("driver")
    finals: dict[str, str] = {}
    counts: dict[str, int] = {}
    async with anyio.create_task_group() as tg:
        await tg.start(record, hub.connect("recorder"), tmp_path)
        await tg.start(
            run_cache, CacheConfig(num_pages=NUM_PAGES, page_size=2), hub.connect("cache")
        )
        await tg.start(run_executor, hub.connect("executor.0"), 2)
        async with driver.subscribe("sched.", "health.pong", "cache.census", "cache.error") as sub:
            await sub.wait_connected()
            await tg.start(
                partial(run_scheduler, tick_interval_s=0.01), cfg, hub.connect("scheduler")
            )
            shared = list(range(500, 520))
            for i in range(10):
                ids = [*shared, 30 + i, 31 + i] if i % 2 else [60 + i] * (3 + i)
                await driver.publish(Tokenized(f"r{i}", ids, SamplingParams(max_new_tokens=6 + i)))
            await driver.publish(AbortRequest("r9"))
            await driver.publish(HealthPing("p1"))
            seen = set()
            with anyio.fail_after(20):
                while len(finals) < 10 or "pong" not in seen or "stats" not in seen:
                    msg = (await sub.receive()).msg
                    if isinstance(msg, HealthPong):
                        seen.add("pong")
                    elif isinstance(msg, SchedulerStats):
                        seen.add("stats")
                    elif isinstance(msg, SchedulerConfigured):
                        seen.add("config")
                    elif isinstance(msg, SchedulerCensus):
                        seen.add("census")
                    elif isinstance(msg, Census):
                        assert msg.ok, msg
                    elif isinstance(msg, CensusBroken | FreeRefused):
                        raise AssertionError(msg)
                    elif isinstance(msg, TokensOut):
                        for o in msg.outputs:
                            counts[o.request_id] = counts.get(o.request_id, 0) + len(o.token_ids)
                            if o.finish_reason is not None:
                                assert o.request_id not in finals, "two final outputs"
                                finals[o.request_id] = o.finish_reason
        await anyio.sleep(0.1)  # the recorder catches up
        tg.cancel_scope.cancel()
    assert seen >= {"pong", "stats", "census"}
    assert finals["r9"] == "abort"
    assert all(finals[f"r{i}"] == "length" and counts[f"r{i}"] == 6 + i for i in range(9))

    result = replay(tmp_path, "scheduler")
    assert result.identical, result.report()
    assert result.num_inbox > 20 and result.num_outbox > 20
    from shunter.ops.busctl import main as busctl

    assert busctl(["replay", str(tmp_path), "--actor", "scheduler"]) == 0
    cache = replay(tmp_path, "cache")
    assert cache.identical, cache.report()


def test_replay_catches_a_scheduler_that_decides_differently(tmp_path):
    """Same recording, a core with a different policy seed: the replay must diverge."""

    async def go():
        hub = InProcHub()
        cfg = SchedulerConfig(page_size=1, max_running_requests=2, lease_min_pages=2)
        driver = hub.connect("driver")
        async with anyio.create_task_group() as tg:
            await tg.start(record, hub.connect("recorder"), tmp_path)
            await tg.start(
                run_cache, CacheConfig(num_pages=NUM_PAGES, page_size=1), hub.connect("cache")
            )
            await tg.start(run_executor, hub.connect("executor.0"), 1)
            async with driver.subscribe("sched.tokens") as sub:
                await tg.start(
                    partial(run_scheduler, tick_interval_s=0.05), cfg, hub.connect("scheduler")
                )
                for i in range(4):
                    await driver.publish(
                        Tokenized(f"q{i}", [i + 1] * 5, SamplingParams(max_new_tokens=4))
                    )
                done = 0
                with anyio.fail_after(20):
                    while done < 4:
                        msg = (await sub.receive()).msg
                        done += sum(o.finish_reason is not None for o in msg.outputs)
            await anyio.sleep(0.1)
            tg.cancel_scope.cancel()

    anyio.run(go, backend="asyncio")
    assert replay(tmp_path, "scheduler").identical

    def altered(config):
        data = json.loads(config.config_json)
        data["max_running_requests"] = 1  # admits differently
        return SchedulerCore(SchedulerConfig(**data))

    spec = register_core("scheduler-altered", altered, inbox=CORE_INBOX, actor_id="scheduler",
                         config=("sched.config",))  # fmt: skip
    result = replay(tmp_path, spec)
    assert not result.identical and "FIRST DIVERGENCE" in result.report()


@pytest.mark.anyio
async def test_shutdown_drain_timeout_aborts_what_is_left():
    """No executor answers, so nothing can finish: after the drain timeout the shell
    aborts every request through the bus, and each gets its final output."""
    hub = InProcHub()
    driver = hub.connect("driver")
    cfg = SchedulerConfig(page_size=1, lease_min_pages=4)
    async with anyio.create_task_group() as tg:
        await tg.start(run_cache, CacheConfig(num_pages=64, page_size=1), hub.connect("cache"))
        async with driver.subscribe("sched.tokens", "req.abort") as sub:
            await tg.start(
                partial(run_scheduler, tick_interval_s=0.05), cfg, hub.connect("scheduler")
            )
            for i in range(3):
                await driver.publish(
                    Tokenized(f"s{i}", [i + 1] * 4, SamplingParams(max_new_tokens=5))
                )
            await anyio.sleep(0.1)
            await driver.publish(Shutdown("sigterm", drain_timeout_s=0.2))
            finals, aborts = {}, set()
            with anyio.fail_after(10):
                while len(finals) < 3:
                    msg = (await sub.receive()).msg
                    if isinstance(msg, AbortRequest):
                        aborts.add((msg.request_id, msg.reason))
                    else:
                        finals |= {
                            o.request_id: o.finish_reason for o in msg.outputs if o.finish_reason
                        }
        tg.cancel_scope.cancel()
    assert finals == {"s0": "abort", "s1": "abort", "s2": "abort"}
    assert aborts == {("s0", "shutdown"), ("s1", "shutdown"), ("s2", "shutdown")}
