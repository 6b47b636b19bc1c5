"""A real gateway on a loopback port, the real tokenizer actor, the real in-process bus,
and a SCRIPTED ENGINE standing in for the cache manager + scheduler + executor.

The scripted engine is an honest stand-in for components that are tested elsewhere: it
answers each Tokenized with a fixed reply (REPLY, then eos), one token per step for all
running requests together, honours max_new_tokens, stop token ids, aborts (final output
with finish_reason "abort"), logprob requests, HealthPing and DropTree. The prompt picks
special behaviour: "SLOW" steps every 50 ms and never ends on its own; "MUTE" is
accepted and never answered; "TOOLCALL" is answered with TOOL_REPLY, a tool call in
the qwen25 format.

The stack runs in its own thread with its own event loop (as a server does); tests talk
to it over real HTTP with the `openai` client, `requests` and raw sockets.
"""

from __future__ import annotations

import asyncio
import math
import threading

import anyio
import pytest

from shunter.actors.tokenizer import actor as tokenizer_actor
from shunter.actors.tokenizer.config import TokenizerConfig
from shunter.bus.inproc import InProcHub
from shunter.bus.messages import (
    AbortRequest,
    DropTree,
    HealthPing,
    HealthPong,
    RequestOutput,
    SchedulerStats,
    Tokenized,
    TokensOut,
    TopLogprob,
    TreeDropped,
)
from shunter.gateway import actor as gateway_actor
from shunter.gateway.config import GatewayConfig

REPLY = "Hello! I am a scripted engine 😀 here."
TOOL_REPLY = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
              "\n</tool_call>")  # fmt: skip
CONTEXT_LEN = 512


class ScriptedEngine:
    """Stand-in for cache manager + scheduler + executor (see module docstring)."""

    def __init__(self, bus, codec) -> None:
        self.bus = bus
        self.codec = codec
        self.reply_ids = codec.encode(REPLY)
        self.tool_ids = codec.encode(TOOL_REPLY)
        self.running: dict[str, dict] = {}
        self.seen: list[Tokenized] = []
        self.aborts: list[AbortRequest] = []
        self.prompts_seen: set[tuple[int, ...]] = set()
        self.answer_pings = True
        self.step_id = 0
        self.wake = asyncio.Event()

    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        types = (Tokenized, AbortRequest, HealthPing, DropTree)
        async with self.bus.subscribe(types=types) as sub, anyio.create_task_group() as tg:
            tg.start_soon(self._steps)
            task_status.started()
            async for r in sub:
                await self._on(r.msg)

    async def _on(self, msg) -> None:
        match msg:
            case Tokenized():
                self.seen.append(msg)
                key = tuple(msg.input_ids)
                cached = len(key) - 1 if key in self.prompts_seen else 0
                self.prompts_seen.add(key)
                prompt = self.codec.decode(msg.input_ids)
                if "MUTE" in prompt:  # accepted, never answered: a stuck engine
                    return
                slow = "SLOW" in prompt
                reply = self.tool_ids if "TOOLCALL" in prompt else self.reply_ids
                self.running[msg.request_id] = {
                    "req": msg, "pos": 0, "cached": cached, "slow": slow, "reply": reply
                }  # fmt: skip
                self.wake.set()
            case AbortRequest():
                self.aborts.append(msg)
                if self.running.pop(msg.request_id, None) is not None:
                    out = RequestOutput(msg.request_id, [], finish_reason="abort")
                    await self.bus.publish(TokensOut(self._next_step(), [out]))
            case HealthPing():
                if self.answer_pings:
                    await self.bus.publish(HealthPong(msg.ping_id, "scheduler.scripted"))
            case DropTree():
                self.prompts_seen.clear()
                await self.bus.publish(TreeDropped(msg.flip_id, 7))

    def _next_step(self) -> int:
        self.step_id += 1
        return self.step_id

    async def _steps(self) -> None:
        while True:
            if not self.running:
                self.wake.clear()
                await self.wake.wait()
            slow = any(r["slow"] for r in self.running.values())
            await anyio.sleep(0.05 if slow else 0.002)
            outs = [self._advance(rid, r) for rid, r in list(self.running.items())]
            if outs:
                await self.bus.publish(TokensOut(self._next_step(), outs))
                await self.bus.publish(
                    SchedulerStats(self.step_id, len(self.running), 0, 10, 100, 0.25)
                )

    def _advance(self, rid: str, r: dict) -> RequestOutput:
        req: Tokenized = r["req"]
        sp = req.sampling
        seq = [*r["reply"], 2]
        tok = 42 if r["slow"] else seq[min(r["pos"], len(seq) - 1)]
        r["pos"] += 1
        finish, matched = None, None
        if not r["slow"] and tok in sp.stop_token_ids and r["pos"] > sp.min_new_tokens:
            finish, matched = "stop", tok
        elif r["pos"] >= sp.max_new_tokens:
            finish = "length"
        if finish:
            del self.running[rid]
        lp = [-0.25] if sp.return_logprob else []
        top = (
            [[TopLogprob(tok, -0.25), TopLogprob(13, -2.0)][: sp.top_logprobs_num]]
            if sp.top_logprobs_num else []
        )  # fmt: skip
        prompt_lps = []
        if sp.logprob_start_len >= 0 and r["pos"] == 1:  # position 0 has no logprob
            prompt_lps = [math.nan, *[-1.0] * (len(req.input_ids) - 1)][sp.logprob_start_len :]
        return RequestOutput(
            rid, [tok], lp, top, prompt_lps, finish_reason=finish, matched_stop=matched,
            num_prompt_tokens=len(req.input_ids), num_cached_tokens=r["cached"],
        )  # fmt: skip


class Stack:
    """The stack in a thread: `url`, `engine` (the scripted one), `publish(msg)`."""

    reply = REPLY

    def __init__(self, codec, config: GatewayConfig, transport: str = "inproc") -> None:
        self.codec = codec
        self.config = config
        self.transport = transport
        self.port: int | None = None
        self.engine: ScriptedEngine | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._thread_main, daemon=True)

    def start(self) -> Stack:
        self._thread.start()
        if not self._ready.wait(60):
            raise RuntimeError("the stack did not start within 60 s")
        if self._error is not None:
            raise self._error
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _thread_main(self) -> None:
        try:
            anyio.run(self._main)
        except BaseException as e:  # reported to the test thread
            self._error = e
            self._ready.set()

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        if self.transport == "zmq":  # the same actors over ZMQ ipc through a real broker
            import tempfile

            from shunter.bus import Broker, ZmqBus, default_endpoints

            endpoints = default_endpoints(tempfile.mkdtemp(prefix="shunter-gw-"))
            broker = Broker(endpoints.frontend, endpoints.backend)
            broker.start()

            def connect(pid):
                return ZmqBus(pid, endpoints)
        else:
            broker, connect = None, InProcHub().connect
        self.test_bus = connect("test")
        tok_cfg = TokenizerConfig(context_len=CONTEXT_LEN)
        try:
            async with anyio.create_task_group() as tg:
                self.engine = ScriptedEngine(connect("scheduler"), self.codec)
                await tg.start(self.engine.run)
                tok_bus = connect("tokenizer")
                ready_sub = self.test_bus.subscribe("health.ready")
                await ready_sub.wait_connected()
                tg.start_soon(lambda: tokenizer_actor.run(tok_cfg, tok_bus, codec=self.codec))
                await ready_sub.receive()
                self.port = await tg.start(
                    lambda task_status: gateway_actor.run(
                        self.config, connect("gateway"), port=0, task_status=task_status
                    )
                )
                await self.test_bus.wait_connected()
                self._ready.set()
                await self._stop.wait()
                tg.cancel_scope.cancel()
        finally:
            if broker is not None:
                broker.stop()

    def call(self, fn, timeout: float = 10.0):
        """Run `await fn()` on the stack's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(fn(), self.loop).result(timeout)

    def publish(self, msg) -> None:
        self.call(lambda: self.test_bus.publish(msg))

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


@pytest.fixture(scope="session")
def codec():
    from shunter.actors.tokenizer.loading import load_codec

    return load_codec(TokenizerConfig())


def _stack(codec, transport="inproc", **overrides):
    cfg = GatewayConfig(
        served_model_name="smollm2", max_context_len=CONTEXT_LEN, enable_metrics=True,
        health_timeout_s=1.5, model_path="/models/smollm2.gguf", **overrides,
    )  # fmt: skip
    return Stack(codec, cfg, transport).start()


@pytest.fixture(scope="module")
def stack(codec):
    s = _stack(codec)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def stack_factory(codec):
    made = []

    def make(transport="inproc", **overrides):
        s = _stack(codec, transport, **overrides)
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()
