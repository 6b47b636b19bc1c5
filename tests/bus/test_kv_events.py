"""KV events out to routers (bus/kv_events.py): the cache manager's events on the bus
reach a real ZMQ SUB socket as SGLang-format batches (decoded here with the types a
router declares, five-field BlockStored included), numbered without gaps, and a replay
request to the ROUTER endpoint gets the kept batches from its start and the end mark."""

from __future__ import annotations

import anyio
import msgspec
import pytest
import zmq
import zmq.asyncio

from shunter.bus.inproc import InProcHub
from shunter.bus.kv_events import (
    END_SEQ,
    KVEventsConfig,
    export_kv_events,
    namespace_id,
    parse_config,
)
from shunter.bus.messages import AllBlocksCleared, BlockRemoved, BlockStored


class Event(msgspec.Struct, array_like=True, tag=True):
    pass


class Stored(Event, tag="BlockStored"):  # as SGLang's router-side types declare it
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class Removed(Event, tag="BlockRemoved"):
    block_hashes: list[int]


class Cleared(Event, tag="AllBlocksCleared"):
    pass


class Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Stored | Removed | Cleared]


DECODE = msgspec.msgpack.Decoder(Batch)
SENT = [BlockStored([11, 12], None, [1, 2, 3, 4], 2), BlockStored([13], 12, [5, 6], 2, "ns"),
        BlockRemoved([13]), AllBlocksCleared()]  # fmt: skip


def test_events_reach_a_subscriber_in_the_routers_format_and_replay(tmp_path):
    pub_ep, replay_ep = f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/replay"
    config = KVEventsConfig(publisher="zmq", endpoint=pub_ep, replay_endpoint=replay_ep,
                            topic="kv", buffer_steps=3)  # fmt: skip

    async def main():
        hub = InProcHub()
        cache_bus = hub.connect("cache")
        ctx = zmq.asyncio.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        dealer = ctx.socket(zmq.DEALER)
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(lambda task_status: export_kv_events(
                    hub.connect("kv-events"), config, task_status=task_status))  # fmt: skip
                sub.connect(pub_ep)
                await anyio.sleep(0.3)  # a SUB socket misses what was sent before it joined
                for m in SENT:
                    await cache_bus.publish(m)
                frames = [await sub.recv_multipart() for _ in SENT]
                dealer.connect(replay_ep)
                await dealer.send_multipart((b"", (2).to_bytes(8, "big")))
                replies = []
                while True:
                    reply = await dealer.recv_multipart()
                    replies.append(reply)
                    if reply[1] == END_SEQ:
                        break
                tg.cancel_scope.cancel()
        finally:
            sub.close(0)
            dealer.close(0)
        return frames, replies

    frames, replies = anyio.run(main)
    assert [f[0] for f in frames] == [b"kv"] * 4
    assert [int.from_bytes(f[1], "big") for f in frames] == [0, 1, 2, 3]
    events = [e for f in frames for e in DECODE.decode(f[2]).events]
    assert events == [Stored([11, 12], None, [1, 2, 3, 4], 2, None),
                      Stored([13], 12, [5, 6], 2, namespace_id("ns")), Removed([13]), Cleared()]  # fmt: skip
    assert 0 <= namespace_id("ns") < 2**63
    # three kept (buffer_steps), asked from seq 2: batches 2 and 3, then the end mark
    assert [r[1] for r in replies] == [(2).to_bytes(8, "big"), (3).to_bytes(8, "big"), END_SEQ]
    assert [r[2] for r in replies[:2]] == [f[2] for f in frames[2:]] and replies[-1][2] == b""


def test_config_is_sglangs_json_and_bad_values_say_why():
    c = parse_config('{"publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "t", '
                     '"max_queue_size": 5}')  # fmt: skip
    assert (c.publisher, c.endpoint, c.topic, c.replay_endpoint) == (
        "zmq",
        "tcp://*:5557",
        "t",
        None,
    )
    for text, words in (("{", "kv-events-config"), ('{"publisher": "kafka"}', "zmq or null"),
                        ('{"buffer_steps": 0}', "buffer_steps")):  # fmt: skip
        with pytest.raises(ValueError, match=words):
            parse_config(text)
