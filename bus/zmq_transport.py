"""The ZMQ transport: one PUB socket per bus, one SUB socket per subscription, a broker
(bus/broker.py) in between.

Theory of operation:
    `publish` stamps and sends synchronously on the PUB socket (with SNDHWM 0 a PUB
    send never waits), so seq order is send order. Each subscription owns a SUB socket filtered by its prefixes,
    plus a private probe topic (NUL-prefixed, never a message tag).

    Slow joiners: ZMQ connects in the background, and a SUB socket gets nothing the
    broker forwarded before the broker saw its subscription. `wait_connected` sends
    probe frames on the bus's own PUB until the subscription receives its own probe
    back through the broker. Then the broker holds this subscription (so anything it
    forwards from now on reaches it) and the bus's PUB is connected (so what it
    publishes reaches the broker). Frames received meanwhile are kept, not dropped.

    Nothing is dropped: SNDHWM/RCVHWM are 0 and the broker sets XPUB_NODROP. ZMQ has
    no end-to-end backpressure without head-of-line blocking every topic at the broker,
    so on this transport a slow subscriber's backlog queues in memory instead of making
    publishers wait (the in-process transport does make them wait).

    tcp:// needs CURVE keys (`CurveClient`) unless `allow_insecure_tcp=True`.
"""

from __future__ import annotations

import asyncio
import collections
import os
import pathlib
import tempfile
import uuid

import anyio
import msgspec
import zmq

from shunter.bus.codec import CONTROL_PREFIX, Frames
from shunter.bus.curve import CurveClient, apply_client, check_endpoint
from shunter.bus.transport import DEFAULT_MAX_QUEUE, Bus, Source

PROBE_PREFIX = CONTROL_PREFIX + b"probe/"
_PROBE_INTERVALS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05)


class BusEndpoints(msgspec.Struct, frozen=True):
    frontend: str  # publishers connect here (the broker's XSUB)
    backend: str  # subscribers connect here (the broker's XPUB)

    def __iter__(self):
        return iter((self.frontend, self.backend))


def default_endpoints(runtime_dir: str | os.PathLike[str] | None = None) -> BusEndpoints:
    """ipc:// endpoints under `runtime_dir` (default: <tmp>/shunter-<uid>)."""
    d = pathlib.Path(runtime_dir or pathlib.Path(tempfile.gettempdir()) / f"shunter-{os.getuid()}")
    eps = BusEndpoints(f"ipc://{d}/bus-frontend.sock", f"ipc://{d}/bus-backend.sock")
    if len(eps.frontend) - len("ipc://") > 100:
        raise ValueError(f"ipc path too long for a unix socket: {eps.frontend}")
    return eps


class _SubSource(Source):
    def __init__(self, bus: ZmqBus, prefixes: tuple[bytes, ...], max_queue: int) -> None:
        self.bus = bus
        self.max_queue = max_queue
        self.probe_topic = PROBE_PREFIX + bus._probe_token + b"/%d" % bus._next_probe_idx()
        self.sock = bus._socket(zmq.SUB)
        for p in (*prefixes, self.probe_topic):
            self.sock.setsockopt(zmq.SUBSCRIBE, p)
        self.sock.connect(bus.endpoints.backend)
        self.pending: collections.deque[Frames] = collections.deque()
        self.connected = False
        self.closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiter: asyncio.Future[list[bytes] | None] | None = None
        self._stash: collections.deque[list[bytes]] = collections.deque()  # see _recv_parts

    @property
    def num_queued(self) -> int:
        return len(self.pending)

    def _accept(self, parts: list[bytes]) -> Frames | None:
        topic = parts[0]
        if topic.startswith(CONTROL_PREFIX):
            if topic == self.probe_topic:
                self.connected = True
            return None
        if len(parts) != 3:  # not ours: let the envelope check report it
            return Frames(topic, b"", b"")
        return tuple.__new__(Frames, (topic, parts[1], parts[2]))

    # The socket's FD is edge-triggered: it signals "state changed", and reading
    # ZMQ_EVENTS re-arms it. So: try a non-blocking recv; if nothing, check EVENTS; only
    # then wait for the FD. A persistent reader is much cheaper per wakeup than a
    # future per recv call (zmq.asyncio), and the reader receives the message itself
    # and hands it to the waiting task, which saves a pass of the event loop.

    def _on_readable(self) -> None:
        if self.closed:
            return
        waiter, sock = self._waiter, self.sock
        if waiter is None or waiter.done():
            sock.getsockopt(zmq.EVENTS)  # re-arm the FD
            return
        while True:
            try:
                waiter.set_result(sock.recv_multipart(zmq.NOBLOCK))
                return
            except zmq.Again:
                if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    return  # re-armed; keep waiting

    async def _recv_parts(self) -> list[bytes]:
        sock = self.sock
        while True:
            if self._stash:
                return self._stash.popleft()
            if self.closed:
                raise anyio.ClosedResourceError("subscription is closed")
            try:
                return sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                pass
            if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                continue
            if self._waiter is not None:
                raise anyio.BusyResourceError("receiving")
            if self._loop is None:
                self._loop = asyncio.get_running_loop()
                self._loop.add_reader(sock.getsockopt(zmq.FD), self._on_readable)
            waiter = self._waiter = self._loop.create_future()
            try:
                parts = await waiter
            except BaseException:
                # Cancelled after the reader handed over a message: keep it for later.
                if waiter.done() and not waiter.cancelled() and waiter.result() is not None:
                    self._stash.append(waiter.result())
                raise
            finally:
                self._waiter = None
            if parts is not None:
                return parts

    def get_nowait(self) -> Frames:
        if self.pending:
            return self.pending.popleft()
        if self.closed:
            raise anyio.ClosedResourceError("subscription is closed")
        while True:
            if self._stash:
                parts = self._stash.popleft()
            else:
                try:
                    parts = self.sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    raise anyio.WouldBlock from None
            frames = self._accept(parts)
            if frames is not None:
                return frames

    async def get(self) -> Frames:
        if self.pending:
            return self.pending.popleft()
        while True:
            frames = self._accept(await self._recv_parts())
            if frames is not None:
                return frames

    async def wait_connected(self, timeout_s: float) -> None:
        if self.connected:
            return
        probe = [self.probe_topic, b"", b""]
        with anyio.fail_after(timeout_s):
            for i in range(1 << 30):
                self.bus._send_control(probe)
                interval = _PROBE_INTERVALS_S[min(i, len(_PROBE_INTERVALS_S) - 1)]
                with anyio.move_on_after(interval):
                    while not self.connected:
                        frames = self._accept(await self._recv_parts())
                        if frames is not None:
                            self.pending.append(frames)
                if self.connected:
                    return

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.pending.clear()
        self._stash.clear()
        if self._loop is not None:
            self._loop.remove_reader(self.sock.getsockopt(zmq.FD))
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        self.sock.close(linger=0)


class ZmqBus(Bus):
    """A bus connection through a broker: `ZmqBus("scheduler", default_endpoints())`."""

    transport = "zmq"

    def __init__(
        self,
        publisher_id: str,
        endpoints: BusEndpoints | None = None,
        *,
        curve: CurveClient | None = None,
        allow_insecure_tcp: bool = False,
        context: zmq.Context | None = None,
        max_queue: int = DEFAULT_MAX_QUEUE,
        linger_ms: int = 2000,
    ) -> None:
        super().__init__(publisher_id, max_queue=max_queue)
        self.endpoints = endpoints or default_endpoints()
        for ep in self.endpoints:
            check_endpoint(ep, curve=curve is not None, allow_insecure_tcp=allow_insecure_tcp)
        self.curve = curve
        self._context = context or zmq.Context.instance()
        self._probe_token = uuid.uuid4().hex.encode()
        self._num_probes = 0
        self._linger_ms = linger_ms
        self._pub = self._socket(zmq.PUB)
        self._pub.connect(self.endpoints.frontend)

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self._context.socket(kind)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, self._linger_ms)
        if self.curve is not None:
            apply_client(sock, self.curve)
        return sock

    def _next_probe_idx(self) -> int:
        self._num_probes += 1
        return self._num_probes

    def _open(self, prefixes: tuple[bytes, ...], max_queue: int) -> Source:
        return _SubSource(self, prefixes, max_queue)

    def _has_room(self, topic: bytes) -> bool:
        return True

    async def _wait_room(self, topic: bytes) -> None:
        return None

    def _send(self, frames: Frames) -> None:
        if self._closed:
            raise anyio.ClosedResourceError(f"bus {self.publisher_id!r} is closed")
        self._pub.send_multipart(frames)

    async def publish(self, msg) -> None:  # the hot path, without the no-op room check
        if self._closed:
            raise anyio.ClosedResourceError(f"bus {self.publisher_id!r} is closed")
        self._pub.send_multipart(self.encode(msg))
        self._num_published += 1

    def _send_control(self, parts: list[bytes]) -> None:
        if self._closed:
            raise anyio.ClosedResourceError(f"bus {self.publisher_id!r} is closed")
        self._pub.send_multipart(parts)

    async def wait_connected(self, timeout_s: float = 10.0) -> None:
        if not self._subs:  # nothing to receive with: probe the publisher alone
            source = _SubSource(self, (), 1)
            try:
                await source.wait_connected(timeout_s)
            finally:
                source.close()
            return
        await super().wait_connected(timeout_s)

    async def _close_transport(self) -> None:
        self._pub.close(linger=self._linger_ms)


__all__ = ["PROBE_PREFIX", "BusEndpoints", "ZmqBus", "default_endpoints"]
