"""The gateway actor: the HTTP server (aiohttp) on one side, the bus on the other.

Entry point for `shunter serve`:

    async def run(config: GatewayConfig, bus: Bus, *, host: str | None = None,
                  port: int | None = None, ready_event: anyio.Event | None = None,
                  task_status=anyio.TASK_STATUS_IGNORED) -> None

It subscribes to its inbox first (TextDeltas, RequestFailed, ActorDied, SchedulerStats,
CacheStats, Shutdown), then opens the port (`host`/`port` override the config's), publishes
`Ready(actor="gateway", info={"port": ...})`, sets `ready_event` and reports the bound
port through `task_status.started(port)` (so `port=0` is usable), and serves until
cancelled. The supervisor should start it after every other actor said Ready.

Client disconnects cancel the handler (aiohttp's handler_cancellation), which aborts the
request on the bus (AbortRequest reason "disconnect") so its KV is freed.
"""

from __future__ import annotations

import anyio
import structlog
from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from shunter.bus.messages import Ready
from shunter.bus.transport import Bus
from shunter.gateway.app import Ctx, build_app
from shunter.gateway.config import GatewayConfig
from shunter.gateway.engine import Engine
from shunter.gateway.metrics import Metrics

__all__ = ["GatewayConfig", "run"]

log = structlog.get_logger(actor="gateway")
_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}


class _AccessLog(AbstractAccessLogger):
    """One structured line per HTTP request, at --log-level-http's level."""

    level = 20

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        log.log(self.level, "http", method=request.method, path=request.path,
                status=response.status, ms=round(time * 1000, 2), remote=request.remote)  # fmt: skip


def _access_log(level: str | None) -> dict:
    """AppRunner's access-log keywords for --log-level-http (None: no access log)."""
    if level is None:
        return {"access_log": None}
    cls = type("AccessLog", (_AccessLog,), {"level": _LEVELS[level]})
    return {"access_log_class": cls}


async def run(
    config: GatewayConfig,
    bus: Bus,
    *,
    host: str | None = None,
    port: int | None = None,
    ready_event: anyio.Event | None = None,
    task_status=anyio.TASK_STATUS_IGNORED,
) -> None:
    host = config.host if host is None else host
    port = config.port if port is None else port
    metrics = Metrics(config.served_model_name)
    engine = Engine(bus, config, metrics)
    app = build_app(Ctx(config, engine, metrics))
    runner = web.AppRunner(app, handler_cancellation=True, **_access_log(config.log_level_http))
    async with anyio.create_task_group() as tg:
        await tg.start(engine.listen)
        await runner.setup()
        try:
            site = web.TCPSite(runner, host, port)
            await site.start()
            bound = runner.addresses[0][1] if runner.addresses else port
            log.info("gateway listening", host=host, port=bound)
            await bus.publish(Ready("gateway", config.actor_id, {"port": bound, "host": host}))
            if ready_event is not None:
                ready_event.set()
            task_status.started(bound)
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):
                await runner.cleanup()
            tg.cancel_scope.cancel()
