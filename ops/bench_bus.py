"""`shunter bench bus`: what the bus costs per message.

Measures, in order:
  1. codec: encode (frames + envelope) and typed decode of the decode-step ForwardBatch
     of `--num-rows` running requests (page size 1: each row appends one page; input ids
     are LAST_SAMPLED, as the overlapped scheduler sends them);
  2. in-process bus: one-way latency (publish -> the subscriber holds the decoded
     message) one message at a time, and throughput of small messages;
  3. ZMQ over ipc:// through a broker running as a separate process (as in a
     multi-process deployment), publisher and subscriber on separate sockets of
     separate buses in this process: the same two figures.

Latency is measured from the publisher's envelope stamp (monotonic ns, taken just
before encoding) to the moment the subscriber's `receive()` returns the decoded
message, so it includes encode, transport and decode. Prints human lines, then a JSON
summary as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import anyio

from shunter.bus.codec import Decoder, decode_envelope, encode
from shunter.bus.inproc import InProcHub
from shunter.bus.messages import LAST_SAMPLED, Envelope, ForwardBatch, Heartbeat
from shunter.bus.transport import Bus


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-rows", type=int, default=256, help="requests in the decode batch")
    p.add_argument("--num-codec-iters", type=int, default=3000)
    p.add_argument("--num-latency-msgs", type=int, default=5000)
    p.add_argument("--num-throughput-msgs", type=int, default=100_000)
    p.add_argument("--skip-zmq", action="store_true", help="in-process figures only")


def decode_batch(num_rows: int, step_id: int = 1000) -> ForwardBatch:
    """The steady-state decode step of num_rows requests with page size 1."""
    return ForwardBatch(
        step_id=step_id,
        rows=list(range(num_rows)),
        num_new_tokens=[1] * num_rows,
        start_pos=[300 + 7 * r for r in range(num_rows)],
        input_ids=[LAST_SAMPLED] * num_rows,
        new_pages=[100_000 + 997 * r for r in range(num_rows)],
        num_new_pages=[1] * num_rows,
        sample=[True] * num_rows,
    )


def bench_codec(num_rows: int, num_iters: int) -> dict[str, float]:
    batch = decode_batch(num_rows)
    decoder = Decoder(types=(ForwardBatch,))
    env = Envelope("scheduler", 0, time.monotonic_ns(), time.time_ns())
    enc_ns, dec_ns = [], []
    cpu0 = time.thread_time_ns()
    for _ in range(num_iters):
        t0 = time.perf_counter_ns()
        frames = encode(batch, env)
        t1 = time.perf_counter_ns()
        decode_envelope(frames.envelope)
        out = decoder.decode(frames.body)
        t2 = time.perf_counter_ns()
        enc_ns.append(t1 - t0)
        dec_ns.append(t2 - t1)
    # CPU time per round trip: what the figure would be without other processes
    # preempting this one (the wall-clock medians include that on a shared machine).
    cpu_us = (time.thread_time_ns() - cpu0) / num_iters / 1e3
    assert out == batch
    enc_us, dec_us = statistics.median(enc_ns) / 1e3, statistics.median(dec_ns) / 1e3
    return {
        "encode_us": enc_us,
        "decode_us": dec_us,
        "encode_decode_us": enc_us + dec_us,
        "encode_decode_cpu_us": cpu_us,
        "batch_bytes": float(sum(len(f) for f in frames)),
    }


def _pct(values: list[int], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] / 1e3


async def _latency(pub: Bus, sub_bus: Bus, n: int) -> tuple[float, float]:
    sub = sub_bus.subscribe(types=(Heartbeat,))
    await sub_bus.wait_connected()
    await pub.wait_connected()
    lat_ns = []
    msg = Heartbeat("bench", 0)
    for i in range(n + n // 10):  # the first tenth warms up
        await pub.publish(msg)
        got = await sub.receive()
        if i >= n // 10:
            lat_ns.append(time.monotonic_ns() - got.envelope.mono_ns)
    await sub.aclose()
    return _pct(lat_ns, 0.50), _pct(lat_ns, 0.99)


async def _throughput(pub: Bus, sub_bus: Bus, n: int, *, batched: bool) -> tuple[float, float]:
    """Small messages per second from one publisher to one subscriber. batched: the
    consumer drains its queue with receive_many (as an actor loop does), else it awaits
    receive() once per message. Returns (per wall second, per CPU second of this
    thread); the second is what an uncontended core gives in-process, where publisher
    and subscriber share this thread."""
    sub = sub_bus.subscribe(types=(Heartbeat,))
    await sub_bus.wait_connected()
    await pub.wait_connected()
    msg = Heartbeat("bench", 1)
    done = anyio.Event()

    async def consume() -> None:
        num_received = 0
        while num_received < n:
            if batched:
                num_received += len(await sub.receive_many(1024))
            else:
                await sub.receive()
                num_received += 1
        done.set()

    t0, cpu0 = time.perf_counter(), time.thread_time()
    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        for i in range(n):
            await pub.publish(msg)
            if i % 512 == 511:
                await anyio.sleep(0)  # let the consumer run (ZMQ never makes us wait)
        await done.wait()
    elapsed, cpu_s = time.perf_counter() - t0, time.thread_time() - cpu0
    await sub.aclose()
    return n / elapsed, n / cpu_s


async def bench_inproc(args: argparse.Namespace) -> dict[str, float]:
    hub = InProcHub()
    pub, sub_bus = hub.connect("bench.pub"), hub.connect("bench.sub")
    p50, p99 = await _latency(pub, sub_bus, args.num_latency_msgs)
    n = args.num_throughput_msgs
    rate, rate_cpu = await _throughput(pub, sub_bus, n, batched=True)
    rate_single, _ = await _throughput(pub, sub_bus, n, batched=False)
    return {
        "inproc_p50_us": p50,
        "inproc_p99_us": p99,
        "inproc_msgs_per_s": rate,
        "inproc_msgs_per_s_cpu": rate_cpu,
        "inproc_msgs_per_s_unbatched": rate_single,
    }


async def bench_zmq(args: argparse.Namespace) -> dict[str, float]:
    from shunter.bus.zmq_transport import ZmqBus, default_endpoints

    run_dir = tempfile.mkdtemp(prefix="shbench-", dir="/tmp")
    eps = default_endpoints(run_dir)
    broker = subprocess.Popen(
        [sys.executable, "-m", "shunter.bus.broker", "--frontend", eps.frontend,
         "--backend", eps.backend],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        if not broker.stdout.readline():
            raise RuntimeError("the broker process did not start")
        pub, sub_bus = ZmqBus("bench.pub", eps), ZmqBus("bench.sub", eps)
        try:
            p50, p99 = await _latency(pub, sub_bus, args.num_latency_msgs)
            n = max(1000, args.num_throughput_msgs // 2)
            rate, _ = await _throughput(pub, sub_bus, n, batched=True)
        finally:
            await pub.aclose()
            await sub_bus.aclose()
    finally:
        broker.terminate()
        broker.wait(10)
        shutil.rmtree(run_dir, ignore_errors=True)
    return {"zmq_ipc_p50_us": p50, "zmq_ipc_p99_us": p99, "zmq_ipc_msgs_per_s": rate}


def run(args: argparse.Namespace) -> int:
    if args.num_rows < 1 or min(args.num_codec_iters, args.num_latency_msgs) < 10:
        print("bench bus: --num-rows >= 1 and iteration counts >= 10", file=sys.stderr)
        return 2
    load = os.getloadavg()[0]
    print(f"bus bench: {os.cpu_count()} cpus, load average {load:.2f}")
    summary: dict[str, float] = {"num_rows": float(args.num_rows), "load_avg_1m": load}
    codec = bench_codec(args.num_rows, args.num_codec_iters)
    summary |= codec
    print(
        f"codec   ForwardBatch x{args.num_rows} rows ({codec['batch_bytes']:.0f} B): "
        f"encode {codec['encode_us']:.1f} us + decode {codec['decode_us']:.1f} us "
        f"= {codec['encode_decode_us']:.1f} us (median wall; "
        f"{codec['encode_decode_cpu_us']:.1f} us CPU time)"
    )
    inproc = anyio.run(bench_inproc, args)
    summary |= inproc
    print(
        f"inproc  one-way p50 {inproc['inproc_p50_us']:.1f} us  p99 "
        f"{inproc['inproc_p99_us']:.1f} us   {inproc['inproc_msgs_per_s']:,.0f} msgs/s "
        f"(receive_many; {inproc['inproc_msgs_per_s_cpu']:,.0f} per CPU second; "
        f"{inproc['inproc_msgs_per_s_unbatched']:,.0f} with one receive() per message)"
    )
    if not args.skip_zmq:
        zmq_figs = anyio.run(bench_zmq, args)
        summary |= zmq_figs
        print(
            f"zmq ipc one-way p50 {zmq_figs['zmq_ipc_p50_us']:.1f} us  p99 "
            f"{zmq_figs['zmq_ipc_p99_us']:.1f} us   {zmq_figs['zmq_ipc_msgs_per_s']:,.0f} msgs/s"
            "   (broker in its own process)"
        )
    print(json.dumps({k: round(v, 2) for k, v in summary.items()}))
    return 0
