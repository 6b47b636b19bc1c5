"""Small actors for the process-launch tests (imported by child processes through
PYTHONPATH; not a test module). Each takes (config: dict, bus) like a real actor."""

from __future__ import annotations

import anyio

from shunter.bus.messages import GenerateRequest, Ready, TextDelta, TextDeltas


async def echo(config: dict, bus) -> None:
    """Ready, then answer each GenerateRequest with its text upper-cased, unless the
    text is "hold" (never answered) or "crash" (the actor raises)."""
    async with bus.subscribe(types=(GenerateRequest,)) as sub:
        await anyio.sleep(float(config.get("start_delay_s", 0.0)))
        await bus.publish(Ready("echo", bus.publisher_id, {"pid_hint": config.get("tag", "")}))
        async for r in sub:
            req = r.msg
            if req.text == "crash":
                raise RuntimeError("asked to crash")
            if req.text != "hold":
                d = TextDelta(req.request_id, req.text.upper(), [1], finish_reason="stop")
                await bus.publish(TextDeltas([d]))


async def fail_at_start(config: dict, bus) -> None:
    raise FileNotFoundError(config.get("what", "weights"))
