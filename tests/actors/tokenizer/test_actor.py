"""The tokenizer actor's shell on the real in-process bus: Ready, requests in, deltas
and stop-string aborts out, and a core failure confined to its request."""

from __future__ import annotations

import anyio

from shunter.actors.tokenizer import actor
from shunter.actors.tokenizer.config import TokenizerConfig
from shunter.bus.inproc import InProcHub
from shunter.bus.messages import (
    AbortRequest,
    GenerateRequest,
    Ready,
    RequestFailed,
    RequestOutput,
    SamplingParams,
    TextDeltas,
    Tokenized,
    TokensOut,
)

OUT_TYPES = (Ready, Tokenized, TextDeltas, AbortRequest, RequestFailed)


async def _run_with(codec, body):
    hub = InProcHub()
    probe = hub.connect("probe")
    async with anyio.create_task_group() as tg, probe.subscribe(types=OUT_TYPES) as sub:
        tg.start_soon(
            lambda: actor.run(TokenizerConfig(context_len=256), hub.connect("tok"), codec=codec)
        )
        with anyio.fail_after(10):
            ready = (await sub.receive()).msg
            await body(probe, sub, ready)
        tg.cancel_scope.cancel()


def test_actor_round_trip(codec):
    async def body(probe, sub, ready):
        assert (ready.actor, ready.actor_id) == ("tokenizer", "tokenizer")
        assert (ready.info["context_len"], ready.info["vocab_size"]) == (256, 49152)
        assert '"context_len":256' in ready.info["config"]
        await probe.publish(GenerateRequest("a", SamplingParams(stop=["World"]), text="hi"))
        tok = (await sub.receive()).msg
        assert isinstance(tok, Tokenized) and tok.input_ids == codec.encode("hi")
        ids = codec.encode("Hello World again")
        await probe.publish(TokensOut(0, [RequestOutput("a", ids)]))
        deltas = (await sub.receive()).msg
        assert isinstance(deltas, TextDeltas)
        assert deltas.deltas[0].text == "Hello " and deltas.deltas[0].matched_stop == "World"
        assert (await sub.receive()).msg == AbortRequest("a", "stop_string", "World")

    anyio.run(_run_with, codec, body)


class _Broken:
    """A codec whose decoding raises: the failure must stay with its request."""

    def __init__(self, codec):
        self._codec = codec

    def __getattr__(self, name):
        return getattr(self._codec, name)

    def decode(self, ids, **k):
        if 5 in ids:
            raise RuntimeError("decoder exploded")
        return self._codec.decode(ids, **k)

    def decode_fn(self, skip, spaces):
        return lambda ids: self.decode(ids, skip_special_tokens=skip,
                                       spaces_between_special_tokens=spaces)  # fmt: skip


def test_core_failure_fails_only_that_request(codec):
    async def body(probe, sub, ready):
        await probe.publish(GenerateRequest("b", SamplingParams(), text="hi"))
        assert isinstance((await sub.receive()).msg, Tokenized)
        await probe.publish(TokensOut(0, [RequestOutput("b", [5])]))
        failed = (await sub.receive()).msg
        assert isinstance(failed, RequestFailed)
        assert (failed.request_id, failed.code, failed.http_status) == ("b", "internal", 500)
        assert "decoder exploded" in failed.message
        # The actor is still serving.
        await probe.publish(GenerateRequest("c", SamplingParams(), text="again"))
        assert isinstance((await sub.receive()).msg, Tokenized)

    anyio.run(_run_with, _Broken(codec), body)


def test_long_prompt_is_tokenized_off_the_loop_in_order(codec):
    long_text = "lorem ipsum " * 3000  # over OFFLOAD_CHARS

    async def body(probe, sub, ready):
        assert len(long_text) > actor.OFFLOAD_CHARS
        await probe.publish(
            GenerateRequest("long", SamplingParams(max_new_tokens=1), text=long_text)
        )
        await probe.publish(GenerateRequest("short", SamplingParams(max_new_tokens=1), text="hi"))
        first, second = (await sub.receive()).msg, (await sub.receive()).msg
        assert isinstance(first, RequestFailed) and first.request_id == "long"  # > 256 tokens
        assert first.code == "context_length_exceeded"
        assert isinstance(second, Tokenized) and second.request_id == "short"

    anyio.run(_run_with, codec, body)
