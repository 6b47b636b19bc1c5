"""One contract, two transports: the same assertions hold in-process and over ZMQ."""

from __future__ import annotations

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shunter.bus.codec import Frames, decode_envelope, decode_wire_envelope, encode
from shunter.bus.messages import (
    BusGap,
    DecodeFailed,
    Envelope,
    ForwardBatch,
    HealthPing,
    HealthPong,
    Heartbeat,
    LoadPages,
    PagesLoaded,
    Tick,
)
from shunter.bus.transport import Received

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


async def recv(sub, timeout_s: float = 5.0):
    with anyio.fail_after(timeout_s):
        return await sub.receive()


async def test_prefix_routing(connector):
    a, b = connector.connect("a"), connector.connect("b")
    sched = b.subscribe("sched.")
    everything = b.subscribe()
    await b.wait_connected()
    await a.wait_connected()
    await a.publish(Heartbeat("a", 1))
    await a.publish(Tick(now_ns=7))
    got = await recv(sched)
    assert got.topic == "sched.tick" and got.msg == Tick(now_ns=7)
    assert got.envelope.publisher_id == "a" and got.envelope.seq == 1
    assert [(await recv(everything)).msg for _ in range(2)] == [Heartbeat("a", 1), Tick(7)]
    with pytest.raises(anyio.WouldBlock):
        sched.receive_nowait()  # the heartbeat never reached the sched. subscription


async def test_types_without_prefixes_subscribe_to_exact_topics(connector):
    a, b = connector.connect("a"), connector.connect("b")
    sub = b.subscribe(types=(Tick, Heartbeat))
    assert sub.prefixes == ("sched.tick", "health.beat")
    await b.wait_connected()
    await a.wait_connected()
    await a.publish(HealthPing("p"))
    await a.publish(Tick(1))
    assert (await recv(sub)).msg == Tick(1)


async def test_a_typed_subscription_skips_topics_its_topics_are_a_prefix_of(connector):
    """LoadPages is `spill.load`, its reply PagesLoaded `spill.loaded`: an executor that
    subscribes by type gets the one and neither the other nor a DecodeFailed for it."""
    a, b = connector.connect("a"), connector.connect("b")
    sub = b.subscribe(types=(LoadPages,))
    for bus in connector.buses:
        await bus.wait_connected()
    await a.publish(PagesLoaded(1, [7]))
    await a.publish(LoadPages(2, [7], [0], [1]))
    assert (await recv(sub)).msg == LoadPages(2, [7], [0], [1])
    assert sub.statistics().num_decode_failed == 0


async def test_received_objects_are_fresh_copies(connector):
    a, b = connector.connect("a"), connector.connect("b")
    sub = b.subscribe(types=(ForwardBatch,))
    await b.wait_connected()
    await a.wait_connected()
    batch = ForwardBatch(step_id=3, rows=[0, 1], input_ids=[5, -1])
    await a.publish(batch)
    got = await recv(sub)
    assert isinstance(got, Received)
    assert got.msg == batch and got.msg is not batch


async def test_undecodable_message_becomes_decode_failed_event(connector):
    a, b = connector.connect("a"), connector.connect("b")
    events = connector.connect("watch").subscribe(types=(DecodeFailed,))
    inbox = b.subscribe("sched.", types=(ForwardBatch,))
    for bus in connector.buses:
        await bus.wait_connected()
    await a.publish(Tick(now_ns=1))  # matches the prefix, not the types
    await a.publish(ForwardBatch(step_id=9))
    got = await recv(inbox)
    assert got.msg == ForwardBatch(step_id=9)  # the subscriber kept going
    event = (await recv(events)).msg
    assert event == DecodeFailed("b", "sched.tick", event.error)
    assert "sched.tick" in event.error
    stats = inbox.statistics()
    assert stats.num_decode_failed == 1 and stats.num_received == 1


async def test_garbage_body_is_reported_not_fatal(connector):
    a, b = connector.connect("a"), connector.connect("b")
    events = b.subscribe(types=(DecodeFailed,))
    inbox = b.subscribe("sched.", types=(Tick,))
    await b.wait_connected()
    await a.wait_connected()
    env = a.stamp()
    await a.publish_frames(Frames(b"sched.tick", encode(Tick(0), env).envelope, b"\xc1junk"))
    await a.publish(Tick(now_ns=2))
    assert (await recv(inbox)).msg == Tick(2)
    assert (await recv(events)).msg.topic == "sched.tick"


async def test_order_per_publisher(connector):
    a, c = connector.connect("a"), connector.connect("c")
    b = connector.connect("b")
    sub = b.subscribe(types=(Heartbeat,))
    for bus in connector.buses:
        await bus.wait_connected()
    n = 300

    async def send(bus, name):
        for i in range(n):
            await bus.publish(Heartbeat(name, i))
            if i % 37 == 0:
                await anyio.sleep(0)

    async with anyio.create_task_group() as tg:
        tg.start_soon(send, a, "a")
        tg.start_soon(send, c, "c")
    seen: dict[str, list[int]] = {"a": [], "c": []}
    seqs: dict[str, list[int]] = {"a": [], "c": []}
    for _ in range(2 * n):
        got = await recv(sub)
        seen[got.msg.actor_id].append(got.msg.beat)
        seqs[got.envelope.publisher_id].append(got.envelope.seq)
    assert seen == {"a": list(range(n)), "c": list(range(n))}
    assert seqs == {"a": list(range(n)), "c": list(range(n))}
    assert sub.statistics().num_gaps == 0


async def test_request_reply(connector):
    client, server = connector.connect("gateway"), connector.connect("scheduler")
    pings = server.subscribe(types=(HealthPing,))
    await server.wait_connected()
    await client.wait_connected()

    async def serve():
        async for got in pings:
            await server.publish(HealthPong("other", "scheduler"))  # not the one asked for
            await server.publish(HealthPong(got.msg.ping_id, "scheduler"))

    async with anyio.create_task_group() as tg:
        tg.start_soon(serve)
        reply = await client.request(
            HealthPing("p7"), reply=HealthPong, match=lambda m: m.ping_id == "p7", timeout_s=5
        )
        assert reply == HealthPong("p7", "scheduler")
        with pytest.raises(TimeoutError):
            await client.request(
                HealthPing("p8"), reply=HealthPong, match=lambda m: False, timeout_s=0.2
            )
        tg.cancel_scope.cancel()
    assert client.statistics().num_subscriptions == 0  # request subscriptions are closed


async def test_slow_subscriber_loses_nothing(connector):
    a, b = connector.connect("a"), connector.connect("b", max_queue=8)
    sub = b.subscribe(types=(Heartbeat,))
    await b.wait_connected()
    await a.wait_connected()
    n = 200
    max_seen_queued = 0

    async def produce():
        for i in range(n):
            await a.publish(Heartbeat("a", i))

    got = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(produce)
        while len(got) < n:
            if len(got) % 20 == 0:
                await anyio.sleep(0.005)  # slow consumer
            max_seen_queued = max(max_seen_queued, sub.statistics().num_queued)
            got.append((await recv(sub)).msg.beat)
    assert got == list(range(n))
    assert sub.statistics().num_gaps == 0
    if connector.transport == "inproc":  # in-process, publishers wait for room
        assert max_seen_queued <= 8


async def test_inproc_publisher_waits_when_subscriber_full():
    from shunter.bus.inproc import InProcHub

    hub = InProcHub(max_queue=2)
    a, b = hub.connect("a"), hub.connect("b")
    sub = b.subscribe(types=(Tick,))
    await a.publish(Tick(0))
    a.publish_nowait(Tick(1))
    with pytest.raises(anyio.WouldBlock):
        a.publish_nowait(Tick(2))
    done = anyio.Event()

    async def blocked():
        await a.publish(Tick(2))
        done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(blocked)
        await anyio.wait_all_tasks_blocked()
        assert not done.is_set()  # waiting for room, not dropped
        assert (await sub.receive()).msg == Tick(0)
        await done.wait()
    assert [sub.receive_nowait().msg for _ in range(2)] == [Tick(1), Tick(2)]
    with pytest.raises(ValueError, match="already connected"):
        hub.connect("a")


async def test_close_semantics(connector):
    a, b = connector.connect("a"), connector.connect("b")
    sub = b.subscribe(types=(Tick,))
    other = b.subscribe(types=(Tick,))
    await b.wait_connected()
    await a.wait_connected()
    await sub.aclose()
    async for _ in sub:
        raise AssertionError("a closed subscription yields nothing")
    ended = anyio.Event()

    async def consume():
        async for _ in other:
            pass
        ended.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        await anyio.sleep(0.01)
        await b.aclose()  # ends the pending iteration cleanly
        with anyio.fail_after(5):
            await ended.wait()
    assert b.statistics().closed and b.statistics().num_subscriptions == 0
    with pytest.raises(anyio.ClosedResourceError):
        await b.publish(Tick(1))
    with pytest.raises(anyio.ClosedResourceError):
        b.subscribe("sched.")
    await a.publish(Tick(1))  # other buses are unaffected


async def test_gap_is_detected_and_published(connector):
    a, b = connector.connect("a"), connector.connect("b")
    gaps = connector.connect("watch").subscribe(types=(BusGap,))
    sub = b.subscribe(types=(Tick,))
    raw = b.subscribe_raw("sched.")
    for bus in connector.buses:
        await bus.wait_connected()
    await a.publish(Tick(0))  # topic seq 0 on sched.tick
    await a.publish_frames(encode(Tick(6), a.stamp(), topic_seq=6))  # 1..5 never sent
    assert (await recv(sub)).msg == Tick(0)
    assert (await recv(sub)).msg == Tick(6)
    stats = sub.statistics()
    assert (stats.num_gaps, stats.num_lost) == (1, 5)
    assert (await recv(gaps)).msg == BusGap("b", "a", 1, 6)
    frames = [await recv(raw) for _ in range(2)]
    assert [decode_wire_envelope(f.envelope).topic_seq for f in frames] == [0, 6]
    assert [decode_envelope(f.envelope).seq for f in frames] == [0, 1]
    assert raw.statistics().num_gaps == 1
    # a publisher that restarts (seqs back to 0) resets the baseline, no gap event
    await a.publish_frames(encode(Tick(7), Envelope("a", 0, 0, 0), topic_seq=0))
    assert (await recv(sub)).msg == Tick(7)
    assert sub.statistics().num_seq_resets == 1 and sub.statistics().num_gaps == 1


async def test_prefix_subscriptions_see_no_false_gaps(connector):
    """A publisher's seq jumps for a subscription that filters out some of its topics;
    the per-topic seq does not, so no gap is reported."""
    a, b = connector.connect("a"), connector.connect("b")
    ticks = b.subscribe(types=(Tick,))
    sched = b.subscribe("sched.")
    for bus in connector.buses:
        await bus.wait_connected()
    for i in range(20):
        await a.publish(Heartbeat("a", i))
        await a.publish(Tick(i))
        await a.publish(ForwardBatch(step_id=i))
    got = [(await recv(ticks)) for _ in range(20)]
    assert [r.msg.now_ns for r in got] == list(range(20))
    assert [r.envelope.seq for r in got] == list(range(1, 60, 3))  # seq jumps by 3
    assert [(await recv(sched)).msg for _ in range(40)][:2] == [Tick(0), ForwardBatch(step_id=0)]
    for sub in (ticks, sched):
        assert sub.statistics().num_gaps == 0 and sub.statistics().num_lost == 0


async def test_frames_without_topic_seq_are_checked_per_publisher(connector):
    a, b = connector.connect("a"), connector.connect("b")
    sub = b.subscribe(types=(Tick,))
    await b.wait_connected()
    await a.wait_connected()
    await a.publish_frames(encode(Tick(1), Envelope("x", 10, 0, 0)))
    await a.publish_frames(encode(Tick(2), Envelope("x", 13, 0, 0)))
    assert [(await recv(sub)).msg for _ in range(2)] == [Tick(1), Tick(2)]
    assert (sub.statistics().num_gaps, sub.statistics().num_lost) == (1, 2)


async def test_bad_arguments_are_clear_errors(connector):
    a = connector.connect("a")
    with pytest.raises(ValueError, match="reserved"):
        a.subscribe("\x00probe")
    with pytest.raises(TypeError):
        a.subscribe(b"sched.")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        a.subscribe(types=(int,))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not a bus message"):
        await a.publish("hello")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        await a.publish(Heartbeat("a", object()))  # type: ignore[arg-type]  # unencodable
    assert a.stamp().seq == 0  # the failed publishes took no seq: no false gap follows
    with pytest.raises(ValueError, match="timeout_s"):
        await a.request(Tick(0), reply=Tick, match=lambda m: True, timeout_s=0)


async def test_receive_many_drains_what_is_queued(connector):
    a, b = connector.connect("a"), connector.connect("b")
    sub = b.subscribe(types=(Heartbeat,))
    await b.wait_connected()
    await a.wait_connected()
    for i in range(10):
        await a.publish(Heartbeat("a", i))
    got: list[int] = []
    with anyio.fail_after(5):
        while len(got) < 10:
            batch = await sub.receive_many(4)
            assert 1 <= len(batch) <= 4
            got += [r.msg.beat for r in batch]
    assert got == list(range(10))
    with pytest.raises(ValueError):
        await sub.receive_many(0)
    with pytest.raises(ValueError, match="message tag"):
        await a.publish_frames(Frames(b"\x00probe/x", b"", b""))


_TOPIC_MSGS = {
    "health.beat": lambda i: Heartbeat("x", i),
    "sched.tick": lambda i: Tick(i),
    "sched.batch": lambda i: ForwardBatch(step_id=i),
}


@settings(max_examples=25, deadline=None)
@given(
    plan=st.lists(
        st.tuples(st.integers(0, 2), st.sampled_from(sorted(_TOPIC_MSGS))), max_size=60
    ),
    prefixes=st.lists(st.sampled_from(["", "sched.", "sched.tick", "health."]), min_size=1,
                      max_size=3),
    max_queue=st.integers(1, 5),
)  # fmt: skip
def test_inproc_delivers_exactly_the_matching_messages_in_order(plan, prefixes, max_queue):
    """Any mix of publishers and topics, tiny queues, consumers at different paces: each
    subscription gets exactly what matches its prefix, in publish order, without gaps."""
    from shunter.bus.inproc import InProcHub

    async def main():
        hub = InProcHub(max_queue=max_queue)
        pubs = [hub.connect(f"p{i}") for i in range(3)]
        sink = hub.connect("sink")
        subs = [sink.subscribe(p) for p in prefixes]
        expected = [
            [(f"p{i}", topic, n) for n, (i, topic) in enumerate(plan) if topic.startswith(p)]
            for p in prefixes
        ]
        got: list[list] = [[] for _ in subs]

        async def consume(k):
            while len(got[k]) < len(expected[k]):
                r = await subs[k].receive()
                got[k].append((r.envelope.publisher_id, r.topic, _number(r.msg)))
                for _ in range(k):
                    await anyio.sleep(0)  # later subscriptions are slower

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for k in range(len(subs)):
                    tg.start_soon(consume, k)
                for n, (i, topic) in enumerate(plan):
                    await pubs[i].publish(_TOPIC_MSGS[topic](n))
        assert got == expected
        for sub in subs:
            s = sub.statistics()
            assert s.num_gaps == 0 and s.num_queued == 0 and s.num_decode_failed == 0

    anyio.run(main)


def _number(msg) -> int:
    return {Heartbeat: lambda m: m.beat, Tick: lambda m: m.now_ns,
            ForwardBatch: lambda m: m.step_id}[type(msg)](msg)  # fmt: skip
