"""A recording of the live tokenizer actor replays identically through its core
(`busctl replay --actor tokenizer`), and a core configured differently diverges."""

from __future__ import annotations

import anyio
import msgspec

from shunter.actors.tokenizer import actor
from shunter.actors.tokenizer.config import TokenizerConfig
from shunter.actors.tokenizer.core import INBOX_TYPES, TokenizerCore
from shunter.bus.inproc import InProcHub
from shunter.bus.log import record
from shunter.bus.messages import (
    AbortRequest,
    ChatMessage,
    GenerateRequest,
    Ready,
    RequestOutput,
    SamplingParams,
    TextDeltas,
    TokenizeQuery,
    TokenizeReply,
    TokensOut,
    topic_of,
)
from shunter.bus.replay import register_core, replay

CONFIG = TokenizerConfig(context_len=256)


async def _record_session(codec, path) -> None:
    hub = InProcHub()
    probe = hub.connect("gateway")
    async with anyio.create_task_group() as tg:
        await tg.start(record, hub.connect("recorder"), path)
        async with probe.subscribe(types=(Ready, TextDeltas, TokenizeReply, AbortRequest)) as sub:
            tg.start_soon(lambda: actor.run(CONFIG, hub.connect("tokenizer"), codec=codec))
            with anyio.fail_after(10):
                await sub.receive()  # Ready
                await probe.publish(GenerateRequest("a", SamplingParams(stop=["plenty"]),
                                                    messages=[ChatMessage("user", "hi")]))  # fmt: skip
                await probe.publish(GenerateRequest("b", SamplingParams(), text=""))  # fails
                ids = codec.encode("Drink plenty of water 😀")
                for k, i in enumerate(ids):
                    await probe.publish(TokensOut(k, [RequestOutput("a", [i])]))
                await probe.publish(TokenizeQuery("q", text="hello"))
                while not isinstance((await sub.receive()).msg, TokenizeReply):
                    pass
        await anyio.sleep(0.2)  # let the recorder write the tail
        tg.cancel_scope.cancel()


def test_recording_replays_identically_and_a_changed_core_diverges(codec, tmp_path):
    anyio.run(_record_session, codec, tmp_path)
    result = replay(tmp_path, "tokenizer")
    assert result.identical, result
    # outbox: Tokenized, two TextDeltas (the stop string cut the second), TokenizeReply
    assert result.num_inbox >= 10 and result.num_outbox == result.num_produced == 4

    def strict(ready):  # no stop strings allowed: "a" is refused, so no Tokenized/deltas
        cfg = msgspec.json.decode(str(ready.info["config"]), type=TokenizerConfig)
        return actor._ReplayCore(
            TokenizerCore(codec, msgspec.structs.replace(cfg, max_stop_strings=0))
        )

    spec = register_core("tokenizer-strict", strict, inbox=INBOX_TYPES, actor_id="tokenizer",
                         config=(topic_of(Ready),))  # fmt: skip
    assert not replay(tmp_path, spec).identical
