"""Wire format of the bus: a message travels as three frames, [topic, envelope, body].

Theory of operation:
    - topic: the message's tag as ASCII bytes (`b"sched.batch"`). It goes first so a
      ZMQ SUB socket filters by prefix without looking at the rest.
    - envelope: `Envelope(publisher_id, seq, mono_ns, wall_ns)` as a msgpack array,
      with one more item appended by the transports: `topic_seq`, which counts the
      publisher's messages on this topic alone (see `WireEnvelope`). `seq` orders all
      of a publisher's messages; `topic_seq` lets a subscription that sees only some of
      its topics check that it lost none of those (a prefix filter makes `seq` jump).
      Readers that decode `Envelope` ignore the extra item (msgspec drops trailing
      array items it has no field for), so recorded logs and tools are unaffected.
    - body: the message as a msgpack array whose first item is its tag again, so the
      body alone is self-describing (the recorder and replay rely on that).

Encoding reuses one module-level `msgspec.msgpack.Encoder` (msgspec's advice: building
encoders is the expensive part). Decoding is typed: a `Decoder` built for an actor's
inbox rejects anything else with `msgspec.ValidationError`, which the transport turns
into a `DecodeFailed` event rather than a silent miss.

Invariants:
    - Frames are immutable bytes: what a subscriber decodes is a fresh object, never the
      publisher's instance, on every transport (the in-process one included).
    - Topics that start with a NUL byte are the transport's own control traffic (probes
      of the readiness barrier); message tags never do, and subscribers never see them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple, Union

import msgspec

from shunter.bus.messages import ALL_MESSAGES, TOPICS, AnyMessage, Envelope, Msg, topic_of

CONTROL_PREFIX = b"\x00"  # topics of transport control frames; never a message tag


class Frames(NamedTuple):
    """The three frames of one bus message, as they travel on the wire."""

    topic: bytes
    envelope: bytes
    body: bytes


class WireEnvelope(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """The envelope frame as the transports send it: `Envelope`'s fields in order, then
    `topic_seq` (-1 when absent, e.g. frames encoded from a plain Envelope)."""

    publisher_id: str
    seq: int  # per publisher, over all its topics
    mono_ns: int
    wall_ns: int
    topic_seq: int = -1  # per (publisher, topic), from 0 with no holes

    def envelope(self) -> Envelope:
        return Envelope(self.publisher_id, self.seq, self.mono_ns, self.wall_ns)


_ENCODER = msgspec.msgpack.Encoder()
_ENVELOPE_DECODER = msgspec.msgpack.Decoder(Envelope)
_WIRE_ENVELOPE_DECODER = msgspec.msgpack.Decoder(WireEnvelope)
_TOPIC_BYTES: dict[type, bytes] = {m: topic_of(m).encode("ascii") for m in ALL_MESSAGES}


def topic_bytes(msg_type: type[Msg]) -> bytes:
    """The first frame for messages of this type."""
    cached = _TOPIC_BYTES.get(msg_type)
    if cached is None:
        if not (isinstance(msg_type, type) and issubclass(msg_type, Msg)):
            raise TypeError(f"{msg_type!r} is not a bus message type")
        tag = topic_of(msg_type)
        if not isinstance(tag, str) or not tag:
            raise TypeError(f"{msg_type.__name__} is not a tagged bus message")
        cached = _TOPIC_BYTES[msg_type] = tag.encode("ascii")
    return cached


def encode(msg: Msg, env: Envelope, *, topic_seq: int | None = None) -> Frames:
    """Encode a message and its envelope into the three wire frames (with `topic_seq`
    appended to the envelope when given)."""
    cls = type(msg)
    topic = _TOPIC_BYTES.get(cls)
    if topic is None:
        topic = topic_bytes(cls)
    if topic_seq is not None:
        env = WireEnvelope(env.publisher_id, env.seq, env.mono_ns, env.wall_ns, topic_seq)
    return Frames(topic, _ENCODER.encode(env), _ENCODER.encode(msg))


def encode_body(msg: Msg) -> bytes:
    """The body frame alone (golden bytes, logs)."""
    return _ENCODER.encode(msg)


def encode_envelope(env: Envelope) -> bytes:
    return _ENCODER.encode(env)


def decode_envelope(b: bytes) -> Envelope:
    """Decode an envelope frame; raises msgspec.DecodeError/ValidationError if malformed."""
    return _ENVELOPE_DECODER.decode(b)


def decode_wire_envelope(b: bytes) -> WireEnvelope:
    """Decode an envelope frame with its `topic_seq` (-1 if the frame has none)."""
    return _WIRE_ENVELOPE_DECODER.decode(b)


def types_for(*topics: str) -> tuple[type[Msg], ...]:
    """Message types by exact topic, e.g. types_for("sched.batch") == (ForwardBatch,)."""
    unknown = [t for t in topics if t not in TOPICS]
    if unknown:
        raise ValueError(f"unknown topics: {unknown}")
    return tuple(TOPICS[t] for t in topics)


class Decoder:
    """A typed body decoder.

    `Decoder()` accepts any message in the catalog; `Decoder(types=(ForwardBatch,
    Shutdown))` accepts only those and raises `msgspec.ValidationError` for any other
    tag, `msgspec.DecodeError` for bytes that are not msgpack at all."""

    __slots__ = ("_decoder", "decode", "types")

    def __init__(self, types: Iterable[type[Msg]] | None = None) -> None:
        if types is None:
            self.types: tuple[type[Msg], ...] = ALL_MESSAGES
            self._decoder = msgspec.msgpack.Decoder(AnyMessage)
            self.decode = self._decoder.decode
            return
        self.types = tuple(types)
        if not self.types:
            raise ValueError("Decoder needs at least one message type (or None for all)")
        for t in self.types:
            if not (isinstance(t, type) and issubclass(t, Msg)):
                raise TypeError(f"{t!r} is not a bus message type")
            topic_bytes(t)  # checks that it is tagged
        target = self.types[0] if len(self.types) == 1 else Union[self.types]  # noqa: UP007
        self._decoder = msgspec.msgpack.Decoder(target)
        # decode(body) -> Msg: msgspec's own method, bound here to spare a call layer
        self.decode: Callable[[bytes], Msg] = self._decoder.decode

    def __repr__(self) -> str:
        names = ", ".join(t.__name__ for t in self.types)
        return f"Decoder(types=({names}))"


__all__ = [
    "CONTROL_PREFIX",
    "Decoder",
    "Frames",
    "WireEnvelope",
    "decode_envelope",
    "decode_wire_envelope",
    "encode",
    "encode_body",
    "encode_envelope",
    "topic_bytes",
    "types_for",
]
