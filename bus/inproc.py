"""The in-process transport: buses of one event loop connected through a hub.

Theory of operation: `InProcHub` routes frames to the queues of every matching
subscription of every bus connected to it, in the same event loop. Messages are really
encoded on publish and decoded on receive, so the in-process bus behaves like ZMQ
(fresh immutable objects, typed decoding errors) and tests on it mean something. A
full queue makes `publish` wait for room (backpressure); nothing is dropped.

Invariants: those of bus/transport.py; a hub and its buses live in one event loop.
"""

from __future__ import annotations

import asyncio
import collections

import anyio

from shunter.bus.codec import _TOPIC_BYTES, Frames, topic_bytes
from shunter.bus.messages import Msg
from shunter.bus.subscription import Source
from shunter.bus.transport import DEFAULT_MAX_QUEUE, Bus


class _Queue(Source):
    """A bounded deque of frames with one waiting consumer and waiting publishers."""

    def __init__(self, hub: InProcHub, prefixes: tuple[bytes, ...], max_queue: int) -> None:
        self.hub = hub
        self.prefixes = prefixes
        self.max_queue = max_queue
        self.items: collections.deque[Frames] = collections.deque()
        self.closed = False
        self._getter: asyncio.Future[None] | None = None
        self._putters: list[asyncio.Future[None]] = []

    @property
    def num_queued(self) -> int:
        return len(self.items)

    def put(self, frames: Frames) -> None:
        self.items.append(frames)
        getter = self._getter
        if getter is not None and not getter.done():
            getter.set_result(None)

    def get_nowait(self) -> Frames:
        if self.items:
            frames = self.items.popleft()
            if self._putters:
                self._wake_putters()
            return frames
        if self.closed:
            raise anyio.ClosedResourceError("subscription is closed")
        raise anyio.WouldBlock

    async def get(self) -> Frames:
        while not self.items:
            if self.closed:
                raise anyio.ClosedResourceError("subscription is closed")
            if self._getter is not None:
                raise anyio.BusyResourceError("receiving")
            self._getter = asyncio.get_running_loop().create_future()
            try:
                await self._getter
            finally:
                self._getter = None
        return self.get_nowait()

    async def wait_room(self) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._putters.append(fut)
        await fut

    def _wake_putters(self) -> None:
        putters, self._putters = self._putters, []
        for fut in putters:
            if not fut.done():
                fut.set_result(None)

    async def wait_connected(self, timeout_s: float) -> None:
        return None  # routed the moment it was opened

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.items.clear()
        self.hub._remove(self)
        self._wake_putters()
        if self._getter is not None and not self._getter.done():
            self._getter.set_result(None)


class InProcHub:
    """Routes frames between the buses of one event loop: `hub.connect("scheduler")`."""

    def __init__(self, *, max_queue: int = DEFAULT_MAX_QUEUE) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.max_queue = max_queue
        self._queues: list[_Queue] = []
        self._routes: dict[bytes, tuple[_Queue, ...]] = {}
        self._buses: dict[str, InProcBus] = {}

    def connect(self, publisher_id: str, *, max_queue: int | None = None) -> InProcBus:
        old = self._buses.get(publisher_id)
        if old is not None and not old._closed:
            raise ValueError(f"publisher id {publisher_id!r} is already connected")
        bus = InProcBus(self, publisher_id, max_queue=max_queue or self.max_queue)
        self._buses[publisher_id] = bus
        return bus

    def route(self, topic: bytes) -> tuple[_Queue, ...]:
        """The queues subscribed to a topic (cached until a subscription changes)."""
        queues = self._routes.get(topic)
        if queues is None:
            queues = tuple(q for q in self._queues if topic.startswith(q.prefixes))
            self._routes[topic] = queues
        return queues

    def _add(self, queue: _Queue) -> None:
        self._queues.append(queue)
        self._routes.clear()

    def _remove(self, queue: _Queue) -> None:
        if queue in self._queues:
            self._queues.remove(queue)
            self._routes.clear()


class InProcBus(Bus):
    transport = "inproc"

    def __init__(self, hub: InProcHub, publisher_id: str, *, max_queue: int) -> None:
        super().__init__(publisher_id, max_queue=max_queue)
        self.hub = hub

    async def publish(self, msg: Msg) -> None:
        # The common case inlined (no room to wait for): this is the hot path.
        if self._closed:
            raise anyio.ClosedResourceError(f"bus {self.publisher_id!r} is closed")
        topic = _TOPIC_BYTES.get(type(msg)) or topic_bytes(type(msg))
        queues = self.hub._routes.get(topic)
        if queues is None:
            queues = self.hub.route(topic)
        for q in queues:
            if len(q.items) >= q.max_queue:
                await self._wait_room(topic)
                queues = self.hub.route(topic)
                break
        frames = self.encode(msg)
        for q in queues:
            q.items.append(frames)
            getter = q._getter
            if getter is not None and not getter.done():
                getter.set_result(None)
        self._num_published += 1

    def _open(self, prefixes: tuple[bytes, ...], max_queue: int) -> Source:
        queue = _Queue(self.hub, prefixes, max_queue)
        self.hub._add(queue)
        return queue

    def _has_room(self, topic: bytes) -> bool:
        return all(len(q.items) < q.max_queue for q in self.hub.route(topic))

    async def _wait_room(self, topic: bytes) -> None:
        while True:
            if self._closed:
                raise anyio.ClosedResourceError(f"bus {self.publisher_id!r} is closed")
            full = [q for q in self.hub.route(topic) if len(q.items) >= q.max_queue]
            if not full:
                return
            await full[0].wait_room()

    def _send(self, frames: Frames) -> None:
        if self._closed:
            raise anyio.ClosedResourceError(f"bus {self.publisher_id!r} is closed")
        for q in self.hub.route(frames.topic):
            q.put(frames)

    async def _close_transport(self) -> None:
        return None


__all__ = ["InProcBus", "InProcHub"]
