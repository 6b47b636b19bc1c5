"""Base of every bus message, and the envelope that travels beside it.

Rules (msgspec schema evolution): append fields only, always with a default; never
reorder, retype or reuse a tag; a breaking change gets a new tag (`req.generate.v2`).
Bus messages never set `forbid_unknown_fields`, so an old reader can decode a newer
writer's message. tests/bus/test_golden.py decodes checked-in bytes of every message.
"""

from __future__ import annotations

import msgspec


class Msg(msgspec.Struct, frozen=True, array_like=True, gc=False, tag_field="t"):
    """A bus message. The tag is its topic: the first ZMQ frame, the prefix SUB sockets
    filter on, and the first item of its msgpack array (see `topic_of`)."""


def topic_of(msg: Msg | type[Msg]) -> str:
    """The topic (tag) of a message or message type."""
    return msg.__struct_config__.tag  # type: ignore[return-value]


class Envelope(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Who sent a message and when; the second frame on the wire.

    `seq` counts per publisher from 0 with no holes, so a subscriber that sees a jump
    knows it lost messages and reports it (`BusGap`)."""

    publisher_id: str
    seq: int
    mono_ns: int  # sender's monotonic clock
    wall_ns: int  # sender's wall clock (unix epoch ns)


class FinishReason:
    """Values of `finish_reason` fields (OpenAI's names plus the engine's own)."""

    STOP = "stop"  # eos, a stop token id or a stop string
    LENGTH = "length"  # max_new_tokens or the context length
    ABORT = "abort"  # the client went away or asked to abort
    ERROR = "error"  # a request-scoped failure; see RequestFailed
