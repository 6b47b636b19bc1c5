"""Cache manager shell: the bus on one side, `CacheManagerCore` on the other.

Theory of operation
    `run(config, bus)` subscribes to the core's inbox topics (exact topics, see below),
    waits until the subscription is connected, publishes `Ready(actor="cache", info=
    config.to_info())`, then, with a file store, `StoreListed` of the blocks its
    directory holds, oldest first by modification time (executor/block_files.py's
    `list_keys`: the core reads no files; the listing reaches it through the bus, so a
    recording replays it; past the store's size cap the core evicts the oldest), and
    then feeds the core every message in delivery order, publishing each output in
    order. It answers `HealthPing(target="cache")` itself
    (shell traffic, under `health.`). Refused frees and broken censuses are also logged.

    `cache.drop` (DropTree, in) is a prefix of `cache.dropped` (TreeDropped, out), so the
    subscription also receives this actor's own TreeDropped; the shell skips it. The
    replay registration below does the same on both sides: TreeDropped is neither fed
    to nor compared from the core (everything else is).

Replay
    Registered as "cache" with bus/replay.py: the core is rebuilt from the recorded
    `Ready` this actor published (`CacheConfig.from_info(ready.info)`), its inbox is the
    topics in `INBOX_TOPICS`. `busctl replay LOG --actor cache` checks a recording.

Invariants
    - The core sees exactly the subscription's delivery order; nothing else touches it.
    - Ready is published only after the subscription is connected, so no inbox message
      published after Ready is missed.
"""

from __future__ import annotations

import anyio
import structlog

from shunter.actors.cache_manager.config import CacheConfig
from shunter.actors.cache_manager.core import INBOX_TYPES, CacheManagerCore
from shunter.actors.executor.block_files import list_keys
from shunter.bus.messages import (
    CensusBroken,
    FreeRefused,
    HealthPing,
    HealthPong,
    Msg,
    Ready,
    StoreListed,
    TreeDropped,
    topic_of,
)
from shunter.bus.replay import register_core
from shunter.bus.transport import Bus

INBOX_TOPICS: tuple[str, ...] = tuple(topic_of(t) for t in INBOX_TYPES)


async def run(
    config: CacheConfig,
    bus: Bus,
    *,
    task_status: anyio.abc.TaskStatus[CacheManagerCore] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the cache manager until cancelled (or the bus closes)."""
    core = CacheManagerCore(config)
    log = structlog.get_logger("shunter.cache").bind(actor="cache", actor_id=config.actor_id)
    types = (*INBOX_TYPES, TreeDropped, HealthPing)
    async with bus.subscribe(*INBOX_TOPICS, topic_of(HealthPing), types=types) as sub:
        await sub.wait_connected()
        await bus.publish(Ready(actor="cache", actor_id=config.actor_id, info=config.to_info()))
        log.info("ready", num_pages=config.num_pages, page_size=config.page_size)
        if config.store_block_tokens:
            keys = await anyio.to_thread.run_sync(
                lambda: list_keys(config.store_path, oldest_first=True)
            )
            log.info("file store", path=config.store_path, num_blocks=len(keys),
                     max_blocks=config.store_max_blocks or None)  # fmt: skip
            await bus.publish(StoreListed(keys))
        task_status.started(core)
        async for received in sub:
            msg = received.msg
            if isinstance(msg, TreeDropped):
                continue
            if isinstance(msg, HealthPing):
                if msg.target == "cache":
                    await bus.publish(HealthPong(msg.ping_id, config.actor_id))
                continue
            for out in core.handle(msg):
                if isinstance(out, FreeRefused | CensusBroken):
                    log.warning(topic_of(out), event_msg=out)
                await bus.publish(out)


class _ReplayCore:
    """The core as replay sees it: TreeDropped is skipped in and out (see docstring)."""

    def __init__(self, ready: Msg | None) -> None:
        if not isinstance(ready, Ready):
            raise ValueError(f"the cache core is built from its Ready message, got {ready!r}")
        self.core = CacheManagerCore(CacheConfig.from_info(ready.info, ready.actor_id))

    def handle(self, msg: Msg) -> list[Msg]:
        if isinstance(msg, TreeDropped):
            return []
        return [o for o in self.core.handle(msg) if not isinstance(o, TreeDropped)]


register_core(
    "cache",
    _ReplayCore,
    inbox=INBOX_TOPICS,
    actor_id="cache",
    config=(topic_of(Ready),),
)
