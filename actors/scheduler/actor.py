"""Scheduler shell: the bus on one side, `SchedulerCore` on the other.

Theory of operation
    `run(config, bus)` subscribes to the core's inbox topics (exact topics: INBOX_TOPICS)
    and to health pings, waits until the subscription is connected, publishes
    `SchedulerConfigured` (the config as JSON: what replay rebuilds the core from) and
    `Ready(actor="scheduler")`, then feeds the core every message in delivery order and
    publishes each output in order.

    Time reaches the core only as `Tick` messages, which this shell publishes on the bus
    every `tick_interval_s` and receives back through its own subscription like any
    other input: so they are recorded, and a replay sees them where the core did.
    Likewise, when a `Shutdown` with a drain timeout is not drained in time, the shell
    publishes `AbortRequest(reason="shutdown")` for every request still known; the core
    ends them when those come back in.

    `HealthPing(target="scheduler")` is answered from this loop (shell traffic under
    `health.`, not the core's outbox): a pong proves the loop that runs the core turns.

Replay
    Registered as "scheduler" with bus/replay.py: the core is rebuilt from the recorded
    `SchedulerConfigured` this actor published; its inbox is INBOX_TOPICS (Tick included).
    `busctl replay LOG --actor scheduler` checks a recording.

Invariants
    - The core sees exactly the subscription's delivery order; nothing else touches it.
    - SchedulerConfigured and Ready go out only after the subscription is connected, so
      no inbox message published after them is missed.
"""

from __future__ import annotations

import time

import anyio
import structlog

from shunter.actors.scheduler.config import SchedulerConfig
from shunter.actors.scheduler.core import INBOX_TYPES, SchedulerCore
from shunter.bus.messages import (
    AbortRequest,
    ForwardBatch,
    HealthPing,
    HealthPong,
    Msg,
    Ready,
    RequestFailed,
    SchedulerConfigured,
    Shutdown,
    Tick,
    topic_of,
)
from shunter.bus.replay import register_core
from shunter.bus.transport import Bus

CORE_INBOX = tuple(t for t in INBOX_TYPES if t is not SchedulerConfigured)
INBOX_TOPICS: tuple[str, ...] = tuple(topic_of(t) for t in CORE_INBOX)


async def run(
    config: SchedulerConfig,
    bus: Bus,
    *,
    actor_id: str | None = None,
    tick_interval_s: float = 0.25,
    task_status: anyio.abc.TaskStatus[SchedulerCore] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the scheduler until cancelled (or the bus closes). `actor_id` defaults to
    the bus's publisher id; replay looks for "scheduler" unless told otherwise."""
    if tick_interval_s <= 0:
        raise ValueError(f"tick_interval_s must be > 0, got {tick_interval_s}")
    actor_id = actor_id or bus.publisher_id  # the name it has on the bus, by default
    core = SchedulerCore(config)
    log = structlog.get_logger("shunter.scheduler").bind(actor="scheduler", actor_id=actor_id)
    types = (*CORE_INBOX, HealthPing)
    async with (
        bus.subscribe(*INBOX_TOPICS, topic_of(HealthPing), types=types) as sub,
        anyio.create_task_group() as tg,
    ):
        await sub.wait_connected()
        await bus.publish(SchedulerConfigured(actor_id, config.to_json()))
        info = {"max_running_requests": config.max_running_requests,
                "page_size": config.page_size, "policy": config.schedule_policy}  # fmt: skip
        await bus.publish(Ready(actor="scheduler", actor_id=actor_id, info=info))
        log.info("ready", policy=config.schedule_policy, page_size=config.page_size)
        task_status.started(core)
        tg.start_soon(_tick, bus, tick_interval_s)
        decode_log = _DecodeLog(config.decode_log_interval, log)
        async for received in sub:
            msg = received.msg
            if isinstance(msg, HealthPing):
                if msg.target == "scheduler":
                    await bus.publish(HealthPong(msg.ping_id, actor_id))
                continue
            if isinstance(msg, Shutdown) and msg.drain_timeout_s > 0:
                tg.start_soon(_abort_after, bus, core, msg.drain_timeout_s)
            for out in core.handle(msg):
                if isinstance(out, ForwardBatch):
                    decode_log.step(core)
                if isinstance(out, RequestFailed):
                    log.warning("request failed", request_id=out.request_id, code=out.code,
                                detail=out.message)  # fmt: skip
                await bus.publish(out)
        tg.cancel_scope.cancel()


class _DecodeLog:
    """--decode-log-interval: every `interval` batches a line with the running and
    queued requests, the KV pages in use and the tokens generated per second since the
    last line (the shell's clock; the core keeps none)."""

    def __init__(self, interval: int, log) -> None:
        self.interval = interval
        self.log = log
        self.num_batches = 0
        self.last = (time.monotonic(), 0)

    def step(self, core: SchedulerCore) -> None:
        self.num_batches += 1
        if not self.interval or self.num_batches % self.interval:
            return
        s = core.statistics()
        now, generated = time.monotonic(), s.num_generated_tokens
        t0, g0 = self.last
        self.last = (now, generated)
        total = core.config.num_total_pages
        used = s.num_held_pages + sum(r.num_tree_pages for r in core.running.values())
        self.log.info("decode batch", running=s.num_running, queued=s.num_waiting + s.num_retracted,
                      token_usage=round(used / total, 3) if total else None,
                      gen_tok_s=round((generated - g0) / (now - t0), 1) if now > t0 else None)  # fmt: skip


async def _tick(bus: Bus, interval_s: float) -> None:
    while True:
        await anyio.sleep(interval_s)
        await bus.publish(Tick(time.monotonic_ns()))


async def _abort_after(bus: Bus, core: SchedulerCore, drain_timeout_s: float) -> None:
    """A drain that did not finish in time: abort what is left, through the bus."""
    await anyio.sleep(drain_timeout_s)
    for rid in [*core.running, *core.waiting, *core.retracted]:
        await bus.publish(AbortRequest(rid, reason="shutdown"))


def _replay_factory(config: Msg | None) -> SchedulerCore:
    if not isinstance(config, SchedulerConfigured):
        raise ValueError(f"the scheduler core is built from SchedulerConfigured, got {config!r}")
    return SchedulerCore(SchedulerConfig.from_json(config.config_json))


register_core(
    "scheduler",
    _replay_factory,
    inbox=CORE_INBOX,
    actor_id="scheduler",
    config=(topic_of(SchedulerConfigured),),
)
