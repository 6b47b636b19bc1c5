"""KV events for routers: the cache manager's BlockStored, BlockRemoved and
AllBlocksCleared messages, republished on a ZMQ PUB socket in the wire format SGLang and
vLLM publish (`--kv-events-config`), so a cache-aware router (sgl-model-gateway, NVIDIA
Dynamo, a vLLM kv_events subscriber) can follow which prefixes this server holds.

Theory of operation: one task subscribes to the bus's "cache.kv" topics and sends each
message as one batch. A frame is (topic, seq, payload): the configured topic, a
per-exporter sequence number (8 bytes, big-endian, from 0), and a msgpack KVEventBatch,
[ts, [event, ...]], each event a tagged array ["BlockStored", block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium], ["BlockRemoved",
block_hashes, medium] or ["AllBlocksCleared"]. lora_id is the request namespace
(extra_key) as a stable signed 63-bit hash, or None. The last `buffer_steps` batches
are kept; with a replay endpoint, a ROUTER socket answers (b"", start_seq) with
(b"", seq, payload) for every kept batch from start_seq on, then (b"", -1, b"").

Invariants: seq counts every batch sent, so a subscriber sees a gap as a jump; the
exporter reads only the bus, never the cache manager's state.
"""

from __future__ import annotations

import collections
import hashlib
import time
from typing import Any

import anyio
import msgspec
import structlog
import zmq
import zmq.asyncio

from shunter.bus.messages import AllBlocksCleared, BlockRemoved, BlockStored
from shunter.bus.transport import Bus

log = structlog.get_logger("shunter.kv_events")
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVEventsConfig(msgspec.Struct, frozen=True, kw_only=True):
    """SGLang's --kv-events-config JSON (keys it has that do not apply are ignored)."""

    publisher: str = "null"
    """"zmq" publishes; "null" publishes nothing."""
    endpoint: str = "tcp://*:5557"
    """Where the PUB socket binds (or connects, for an endpoint without "*")."""
    replay_endpoint: str | None = None
    """Where the ROUTER socket for replays binds; None: no replay."""
    buffer_steps: int = 10_000
    """Batches kept for replay."""
    hwm: int = 100_000
    """The PUB socket's send high-water mark."""
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv events publisher must be zmq or null, got {self.publisher!r}")
        if self.buffer_steps < 1 or self.hwm < 0:
            raise ValueError("kv events buffer_steps must be >= 1 and hwm >= 0")


def parse_config(text: str) -> KVEventsConfig:
    """The config from its JSON text; ValueError that says why."""
    try:
        return msgspec.json.decode(text, type=KVEventsConfig)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ValueError(f"--kv-events-config: {e}") from None


class _Event(msgspec.Struct, array_like=True, tag=True):
    pass


class _BlockStored(_Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class _BlockRemoved(_Event, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class _AllBlocksCleared(_Event, tag="AllBlocksCleared"):
    pass


class KVEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_BlockStored | _BlockRemoved | _AllBlocksCleared]


def namespace_id(namespace: str | None) -> int | None:
    """A namespace as the integer lora_id routers key by (None for the default one)."""
    if not namespace:
        return None
    digest = hashlib.blake2b(namespace.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def wire_event(msg: Any) -> _Event:
    """One bus message as the event routers decode."""
    match msg:
        case BlockStored():
            return _BlockStored(list(msg.block_hashes), msg.parent_block_hash,
                                list(msg.token_ids), msg.block_size,
                                namespace_id(msg.lora_id))  # fmt: skip
        case BlockRemoved():
            return _BlockRemoved(list(msg.block_hashes))
        case AllBlocksCleared():
            return _AllBlocksCleared()
    raise TypeError(f"not a KV event: {type(msg).__name__}")


async def export_kv_events(
    bus: Bus, config: KVEventsConfig, *, task_status=anyio.TASK_STATUS_IGNORED
) -> None:
    """Republish the bus's KV events until cancelled (the module docstring). Started
    once the sockets are bound and the bus subscription is connected."""
    if config.publisher == "null":
        task_status.started()
        await anyio.sleep_forever()
    ctx = zmq.asyncio.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, config.hwm)
    pub.setsockopt(zmq.LINGER, 0)
    router = None
    kept: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=config.buffer_steps)
    try:
        _attach(pub, config.endpoint)
        if config.replay_endpoint is not None:
            router = ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind(config.replay_endpoint)
        topic = config.topic.encode()
        encoder = msgspec.msgpack.Encoder()
        types = (BlockStored, BlockRemoved, AllBlocksCleared)
        async with bus.subscribe(types=types) as sub, anyio.create_task_group() as tg:
            await sub.wait_connected()
            if router is not None:
                tg.start_soon(_serve_replays, router, kept)
            log.info("publishing kv events", endpoint=config.endpoint,
                     replay=config.replay_endpoint)  # fmt: skip
            task_status.started()
            seq = 0
            async for received in sub:
                payload = encoder.encode(KVEventBatch(time.time(), [wire_event(received.msg)]))
                kept.append((seq, payload))
                await pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
                seq += 1
    finally:
        pub.close(0)
        if router is not None:
            router.close(0)


def _attach(sock: zmq.Socket, endpoint: str) -> None:
    if "*" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)


async def _serve_replays(router: zmq.asyncio.Socket, kept: collections.deque) -> None:
    while True:
        frames = await router.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv events replay: a malformed request", frames=len(frames))
            continue
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(kept):
            if seq >= start_seq:
                await router.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        await router.send_multipart((client, b"", END_SEQ, b""))
