"""Replay harness: a small deterministic core is run live on a real bus with the real
recorder, then replayed from the log: identical, and every kind of divergence caught.

This module also registers the core as "accumulator" when imported, so
`busctl replay --import tests/bus/test_replay.py --actor accumulator` can use it.
"""

from __future__ import annotations

import functools
import pathlib

import anyio
import pytest

from shunter.bus.codec import encode
from shunter.bus.inproc import InProcHub
from shunter.bus.log import LogReader, LogWriter, record
from shunter.bus.messages import (
    Envelope,
    HealthPing,
    Msg,
    Ready,
    RequestOutput,
    SchedulerStats,
    StepResult,
    Tick,
    TokensOut,
)
from shunter.bus.replay import (
    CoreSpec,
    get_core,
    register_core,
    registered,
    replay,
)
from shunter.bus.transport import Bus

ACTOR = "accumulator"


class AccumulatorCore:
    """Per-row running totals of sampled tokens: a StepResult becomes a TokensOut whose
    outputs carry (token + offset) and the row's running total; every Tick reports the
    number of rows seen. `bug_after` makes it go wrong on purpose from that message on."""

    def __init__(self, offset: int, bug_after: int | None = None):
        self.offset = offset
        self.totals: dict[int, int] = {}
        self.num_handled = 0
        self.bug_after = bug_after

    def handle(self, msg: Msg) -> list[Msg]:
        self.num_handled += 1
        bug = 1 if self.bug_after is not None and self.num_handled > self.bug_after else 0
        match msg:
            case StepResult(step_id=step, rows=rows, token_ids=tokens):
                outs = []
                for row, tok in zip(rows, tokens, strict=True):
                    self.totals[row] = self.totals.get(row, 0) + tok
                    outs.append(
                        RequestOutput(
                            f"row{row}",
                            [tok + self.offset + bug],
                            num_prompt_tokens=self.totals[row],
                        )
                    )
                return [TokensOut(step, outs)]
            case Tick(now_ns=now):
                if now % 3:
                    return []
                return [
                    SchedulerStats(
                        self.num_handled,
                        len(self.totals),
                        0,
                        sum(self.totals.values()),
                        1 << 20,
                        0.5,
                    )
                ]
        return []


def build_core(config: Msg | None, bug_after: int | None = None) -> AccumulatorCore:
    assert isinstance(config, Ready), config
    return AccumulatorCore(int(config.info["offset"]), bug_after)


SPEC = register_core(
    ACTOR, build_core, inbox=("sched.result", "sched.tick"), config=("health.ready",)
)


async def run_shell(bus: Bus, offset: int, started: anyio.Event) -> None:
    """The core's async shell: subscribe, announce the config, then handle the inbox."""
    async with bus.subscribe("sched.result", "sched.tick", types=(StepResult, Tick)) as sub:
        await bus.publish(Ready(actor=ACTOR, actor_id=ACTOR, info={"offset": offset}))
        core = AccumulatorCore(offset)
        started.set()
        async for received in sub:
            for out in core.handle(received.msg):
                await bus.publish(out)


def workload(num_steps: int) -> list[Msg]:
    msgs: list[Msg] = []
    for step in range(num_steps):
        rows = [r for r in range(8) if (r + step) % 3]
        msgs.append(StepResult(step, rows, [(step * 31 + r * 7) % 101 for r in rows]))
        msgs.append(Tick(now_ns=step))
        if step % 10 == 0:
            msgs.append(HealthPing(f"p{step}"))  # neither inbox nor outbox
    return msgs


async def record_live_run(directory: pathlib.Path, num_steps: int = 60, offset: int = 5) -> int:
    """Run the core live on an in-process bus with a recorder; returns messages recorded."""
    hub = InProcHub()
    driver, shell_bus, rec_bus = hub.connect("driver"), hub.connect(ACTOR), hub.connect("recorder")
    msgs = workload(num_steps)
    num_outputs = sum(1 for m in msgs if isinstance(m, StepResult)) + sum(
        1 for m in msgs if isinstance(m, Tick) and m.now_ns % 3 == 0
    )
    recording, shell_up = anyio.Event(), anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: record(rec_bus, directory, started=recording))
        await recording.wait()
        tg.start_soon(run_shell, shell_bus, offset, shell_up)
        await shell_up.wait()
        async with driver.subscribe("sched.tokens", "sched.stats") as outs:
            for m in msgs:
                await driver.publish(m)
            with anyio.fail_after(10):
                for _ in range(num_outputs):
                    await outs.receive()
        await anyio.sleep(0.05)  # the recorder's queue drains
        tg.cancel_scope.cancel()
    return len(msgs) + num_outputs + 1


def copy_log(src: pathlib.Path, dst: pathlib.Path, edit) -> None:
    """Rewrite a log through `edit(index, env, msg) -> (env, msg) | None (drop)`."""
    w = LogWriter(dst)
    for k, (env, msg) in enumerate(LogReader(src).messages()):
        changed = edit(k, env, msg)
        if changed is not None:
            w.append(encode(changed[1], changed[0]), k)
    w.close()


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
async def live_log(tmp_path) -> pathlib.Path:
    n = await record_live_run(tmp_path / "log")
    # bus.* events (BusGap from prefix-filtered subscribers) are the transport's own
    assert (
        sum(1 for r in LogReader(tmp_path / "log").records() if not r.topic.startswith(b"bus."))
        == n
    )
    return tmp_path / "log"


@pytest.mark.anyio
async def test_identical_replay(live_log):
    result = replay(live_log, ACTOR)
    assert result.identical, result.report()
    assert result.num_inbox == 120 and result.num_outbox == result.num_produced == 80
    assert "identical" in result.report()


@pytest.mark.anyio
async def test_an_altered_core_is_caught_at_its_first_wrong_output(live_log):
    altered = CoreSpec(
        ACTOR, lambda cfg: build_core(cfg, bug_after=30), SPEC.inbox, ACTOR, SPEC.config
    )
    result = replay(live_log, altered)
    d = result.divergence
    assert d is not None and not result.identical
    # inbox #30 is the 31st message: StepResult 15 (inbox alternates result, tick)
    assert d.inbox_index == 30 and d.input.startswith("sched.result StepResult(step_id=15")
    assert d.expected.startswith("sched.tokens") and d.got.startswith("sched.tokens")
    assert d.index == 15 + 5  # 15 TokensOut and 5 stats (ticks 0, 3, ..., 12) before it
    assert any(line.startswith("outputs[0].token_ids[0]: expected") for line in d.differences)
    report = result.report()
    assert "FIRST DIVERGENCE at outbox index 20" in report and "expected:" in report


@pytest.mark.anyio
async def test_a_tampered_log_is_caught(live_log, tmp_path):
    def tamper(k, env, msg):
        if isinstance(msg, SchedulerStats) and msg.step_id == 20:  # the 4th stats report
            return env, SchedulerStats(
                **{**{f: getattr(msg, f) for f in msg.__struct_fields__}, "num_running": 99}
            )
        return env, msg

    copy_log(live_log, tmp_path / "tampered", tamper)
    d = replay(tmp_path / "tampered", ACTOR).divergence
    assert d is not None and d.inbox_index == 19 and d.index == 13
    assert d.differences == ["num_running: expected 99, got 8"]


@pytest.mark.anyio
async def test_a_missing_and_an_extra_output_are_caught(live_log, tmp_path):
    outbox = [(e, m) for e, m in LogReader(live_log).messages() if e.publisher_id == ACTOR]
    dropped = outbox[-1][0]  # the core will produce it; the log lacks it
    copy_log(live_log, tmp_path / "short", lambda k, e, m: None if e == dropped else (e, m))
    result = replay(tmp_path / "short", ACTOR)
    assert result.divergence.index == 79 and result.divergence.expected is None
    assert result.divergence.got is not None
    lenient = replay(tmp_path / "short", ACTOR, allow_short_recording=True)
    assert lenient.identical and lenient.num_unrecorded == 1

    extra = Envelope(ACTOR, 10_000, 0, 0)
    more = tmp_path / "more"
    copy_log(live_log, more, lambda k, e, m: (e, m))
    w = LogWriter(more)
    w.append(encode(TokensOut(999, []), extra), 0)
    w.close()
    d = replay(more, ACTOR).divergence
    assert (
        d.index == 80
        and d.got is None
        and d.expected.startswith("sched.tokens TokensOut(step_id=999")
    )


@pytest.mark.anyio
async def test_missing_config_message_is_a_clear_error(live_log, tmp_path):
    copy_log(
        live_log, tmp_path / "noconf", lambda k, e, m: None if isinstance(m, Ready) else (e, m)
    )
    with pytest.raises(
        LookupError, match=r"no message under \['health.ready'\] published by 'accumulator'"
    ):
        replay(tmp_path / "noconf", ACTOR)


def test_registry():
    # this module may be imported twice (test_busctl loads it by path): same contents
    assert registered()[ACTOR] is get_core(ACTOR)
    assert (get_core(ACTOR).inbox, get_core(ACTOR).config) == (SPEC.inbox, SPEC.config)
    with pytest.raises(KeyError, match=r"no replayable core named 'nope'; known: .*accumulator"):
        get_core("nope")
    with pytest.raises(ValueError, match="inbox needs at least one"):
        register_core("empty", build_core, inbox=())
    with pytest.raises(TypeError, match="is not a prefix or a Msg type"):
        CoreSpec("x", build_core, (3,), "x")
    # a type takes its exact topic only; a string is a prefix
    from shunter.bus.messages import DropTree

    by_type = CoreSpec("x", build_core, (DropTree, "sched."), "x")
    assert by_type.takes("cache.drop") and not by_type.takes("cache.dropped")
    assert by_type.takes("sched.tick")
    assert CoreSpec("x", build_core, ("cache.drop",), "x").takes("cache.dropped")


@pytest.mark.anyio
async def test_each_run_of_a_restarted_actor_replays_from_its_own_config(tmp_path):
    log = tmp_path / "log"
    await record_live_run(log, num_steps=20, offset=5)
    await record_live_run(log, num_steps=10, offset=9)  # a restart: a second Ready
    first, second = replay(log, ACTOR), replay(log, ACTOR, run=1)
    assert first.identical and second.identical, first.report() + second.report()
    assert (first.num_inbox, second.num_inbox) == (40, 20)
    with pytest.raises(LookupError, match="run 2 of 'accumulator' asked, the log has 2"):
        replay(log, ACTOR, run=2)


# --- the real scheduler and cache manager cores ------------------------------------
# Both run their own shells and replay registrations ("scheduler", "cache"); a model-free
# executor (the scheduler's SimExecutor) answers the batches.


async def serve_core(bus: Bus, core, inbox, config_msg, task_status=anyio.TASK_STATUS_IGNORED):
    """A minimal shell keeping the replay contract."""
    async with bus.subscribe(*inbox) as sub:
        if config_msg is not None:
            await bus.publish(config_msg)
        task_status.started()
        async for received in sub:
            for out in core.handle(received.msg):
                await bus.publish(out)


async def record_cluster(directory: pathlib.Path) -> None:
    from shunter.actors.cache_manager.actor import run as run_cache
    from shunter.actors.cache_manager.config import CacheConfig
    from shunter.actors.scheduler.actor import run as run_scheduler
    from shunter.actors.scheduler.config import SchedulerConfig
    from shunter.actors.scheduler.sim import SimExecutor, mix64
    from shunter.bus.messages import AbortRequest, ForwardBatch, SamplingParams, Tokenized

    num_pages = 192
    sched_cfg = SchedulerConfig(max_running_requests=6, max_prefill_tokens=48,
                                chunked_prefill_size=24, num_total_pages=num_pages)  # fmt: skip
    cache_cfg = CacheConfig(num_pages=num_pages, page_size=1)
    exe = SimExecutor(1, num_pages, lambda rid, pos: mix64(pos) % 1000 + 10)

    class ExecutorCore:
        def handle(self, msg):
            return [exe.handle(msg)] if isinstance(msg, ForwardBatch) else []

    hub = InProcHub()
    system = [1, 2, 3, 4, 5, 6, 7, 8] * 4  # a shared prefix the tree should serve
    reqs = [
        Tokenized(
            f"r{i}", system + [100 + i] * (3 + i % 5), SamplingParams(max_new_tokens=4 + i % 6)
        )
        for i in range(12)
    ]
    async with anyio.create_task_group() as tg:
        await tg.start(record, hub.connect("recorder"), directory)
        sched_run = functools.partial(run_scheduler, tick_interval_s=0.01)  # ticks recorded too
        await tg.start(sched_run, sched_cfg, hub.connect("scheduler"))
        await tg.start(run_cache, cache_cfg, hub.connect("cache"))
        await tg.start(
            serve_core, hub.connect("executor.0"), ExecutorCore(), ("sched.batch",), None
        )
        gateway = hub.connect("gateway")
        async with gateway.subscribe("sched.tokens", "req.failed") as outs:
            for t in reqs:
                await gateway.publish(t)
            await gateway.publish(AbortRequest("r11"))
            done: set[str] = set()
            with anyio.fail_after(20):
                while len(done) < len(reqs):
                    got = (await outs.receive()).msg
                    items = got.outputs if isinstance(got, TokensOut) else [got]
                    done |= {o.request_id for o in items if getattr(o, "finish_reason", "x")}
        await anyio.sleep(0.05)
        tg.cancel_scope.cancel()


@pytest.fixture
async def cluster_log(tmp_path) -> pathlib.Path:
    await record_cluster(tmp_path / "log")
    return tmp_path / "log"


@pytest.mark.anyio
async def test_real_scheduler_and_cache_cores_replay_identically(cluster_log):
    import msgspec

    from shunter.actors.scheduler.config import SchedulerConfig
    from shunter.actors.scheduler.core import SchedulerCore
    from shunter.bus.messages import Tick

    for name in ("scheduler", "cache"):  # found through their shells' registrations
        result = replay(cluster_log, name)
        assert result.identical, result.report()
        assert result.num_inbox > 20 and result.num_outbox > 20, result.report()
    assert any(isinstance(m, Tick) for _, m in LogReader(cluster_log).messages())

    # the same inbox under another chunk size plans other batches: caught
    def other_chunking(cfg):
        config = SchedulerConfig.from_json(cfg.config_json)
        return SchedulerCore(msgspec.structs.replace(config, chunked_prefill_size=16))

    sched = get_core("scheduler")
    other = CoreSpec("scheduler", other_chunking, sched.inbox, "scheduler", sched.config)
    d = replay(cluster_log, other).divergence
    assert d is not None and d.expected is not None and d.got is not None


@pytest.mark.anyio
async def test_a_core_that_raises_is_a_divergence_and_unknown_topics_are_skipped(
    live_log, tmp_path
):
    import msgspec

    def explode(cfg):
        core = build_core(cfg)
        inner = core.handle

        def handle(msg):
            if isinstance(msg, Tick) and msg.now_ns == 4:
                raise KeyError("row 9")
            return inner(msg)

        core.handle = handle
        return core

    d = replay(live_log, CoreSpec(ACTOR, explode, SPEC.inbox, ACTOR, SPEC.config)).divergence
    assert d.inbox_index == 9 and d.got == "<the core raised KeyError: 'row 9'>"
    assert d.expected.startswith("sched.tokens TokensOut(step_id=5")

    # a message this build does not know, from another publisher, does not stop a replay
    mixed = tmp_path / "mixed"
    copy_log(live_log, mixed, lambda k, e, m: (e, m))
    w = LogWriter(mixed)
    env = msgspec.msgpack.encode(Envelope("newer-actor", 0, 0, 0))
    w.append((b"future.topic", env, msgspec.msgpack.encode(["future.topic", 1])), 0)
    w.close()
    assert replay(mixed, ACTOR).identical
