"""Liveness, readiness and the bus's own error events."""

from __future__ import annotations

from shunter.bus.messages.base import Msg


class Ready(Msg, tag="health.ready"):
    """An actor finished starting. The supervisor opens the gateway's port only after
    every expected actor said so."""

    actor: str  # kind: "tokenizer", "scheduler", "cache", "executor", ...
    actor_id: str  # instance, e.g. "executor.0"
    info: dict[str, int | float | str] = {}  # e.g. executor: num_kv_pages, page_size


class Heartbeat(Msg, tag="health.beat"):
    actor_id: str
    beat: int


class HealthPing(Msg, tag="health.ping"):
    """Round-trips through an actor's loop (gateway /health): a stuck loop never pongs."""

    ping_id: str
    target: str = "scheduler"


class HealthPong(Msg, tag="health.pong"):
    ping_id: str
    actor_id: str


class ActorDied(Msg, tag="health.died"):
    """The supervisor saw an actor stop: its in-flight requests fail cleanly."""

    actor_id: str
    reason: str


class Shutdown(Msg, tag="health.shutdown"):
    """Stop accepting requests; drain in-flight ones for up to drain_timeout_s."""

    reason: str
    drain_timeout_s: float = 0.0


class BusGap(Msg, tag="bus.gap"):
    """A subscriber saw a publisher's sequence jump: messages were lost."""

    subscriber_id: str
    publisher_id: str
    expected_seq: int
    got_seq: int


class DecodeFailed(Msg, tag="bus.decode_failed"):
    """A subscriber received bytes its typed decoder rejected."""

    subscriber_id: str
    topic: str
    error: str
