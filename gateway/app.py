"""The aiohttp application: routes, auth, error bodies, SSE framing, request lifetimes.

Routes (SGLang's and OpenAI's paths):
    POST /v1/completions; GET /v1/models, /v1/models/{id};
    POST /v1/tokenize, /v1/detokenize                                  (openai_api.py)
    POST /v1/chat/completions                                          (chat_api.py)
    POST /generate                                                     (native_api.py)
    POST /v1/score                                                     (score_api.py)
    POST /v1/responses; GET, DELETE /v1/responses/{id}                 (responses_api.py)
    GET /health, /health_generate, /get_model_info, /get_server_info, /get_load,
    /metrics; POST /flush_cache, /abort_request, /update_weights_from_disk,
    /pause_generation, /continue_generation; GET or POST
    /release_memory_occupation, /resume_memory_occupation,
    /get_weights_by_name (admin); POST /hicache/storage-backend/clear, GET or
    POST /clear_hicache_storage_backend (admin)                        (admin.py)
    GET or POST /start_profile, /stop_profile (admin)                  (profile_api.py)

Auth: with an api key set, every endpoint requires `Authorization: Bearer <key>`;
admin endpoints require the admin key when one is set. Errors are OpenAI-style bodies
(errors.py); an unexpected exception is logged and answered 500 without its details.

Request lifetime: `generation()` publishes a group of requests and guarantees that the
engine hears an AbortRequest for each one still running when the handler leaves early
(client disconnect: aiohttp cancels the handler; or an error), so its KV is freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from collections.abc import AsyncIterator

import msgspec
import structlog
from aiohttp import web

from shunter.bus.messages import GenerateRequest
from shunter.gateway.config import GatewayConfig
from shunter.gateway.engine import Engine, RequestGroup
from shunter.gateway.errors import APIError
from shunter.gateway.metrics import Metrics
from shunter.gateway.validation import Limits

log = structlog.get_logger(actor="gateway")
json_encoder = msgspec.json.Encoder()

ADMIN_PATHS = frozenset({"/flush_cache", "/abort_request", "/update_weights_from_disk",
                         "/pause_generation", "/continue_generation", "/start_profile",
                         "/stop_profile", "/release_memory_occupation",
                         "/resume_memory_occupation", "/get_weights_by_name",
                         "/hicache/storage-backend/clear",
                         "/clear_hicache_storage_backend"})  # fmt: skip


class Ctx:
    """Everything handlers share."""

    def __init__(self, config: GatewayConfig, engine: Engine, metrics: Metrics) -> None:
        self.config = config
        self.engine = engine
        self.metrics = metrics
        self.started_wall_s = time.time()
        self.limits = Limits(
            max_context_len=config.max_context_len,
            max_n=config.max_n,
            max_top_logprobs=config.max_top_logprobs,
            max_prompts=config.max_prompts,
        )


CTX = web.AppKey("ctx", Ctx)


def ctx_of(request: web.Request) -> Ctx:
    return request.app[CTX]


def json_response(obj: object, status: int = 200) -> web.Response:
    return web.Response(
        status=status, body=json_encoder.encode(obj), content_type="application/json"
    )


async def read_body(request: web.Request) -> bytes:
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise APIError(413, "the request body is too large") from None


# -- server-sent events -------------------------------------------------------------------


async def open_sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        }
    )
    await resp.prepare(request)
    return resp


async def sse_send(resp: web.StreamResponse, obj: object) -> None:
    await resp.write(b"data: " + json_encoder.encode(obj) + b"\n\n")


async def sse_done(resp: web.StreamResponse) -> None:
    await resp.write(b"data: [DONE]\n\n")


# -- request lifetime -----------------------------------------------------------------------


@contextlib.asynccontextmanager
async def generation(
    ctx: Ctx, requests: list[GenerateRequest], *, tracked: bool = True
) -> AsyncIterator[RequestGroup]:
    """Publish `requests`; on leaving, abort those that have not finished."""
    group = await ctx.engine.generate(requests, tracked=tracked)
    reason = "client"
    try:
        yield group
    except (asyncio.CancelledError, ConnectionResetError):
        reason = "disconnect"
        raise
    finally:
        if any(not s.done for s in group.streams):
            # Shielded: the handler may be being cancelled, and the abort must go out.
            await asyncio.shield(ctx.engine.abort(group.streams, reason))


# -- middlewares ------------------------------------------------------------------------------


def _key_ok(request: web.Request, allowed: list[str]) -> bool:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        return False
    return any(hmac.compare_digest(token.strip().encode(), k.encode()) for k in allowed)


@web.middleware
async def auth_middleware(request: web.Request, handler):
    cfg = ctx_of(request).config
    if request.path in ADMIN_PATHS and cfg.admin_api_key:
        allowed = [cfg.admin_api_key]
    elif cfg.api_key:
        allowed = [k for k in (cfg.api_key, cfg.admin_api_key) if k]
    else:
        allowed = []
    if allowed and not _key_ok(request, allowed):
        admin = request.path in ADMIN_PATHS and cfg.admin_api_key
        raise APIError(
            401,
            ("this endpoint needs the admin API key" if admin else "invalid or missing API key")
            + ": send `Authorization: Bearer <key>`",
            code="invalid_api_key",
            type="invalid_request_error",
        )
    return await handler(request)


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except APIError as e:
        return e.response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        message = {
            404: f"no such endpoint: {request.method} {request.path}",
            405: f"method {request.method} is not allowed on {request.path}",
            413: "the request body is too large",
        }.get(e.status, e.reason)
        return APIError(e.status, message).response()
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:
        log.exception("unhandled error", path=request.path)
        return APIError(
            500, f"internal server error ({type(e).__name__})", code="internal_error"
        ).response()


def build_app(ctx: Ctx) -> web.Application:
    from shunter.gateway import (
        admin,
        chat_api,
        native_api,
        openai_api,
        profile_api,
        responses_api,
        score_api,
    )

    app = web.Application(
        middlewares=[error_middleware, auth_middleware],
        client_max_size=ctx.config.max_body_bytes,
    )
    app[CTX] = ctx
    app.add_routes(openai_api.routes)
    app.add_routes(chat_api.routes)
    app.add_routes(native_api.routes)
    app.add_routes(score_api.routes)
    app.add_routes(responses_api.routes)
    app[responses_api.STORE] = responses_api.ResponseStore()
    app.add_routes(admin.routes)
    app.add_routes(profile_api.routes)
    return app
