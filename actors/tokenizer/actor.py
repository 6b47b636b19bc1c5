"""The tokenizer actor's async shell.

Entry point for `shunter serve`:

    async def run(config: TokenizerConfig, bus: Bus, *, codec: TextCodec | None = None) -> None

Loads the tokenizer in a worker thread (seconds; `codec` skips that when the caller
already holds one), subscribes to its inbox (GenerateRequest, TokensOut, AbortRequest,
RequestFailed, ActorDied, TokenizeQuery, DetokenizeQuery), publishes `Ready(actor=
"tokenizer", info={context_len, vocab_size})`, then feeds every message to
`TokenizerCore.handle` and publishes what it returns, in order. Runs until cancelled.
Ready.info also holds the config as JSON, so `busctl replay --actor tokenizer
--import shunter.actors.tokenizer.actor` can rebuild the core from a recording.

Prompts over OFFLOAD_CHARS characters are tokenized in a worker thread (one message at a
time still), so a huge prompt does not stall the other actors of an embedded server.

A failure inside the core while handling one request is that request's failure
(`RequestFailed(code="internal", http_status=500)`), logged with its traceback; the
actor keeps serving the others.
"""

from __future__ import annotations

import functools

import anyio
import msgspec
import structlog

from shunter.actors.tokenizer.config import TokenizerConfig
from shunter.actors.tokenizer.core import INBOX_TYPES, TokenizerCore
from shunter.actors.tokenizer.loading import IdsCodec, TextCodec, load_codec
from shunter.bus.messages import (
    AbortRequest,
    DetokenizeQuery,
    DetokenizeReply,
    GenerateRequest,
    Msg,
    Ready,
    RequestFailed,
    TokenizeQuery,
    TokenizeReply,
    TokensOut,
    topic_of,
)
from shunter.bus.replay import register_core
from shunter.bus.transport import Bus

log = structlog.get_logger(actor="tokenizer")


# Prompts longer than this (characters) are tokenized in a worker thread, so that in the
# embedded deployment a huge prompt does not stall every other actor's loop meanwhile.
# Messages are still handled one at a time and in order.
OFFLOAD_CHARS = 16384


def _is_heavy(msg: Msg) -> bool:
    match msg:
        case GenerateRequest() | TokenizeQuery():
            num_chars = len(msg.text or "") + sum(len(m.content) for m in msg.messages or ())
            return num_chars > OFFLOAD_CHARS
    return False


def _failure_replies(msg: Msg, error: Exception) -> list[Msg]:
    """What the requester gets when the core raised on its message."""
    reason = f"tokenizer error: {type(error).__name__}: {error}"
    match msg:
        case GenerateRequest():
            return [RequestFailed(msg.request_id, "internal", reason, 500)]
        case TokenizeQuery():
            return [TokenizeReply(msg.query_id, error=reason)]
        case DetokenizeQuery():
            return [DetokenizeReply(msg.query_id, error=reason)]
        case TokensOut():
            return [RequestFailed(o.request_id, "internal", reason, 500) for o in msg.outputs]
    return []


async def run(
    config: TokenizerConfig, bus: Bus, *, codec: TextCodec | IdsCodec | None = None
) -> None:
    if codec is None:
        codec = await anyio.to_thread.run_sync(load_codec, config)
    core = TokenizerCore(codec, config)
    async with bus.subscribe(types=INBOX_TYPES) as sub:
        # Ready carries the config: what `busctl replay` rebuilds the core from.
        info = {
            "context_len": core.context_len,
            "vocab_size": codec.vocab_size,
            "config": msgspec.json.encode(config).decode(),
        }
        await bus.publish(Ready("tokenizer", config.actor_id, info))
        log.info("tokenizer ready", actor_id=config.actor_id)
        async for received in sub:
            msg = received.msg
            try:
                if _is_heavy(msg):
                    outs = await anyio.to_thread.run_sync(core.handle, msg)
                else:
                    outs = core.handle(msg)
            except Exception as e:
                log.exception("tokenizer core failed", topic=received.topic)
                outs = _failure_replies(msg, e)
            for out in outs:
                await bus.publish(out)


@functools.lru_cache(maxsize=4)
def _codec_for(config: TokenizerConfig) -> TextCodec | IdsCodec:
    return load_codec(config)


class _ReplayCore:
    """The core as replay sees it. The tokenizer publishes two types it also consumes
    (AbortRequest for a stop string, RequestFailed for a refused prompt); the replay
    harness files every recorded message of an inbox type under the inbox (the core
    gets its own back, as it does live, where they are no-ops), so those outputs are
    left out of the comparison here. Everything else it publishes is compared."""

    def __init__(self, core: TokenizerCore) -> None:
        self.core = core

    def handle(self, msg: Msg) -> list[Msg]:
        return [m for m in self.core.handle(msg) if not isinstance(m, AbortRequest | RequestFailed)]


def _replay_factory(ready: Msg | None) -> _ReplayCore:
    """The core as the recorded run built it: config from its Ready, tokenizer files
    from the same model path on this machine."""
    if not isinstance(ready, Ready) or "config" not in ready.info:
        raise ValueError("the recording holds no tokenizer Ready with its config")
    config = msgspec.json.decode(str(ready.info["config"]), type=TokenizerConfig)
    return _ReplayCore(TokenizerCore(_codec_for(config), config))


register_core(
    "tokenizer", _replay_factory, inbox=INBOX_TYPES, actor_id="tokenizer",
    config=(topic_of(Ready),),
)  # fmt: skip
