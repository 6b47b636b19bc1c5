"""Subscriptions: the consumer's side of the bus, shared by every transport.

Theory of operation:
    A subscription reads frames from its transport's `Source` (a bounded queue
    in-process, a SUB socket over ZMQ) and checks each envelope's `topic_seq` against the
    last one seen from that publisher on that topic (see bus/codec.py): a jump is
    counted and published as `BusGap` (its seqs are then topic seqs). Bytes the typed
    decoder rejects are counted and published as `DecodeFailed`, then skipped, so the
    subscriber keeps running. The first message seen from a publisher sets its
    baseline, so joining late is no gap; a seq that goes backwards means the publisher
    restarted and resets the baseline.

Invariants:
    - A subscription never reports a failure to decode a `bus.*` event as another
      event (no event storms about events).
    - Closing a subscription ends its async iteration; `receive()` then raises
      anyio.ClosedResourceError.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, NamedTuple

import anyio
import msgspec

from shunter.bus.codec import _WIRE_ENVELOPE_DECODER, Decoder, Frames
from shunter.bus.messages import BusGap, DecodeFailed, Envelope, Msg

if TYPE_CHECKING:
    from shunter.bus.transport import Bus

_EVENT_PREFIX = b"bus."
_decode_wire_envelope = _WIRE_ENVELOPE_DECODER.decode
_tuple_new = tuple.__new__  # builds a NamedTuple without its Python-level __new__


class Received(NamedTuple):
    topic: str
    envelope: Envelope
    msg: Msg


class SubscriptionStatistics(msgspec.Struct, frozen=True):
    subscriber_id: str
    prefixes: tuple[str, ...]
    num_received: int  # messages handed to the consumer
    num_decode_failed: int
    num_gaps: int  # seq jumps seen
    num_lost: int  # messages missing in those jumps
    num_seq_resets: int  # a publisher's seq went backwards (it restarted)
    num_queued: int
    max_queue: int


class Source(abc.ABC):
    """Transport side of a subscription: a stream of frames."""

    max_queue: int

    @abc.abstractmethod
    def get_nowait(self) -> Frames:
        """Next frames; raises anyio.WouldBlock if none, ClosedResourceError if closed."""

    @abc.abstractmethod
    async def get(self) -> Frames: ...

    @abc.abstractmethod
    async def wait_connected(self, timeout_s: float) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    @property
    @abc.abstractmethod
    def num_queued(self) -> int: ...


class RawSubscription:
    """Undecoded frames of matching topics (recorder, busctl). Gap-checked."""

    def __init__(self, bus: Bus, prefixes: tuple[str, ...], source: Source) -> None:
        self._bus = bus
        self.prefixes = prefixes
        self.subscriber_id = bus.publisher_id
        self._source = source
        self._next_seq: dict[str, int] = {}  # publisher -> next seq (frames w/o topic_seq)
        self._next_topic_seq: dict[tuple[str, bytes], int] = {}  # (publisher, topic) -> next
        self._closed = False
        self._num_received = self._num_decode_failed = 0
        self._num_gaps = self._num_lost = self._num_seq_resets = 0

    # -- the consumer's side ------------------------------------------------------------

    async def receive(self) -> Frames:
        source = self._source
        while True:
            try:
                frames = source.get_nowait()
            except anyio.WouldBlock:
                frames = await source.get()
            if self._check(frames) is not None:
                self._num_received += 1
                return frames

    def receive_nowait(self) -> Frames:
        while True:
            frames = self._source.get_nowait()
            if self._check(frames) is not None:
                self._num_received += 1
                return frames

    async def receive_many(self, max_n: int = 256) -> list:
        """Wait for one message, then take up to max_n already queued without waiting:
        one wakeup per batch instead of per message (an actor draining its inbox)."""
        if max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {max_n}")
        out = [await self.receive()]
        receive_nowait = self.receive_nowait
        try:
            while len(out) < max_n:
                out.append(receive_nowait())
        except (anyio.WouldBlock, anyio.ClosedResourceError):
            pass
        return out

    async def wait_connected(self, timeout_s: float = 10.0) -> None:
        """Return once every message published from now on will reach this subscription."""
        await self._source.wait_connected(timeout_s)

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._source.close()
            self._bus._forget(self)

    def statistics(self) -> SubscriptionStatistics:
        return SubscriptionStatistics(
            self.subscriber_id, self.prefixes, self._num_received, self._num_decode_failed,
            self._num_gaps, self._num_lost, self._num_seq_resets, self._source.num_queued,
            self._source.max_queue,
        )  # fmt: skip

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            return await self.receive()
        except (anyio.ClosedResourceError, anyio.EndOfStream):
            raise StopAsyncIteration from None

    async def __aenter__(self):
        await self.wait_connected()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- checks -------------------------------------------------------------------------

    def _check(self, frames: Frames) -> Envelope | None:
        """Decode the envelope and check its sequence; None means skip these frames.

        Transports send `topic_seq`, checked per (publisher, topic), so a subscription
        that sees only some of a publisher's topics still checks those. Frames without
        it (built by hand from a plain Envelope) are checked on `seq` per publisher."""
        try:
            wire = _decode_wire_envelope(frames.envelope)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self._decode_failed(frames.topic, f"envelope: {e}")
            return None
        pid = wire.publisher_id
        if wire.topic_seq >= 0:
            key, seq, next_seq = (pid, frames.topic), wire.topic_seq, self._next_topic_seq
        else:
            key, seq, next_seq = pid, wire.seq, self._next_seq
        expected = next_seq.get(key, seq)
        if expected != seq:
            self._seq_jump(pid, expected, seq)
        next_seq[key] = seq + 1
        return Envelope(pid, wire.seq, wire.mono_ns, wire.wall_ns)

    def _seq_jump(self, publisher_id: str, expected: int, seq: int) -> None:
        if seq > expected:
            self._num_gaps += 1
            self._num_lost += seq - expected
            self._bus._emit(BusGap(self.subscriber_id, publisher_id, expected, seq))
        else:
            self._num_seq_resets += 1

    def _decode_failed(self, topic: bytes, error: str) -> None:
        self._num_decode_failed += 1
        if not topic.startswith(_EVENT_PREFIX):  # never an event about an event
            name = topic.decode("ascii", "replace")
            self._bus._emit(DecodeFailed(self.subscriber_id, name, error))


class Subscription(RawSubscription):
    """Typed messages of matching topics, as `Received(topic, envelope, msg)`."""

    def __init__(
        self, bus: Bus, prefixes: tuple[str, ...], source: Source, decoder: Decoder,
        *, exact: frozenset[bytes] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(bus, prefixes, source)
        self.decoder = decoder
        self._decode_body = decoder.decode
        self._exact = exact  # the only topics delivered (None: every prefix match)

    async def receive(self) -> Received:  # type: ignore[override]
        source = self._source
        while True:
            try:
                frames = source.get_nowait()
            except anyio.WouldBlock:
                frames = await source.get()
            received = self._decode(frames)
            if received is not None:
                return received

    def receive_nowait(self) -> Received:  # type: ignore[override]
        while True:
            received = self._decode(self._source.get_nowait())
            if received is not None:
                return received

    def _decode(self, frames: Frames) -> Received | None:
        env = self._check(frames)
        if env is None or (self._exact is not None and frames.topic not in self._exact):
            return None
        try:
            msg = self._decode_body(frames.body)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self._decode_failed(frames.topic, str(e))
            return None
        self._num_received += 1
        return _tuple_new(Received, (frames.topic.decode("ascii"), env, msg))


__all__ = ["RawSubscription", "Received", "Source", "Subscription", "SubscriptionStatistics"]
