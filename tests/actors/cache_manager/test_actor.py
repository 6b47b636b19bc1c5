"""The cache manager shell on the real in-process bus, recorded and replayed."""

from __future__ import annotations

import anyio
import pytest

from shunter.actors.cache_manager.actor import INBOX_TOPICS, run
from shunter.actors.cache_manager.config import CacheConfig
from shunter.bus.codec import encode
from shunter.bus.inproc import InProcHub
from shunter.bus.log import LogReader, LogWriter, record
from shunter.bus.messages import (
    AllBlocksCleared,
    BlockStored,
    Census,
    DropTree,
    FreeRefused,
    HealthPing,
    HealthPong,
    LeaseGranted,
    LeaseRequest,
    LeaseReturned,
    Matched,
    Ready,
    SamplingParams,
    SchedulerCensus,
    SequenceReleased,
    Tokenized,
    TreeDropped,
)
from shunter.bus.replay import replay

pytestmark = pytest.mark.anyio

SP = SamplingParams(max_new_tokens=4)
PROMPT = list(range(10, 30))


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def _drive(tmp_path):
    """Start recorder and cache actor; play one request's life; return what came back."""
    hub = InProcHub()
    driver, cache_bus, rec_bus = hub.connect("sched"), hub.connect("cache"), hub.connect("rec")
    cfg = CacheConfig(num_pages=8, page_size=4)
    got: list = []
    async with anyio.create_task_group() as tg:
        await tg.start(lambda task_status: record(rec_bus, tmp_path, task_status=task_status))
        async with driver.subscribe("cache.", "health.") as sub:
            await sub.wait_connected()
            core = await tg.start(lambda task_status: run(cfg, cache_bus, task_status=task_status))

            async def expect(n: int) -> list:
                out = []
                with anyio.fail_after(5):
                    while len(out) < n:
                        r = await sub.receive()
                        if r.envelope.publisher_id == "cache":
                            out.append(r.msg)
                got.extend(out)
                return out

            (ready,) = await expect(1)
            await driver.publish(Tokenized("a", PROMPT, SP))
            await driver.publish(LeaseRequest(1, 6))
            (m, g) = await expect(2)
            await driver.publish(SequenceReleased("a", PROMPT, g.pages))
            await driver.publish(LeaseReturned([g.pages[0]]))  # the tree's now: refused
            await driver.publish(SchedulerCensus(1, 1, 0, 0))
            await driver.publish(Tokenized("b", [*PROMPT, 1], SP))
            await driver.publish(HealthPing("p1", target="cache"))
            stored, refused, census, m2, pong = await expect(5)
            await driver.publish(SequenceReleased("b", [], [], "aborted"))
            await driver.publish(DropTree("flip-1"))
            cleared, dropped = await expect(2)
            stats = core.statistics()
            await anyio.sleep(0.1)  # the recorder's queue drains
        tg.cancel_scope.cancel()
    assert isinstance(ready, Ready) and ready.actor == "cache"
    assert CacheConfig.from_info(ready.info) == cfg
    assert isinstance(m, Matched) and m.num_cached_tokens == 0
    assert isinstance(g, LeaseGranted) and len(g.pages) == 6
    assert isinstance(stored, BlockStored) and stored.token_ids == PROMPT and stored.block_size == 4
    assert isinstance(refused, FreeRefused) and refused.pages == [g.pages[0]]
    assert isinstance(census, Census) and census.ok and census.cached_in_tree == 5
    assert census.free == 3
    assert isinstance(m2, Matched) and m2.num_cached_tokens == 20
    assert m2.prefix_pages == g.pages[:5]
    assert isinstance(pong, HealthPong) and pong.ping_id == "p1"
    assert isinstance(cleared, AllBlocksCleared)
    assert isinstance(dropped, TreeDropped) and dropped.ok and dropped.num_pages_reclaimed == 5
    assert stats.num_free == 8 and stats.num_requests == 0 and stats.num_free_refused == 1
    return got


async def test_actor_on_inproc_bus_and_replay(tmp_path):
    await _drive(tmp_path)
    result = replay(tmp_path, "cache")
    assert result.identical, result.report()
    # every inbox message was fed (the shell's own TreeDropped is under cache.drop too)
    assert result.num_inbox == 9
    assert result.num_outbox == result.num_produced == 7


def test_inbox_topics_do_not_catch_other_outputs():
    outs = ["cache.matched", "cache.lease.granted", "cache.census", "cache.error.census",
            "cache.error.free", "cache.kv.stored", "cache.kv.removed", "cache.kv.cleared"]  # fmt: skip
    for topic in outs:
        assert not topic.startswith(INBOX_TOPICS), topic


async def test_replay_catches_a_core_built_differently(tmp_path):
    """The same inbox against a core with one page less diverges at the first Census."""
    await _drive(tmp_path / "orig")
    w = LogWriter(tmp_path / "edited")
    for k, (env, msg) in enumerate(LogReader(tmp_path / "orig").messages()):
        if isinstance(msg, Ready) and env.publisher_id == "cache":
            msg = Ready(msg.actor, msg.actor_id, {**msg.info, "num_pages": 7})
        w.append(encode(msg, env), k)
    w.close()
    result = replay(tmp_path / "edited", "cache")
    d = result.divergence
    assert d is not None and d.index == 4  # Matched, LeaseGranted, BlockStored, FreeRefused
    assert "Census" in d.expected and "free=3" in d.expected.replace(" ", "")
