"""The Bus API every actor uses (its transports: bus/inproc.py, bus/zmq_transport.py).

Theory of operation:
    A `Bus` is one actor's connection: it publishes under its `publisher_id` and opens
    subscriptions by topic prefix. `publish` stamps an `Envelope` (publisher id, a seq
    that counts from 0 with no holes, monotonic and wall ns; plus a per-topic seq, see
    bus/codec.py), encodes to `Frames` and
    hands them to the transport in one synchronous step, so a publisher's messages
    reach every subscriber in seq order even when several of its tasks publish.

    A subscription (bus/subscription.py) is a bounded queue of frames plus a decoder;
    it reports seq gaps as `BusGap` and undecodable bytes as `DecodeFailed`.

Invariants:
    - Per publisher, a subscriber receives messages in seq order, without holes.
    - A subscription sees every message published after it was connected
      (`await sub.wait_connected()`, or `async with bus.subscribe(...)`; immediate
      in-process, a probe round trip on ZMQ; `bus.wait_connected()` covers them all).
    - Bus error events (`bus.*` topics) are never refused for lack of room.
    - Runs on anyio's asyncio backend (the transports use asyncio primitives directly,
      for speed, and the ZMQ transport drives its sockets from the asyncio loop).
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

import anyio
import msgspec

from shunter.bus.codec import _ENCODER, _TOPIC_BYTES, Decoder, Frames, topic_bytes
from shunter.bus.messages import Envelope, Msg, topic_of
from shunter.bus.subscription import (
    RawSubscription,
    Received,
    Source,
    Subscription,
    SubscriptionStatistics,
)

M = TypeVar("M", bound=Msg)
DEFAULT_MAX_QUEUE = 4096  # messages a subscription buffers before publishers wait
_ENCODE = _ENCODER.encode
_monotonic_ns = time.monotonic_ns
_tuple_new = tuple.__new__  # builds a NamedTuple without its Python-level __new__
_time_ns = time.time_ns


class BusStatistics(msgspec.Struct, frozen=True):
    publisher_id: str
    transport: str
    num_published: int
    num_events: int  # BusGap / DecodeFailed this bus published for its subscriptions
    num_subscriptions: int
    closed: bool


class Bus(abc.ABC):
    """One actor's connection to the bus."""

    transport = "abstract"

    def __init__(self, publisher_id: str, *, max_queue: int = DEFAULT_MAX_QUEUE) -> None:
        if not publisher_id or not isinstance(publisher_id, str):
            raise ValueError("publisher_id must be a non-empty string")
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.publisher_id = publisher_id
        self.max_queue = max_queue
        self._seq = 0
        self._topic_seqs: dict[bytes, int] = {}
        self._closed = False
        self._subs: set[RawSubscription] = set()
        self._num_published = self._num_events = 0

    # -- publishing ---------------------------------------------------------------------

    def stamp(self) -> Envelope:
        """The next envelope of this publisher (consumes a seq, not a topic_seq): for
        frames built by hand (`encode(msg, bus.stamp())`, then `publish_frames`)."""
        env = Envelope(self.publisher_id, self._seq, time.monotonic_ns(), time.time_ns())
        self._seq += 1
        return env

    def encode(self, msg: Msg) -> Frames:
        """Encode and stamp a message (seq, and topic_seq on its topic). The body is
        encoded before seqs are taken, so a message that cannot be encoded raises
        without leaving a hole in them."""
        topic = _TOPIC_BYTES.get(type(msg)) or topic_bytes(type(msg))
        body = _ENCODE(msg)
        seq = self._seq
        self._seq = seq + 1
        topic_seqs = self._topic_seqs
        topic_seq = topic_seqs.get(topic, 0)
        topic_seqs[topic] = topic_seq + 1
        # a plain tuple encodes to the same msgpack array as WireEnvelope, faster
        env = (self.publisher_id, seq, _monotonic_ns(), _time_ns(), topic_seq)
        return _tuple_new(Frames, (topic, _ENCODE(env), body))

    async def publish(self, msg: Msg) -> None:
        """Publish a message; waits while a subscriber's queue is full."""
        topic = topic_bytes(type(msg))
        await self._wait_room(topic)
        self._send(self.encode(msg))
        self._num_published += 1

    def publish_nowait(self, msg: Msg) -> None:
        """Publish without waiting; raises anyio.WouldBlock if a subscriber is full."""
        if not self._has_room(topic_bytes(type(msg))):
            raise anyio.WouldBlock
        self._send(self.encode(msg))
        self._num_published += 1

    async def publish_frames(self, frames: Frames) -> None:
        """Publish frames already encoded and stamped, as they are: the low-level hook
        for re-publishing recorded traffic and for injecting faults in tests."""
        frames = Frames(*frames)
        if not isinstance(frames.topic, bytes) or frames.topic.startswith(b"\x00"):
            raise ValueError("publish_frames takes frames whose topic is a message tag")
        await self._wait_room(frames.topic)
        self._send(frames)
        self._num_published += 1

    def _emit(self, event: Msg) -> None:
        """Publish a bus error event now, ignoring queue bounds (rare, must not block)."""
        if self._closed:
            return
        self._send(self.encode(event))
        self._num_events += 1

    # -- subscribing --------------------------------------------------------------------

    def subscribe(
        self,
        *prefixes: str,
        types: Iterable[type[Msg]] | None = None,
        max_queue: int | None = None,
    ) -> Subscription:
        """Typed subscription. With types and no prefixes, the types' exact topics (a
        topic they are a prefix of, `spill.loaded` for `spill.load`, is not delivered);
        with neither, everything. A message whose body does not decode as one of `types`
        becomes a DecodeFailed event."""
        types = tuple(types) if types is not None else None
        decoder = Decoder(types)  # validates the types
        exact = None
        if not prefixes:
            prefixes = tuple(topic_of(t) for t in types) if types else ("",)
            exact = frozenset(p.encode("ascii") for p in prefixes) if types else None
        source = self._open(self._check_prefixes(prefixes), max_queue or self.max_queue)
        sub = Subscription(self, tuple(prefixes), source, decoder, exact=exact)
        self._subs.add(sub)
        return sub

    def subscribe_raw(self, *prefixes: str, max_queue: int | None = None) -> RawSubscription:
        """Undecoded frames (prefix "" or none: everything)."""
        prefixes = prefixes or ("",)
        source = self._open(self._check_prefixes(prefixes), max_queue or self.max_queue)
        sub = RawSubscription(self, tuple(prefixes), source)
        self._subs.add(sub)
        return sub

    def _check_prefixes(self, prefixes: Iterable[str]) -> tuple[bytes, ...]:
        if self._closed:
            raise anyio.ClosedResourceError(f"bus {self.publisher_id!r} is closed")
        out = []
        for p in prefixes:
            if not isinstance(p, str):
                raise TypeError(f"topic prefix must be str, got {p!r}")
            b = p.encode("ascii")
            if b.startswith(b"\x00"):
                raise ValueError("topic prefixes starting with NUL are reserved")
            out.append(b)
        return tuple(out)

    def _forget(self, sub: RawSubscription) -> None:
        self._subs.discard(sub)

    # -- request / reply ----------------------------------------------------------------

    async def request(
        self, msg: Msg, *, reply: type[M], match: Callable[[M], bool], timeout_s: float
    ) -> M:
        """Publish `msg` and return the first `reply` message for which `match` is true.
        Subscribes (and waits for the subscription to connect) before publishing, so the
        reply cannot be missed. Raises TimeoutError after timeout_s."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        with anyio.fail_after(timeout_s):
            async with self.subscribe(topic_of(reply), types=(reply,)) as sub:
                await self.publish(msg)
                async for received in sub:
                    if match(received.msg):  # type: ignore[arg-type]
                        return received.msg  # type: ignore[return-value]
        raise anyio.ClosedResourceError(f"bus {self.publisher_id!r} closed during request")

    # -- lifecycle ----------------------------------------------------------------------

    async def wait_connected(self, timeout_s: float = 10.0) -> None:
        """Slow-joiner barrier: return once this bus's publisher and every subscription
        opened so far are connected end to end. Raises TimeoutError after timeout_s."""
        with anyio.fail_after(timeout_s):
            for sub in list(self._subs):
                await sub.wait_connected(timeout_s)

    async def aclose(self) -> None:
        """Close every subscription (their iterators end) and the transport."""
        if self._closed:
            return
        self._closed = True
        for sub in list(self._subs):
            await sub.aclose()
        await self._close_transport()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def statistics(self) -> BusStatistics:
        return BusStatistics(
            self.publisher_id, self.transport, self._num_published, self._num_events,
            len(self._subs), self._closed,
        )  # fmt: skip

    # -- what a transport provides ------------------------------------------------------

    @abc.abstractmethod
    def _open(self, prefixes: tuple[bytes, ...], max_queue: int) -> Source: ...

    @abc.abstractmethod
    def _has_room(self, topic: bytes) -> bool: ...

    @abc.abstractmethod
    async def _wait_room(self, topic: bytes) -> None:
        """Return when every subscriber of `topic` can take one more message."""

    @abc.abstractmethod
    def _send(self, frames: Frames) -> None:
        """Hand frames to the transport; synchronous and never blocking."""

    @abc.abstractmethod
    async def _close_transport(self) -> None: ...


__all__ = [
    "DEFAULT_MAX_QUEUE",
    "Bus",
    "BusStatistics",
    "RawSubscription",
    "Received",
    "Source",
    "Subscription",
    "SubscriptionStatistics",
]
