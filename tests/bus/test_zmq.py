"""ZMQ specifics: the broker as its own process, endpoint rules, barrier, malformed frames."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import anyio
import pytest
import zmq

from shunter.bus.broker import Broker
from shunter.bus.codec import encode
from shunter.bus.messages import DecodeFailed, Heartbeat, Tick
from shunter.bus.zmq_transport import BusEndpoints, ZmqBus, default_endpoints

pytestmark = pytest.mark.timeout(60)


async def recv(sub, timeout_s: float = 5.0):
    with anyio.fail_after(timeout_s):
        return await sub.receive()


def start_broker_process(*args: str) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "shunter.bus.broker", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    line = proc.stdout.readline()
    if not line:
        proc.wait(10)
        raise AssertionError(f"broker failed: {proc.stderr.read()}")
    return proc, json.loads(line)


@pytest.mark.anyio
async def test_broker_process_carries_traffic_and_stops_on_sigterm(ipc_dir):
    eps = default_endpoints(ipc_dir)
    proc, ready = start_broker_process("--frontend", eps.frontend, "--backend", eps.backend)
    try:
        assert ready == {"event": "broker_ready", "frontend": eps.frontend, "backend": eps.backend}
        async with ZmqBus("a", eps) as a, ZmqBus("b", eps) as b:
            sub = b.subscribe(types=(Heartbeat,))
            await b.wait_connected()
            await a.wait_connected()
            for i in range(50):
                await a.publish(Heartbeat("a", i))
            assert [(await recv(sub)).msg.beat for _ in range(50)] == list(range(50))
        # a second broker on the same live endpoints is refused, not silently stolen
        again = subprocess.run(
            [sys.executable, "-m", "shunter.bus.broker", "--frontend", eps.frontend,
             "--backend", eps.backend],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert again.returncode == 2 and "already listening" in again.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0


def test_broker_refuses_live_endpoint_and_stale_file_is_fine(ipc_dir):
    eps = default_endpoints(ipc_dir)
    with Broker(*eps), pytest.raises(RuntimeError, match="already listening"):
        Broker(*eps).start()
    with Broker(*eps) as b:  # the stopped broker left its socket files behind
        assert b.endpoints == eps


def test_endpoint_rules():
    with pytest.raises(ValueError, match="unauthenticated TCP"):
        Broker("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    with pytest.raises(ValueError, match="unauthenticated TCP"):
        ZmqBus("a", BusEndpoints("tcp://127.0.0.1:5555", "tcp://127.0.0.1:5556"))
    with pytest.raises(ValueError, match="scheme"):
        ZmqBus("a", BusEndpoints("udp://x", "udp://y"))
    with pytest.raises(ValueError, match="bad bus endpoint"):
        Broker("127.0.0.1:5555", "ipc:///tmp/x")
    with pytest.raises(ValueError, match="InProcHub"):
        Broker("inproc://a", "inproc://b")
    with pytest.raises(ValueError, match="too long"):
        default_endpoints("/tmp/" + "d" * 120)


@pytest.mark.anyio
async def test_insecure_tcp_works_only_when_allowed():
    with Broker("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", allow_insecure_tcp=True) as broker:
        assert broker.frontend.startswith("tcp://127.0.0.1:") and not broker.frontend.endswith("*")
        async with (
            ZmqBus("a", broker.endpoints, allow_insecure_tcp=True) as a,
            ZmqBus("b", broker.endpoints, allow_insecure_tcp=True) as b,
        ):
            sub = b.subscribe(types=(Tick,))
            await b.wait_connected()
            await a.wait_connected()
            await a.publish(Tick(11))
            assert (await recv(sub)).msg == Tick(11)


@pytest.mark.anyio
async def test_wait_connected_times_out_without_broker(ipc_dir):
    async with ZmqBus("lonely", default_endpoints(ipc_dir)) as bus:
        bus.subscribe("sched.")
        with pytest.raises(TimeoutError):
            await bus.wait_connected(timeout_s=0.3)


@pytest.mark.anyio
async def test_barrier_keeps_traffic_and_hides_probes(broker):
    """Messages that arrive while a subscription is still probing are kept (no gap), and
    probe frames never reach a subscription to everything."""
    a, b = ZmqBus("a", broker.endpoints), ZmqBus("b", broker.endpoints)
    try:
        await a.wait_connected()
        stop = anyio.Event()

        async def stream():
            i = 0
            while not stop.is_set():
                await a.publish(Heartbeat("a", i))
                i += 1
                await anyio.sleep(0.0002)

        async with anyio.create_task_group() as tg:
            tg.start_soon(stream)
            everything = b.subscribe()
            await b.wait_connected()
            beats = [(await recv(everything)).msg.beat for _ in range(30)]
            stop.set()
        assert beats == list(range(beats[0], beats[0] + 30))
        stats = everything.statistics()
        assert stats.num_gaps == 0 and stats.num_decode_failed == 0
    finally:
        await a.aclose()
        await b.aclose()


@pytest.mark.anyio
async def test_malformed_frames_from_a_foreign_socket_become_events(broker):
    b = ZmqBus("b", broker.endpoints)
    ctx = zmq.Context.instance()
    rogue = ctx.socket(zmq.PUB)
    rogue.connect(broker.frontend)
    try:
        sub = b.subscribe("sched.", types=(Tick,))
        events = b.subscribe(types=(DecodeFailed,))
        await b.wait_connected()
        good = encode(Tick(5), b.stamp())
        with anyio.fail_after(5):
            while True:  # the rogue socket has no barrier of its own: resend until seen
                rogue.send_multipart([b"sched.tick", b"only-two-frames"])
                rogue.send_multipart(list(good))
                got = await recv(sub)
                if got.msg == Tick(5):
                    break
        event = (await recv(events)).msg
        assert event.subscriber_id == "b" and event.topic == "sched.tick"
        assert "envelope" in event.error
        assert sub.statistics().num_decode_failed >= 1
    finally:
        rogue.close(0)
        await b.aclose()


def test_bench_bus_prints_a_json_summary_last():
    out = subprocess.run(
        [sys.executable, "-m", "shunter.ops.cli", "bench", "bus", "--num-codec-iters", "50",
         "--num-latency-msgs", "100", "--num-throughput-msgs", "2000"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    for key in ("encode_decode_us", "zmq_ipc_p50_us", "zmq_ipc_p99_us", "inproc_msgs_per_s",
                "zmq_ipc_msgs_per_s", "inproc_p50_us", "inproc_p99_us"):  # fmt: skip
        assert summary[key] > 0, key
    assert summary["zmq_ipc_p50_us"] <= summary["zmq_ipc_p99_us"]
    assert any(line.startswith("codec") for line in lines[:-1])


@pytest.mark.heavy
@pytest.mark.anyio
async def test_soak_many_publishers_through_a_broker_process(ipc_dir):
    """Four publishers flood one broker process; two subscribers see every message of
    every publisher, in order, with no gap."""
    eps = default_endpoints(ipc_dir)
    proc, _ = start_broker_process("--frontend", eps.frontend, "--backend", eps.backend)
    n, pubs = 20_000, [ZmqBus(f"p{i}", eps) for i in range(4)]
    sink = ZmqBus("sink", eps)
    try:
        subs = [sink.subscribe(types=(Heartbeat,)), sink.subscribe("health.")]
        await sink.wait_connected()
        for p in pubs:
            await p.wait_connected()

        async def flood(bus):
            for i in range(n):
                await bus.publish(Heartbeat(bus.publisher_id, i))
                if i % 1000 == 0:
                    await anyio.sleep(0)

        async def drain(sub, out):
            while len(out) < n * len(pubs):
                out += await sub.receive_many(1024)

        outs: list[list] = [[], []]
        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for p in pubs:
                    tg.start_soon(flood, p)
                for sub, out in zip(subs, outs):
                    tg.start_soon(drain, sub, out)
        for sub, out in zip(subs, outs):
            by_pub: dict[str, list[int]] = {}
            for r in out:
                by_pub.setdefault(r.msg.actor_id, []).append(r.msg.beat)
            assert by_pub == {p.publisher_id: list(range(n)) for p in pubs}
            assert sub.statistics().num_gaps == 0
    finally:
        for bus in (*pubs, sink):
            await bus.aclose()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0


@pytest.mark.anyio
async def test_a_message_handed_to_a_cancelled_receive_is_kept(broker):
    """The socket reader hands a message to the waiting receive; if that receive is
    cancelled before it runs again (asyncio.wait_for timing out, say), the message must
    not be lost. (anyio's scopes never cancel a task whose wait is already done.)"""
    import asyncio

    bus = ZmqBus("b", broker.endpoints)
    try:
        sub = bus.subscribe(types=(Tick,))
        await bus.wait_connected()
        task = asyncio.ensure_future(sub.receive())
        await anyio.wait_all_tasks_blocked()
        frames = list(encode(Tick(9), bus.stamp(), topic_seq=0))
        sub._source._waiter.set_result(frames)  # what the socket reader does
        task.cancel()  # ... and the receive is cancelled before it resumes
        with pytest.raises(asyncio.CancelledError):
            await task
        assert sub.receive_nowait().msg == Tick(9)
    finally:
        await bus.aclose()
