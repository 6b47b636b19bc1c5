"""Health, info, metrics and admin endpoints.

- /health: 200 when a HealthPing round-trips through the scheduler's loop within
  health_timeout_s; 503 when it does not, or an actor died, or the server is draining.
- /health_generate: 200 when a one-token generation (input_ids [0]) finishes in time;
  503 at once while generation is paused or the device memory is released (it could
  not finish).
- /get_model_info, /get_server_info: what is served, with what settings and load.
- /get_load: SGLang's per-rank load list, `[{dp_rank, num_reqs, num_waiting_reqs,
  num_tokens}]` (num_reqs counts running and waiting requests; num_tokens the KV
  tokens held), from the scheduler's latest SchedulerStats (one per tick, 0.25 s).
- /metrics: Prometheus text (only with enable_metrics; 404 otherwise).
- /flush_cache (admin): drops the prefix cache through the cache manager. Like SGLang,
  refused (400) while requests are in flight: their prefixes are locked.
- /hicache/storage-backend/clear (admin, POST; SGLang's older path
  /clear_hicache_storage_backend takes GET and POST too): empties the file store below
  the host tier (--hicache-storage-backend file), the blocks earlier runs and older
  weights left included; what the device and host tiers hold stays. Requests may run
  meanwhile: a block written or read before the clear finishes first. 400 when the
  server has no file store.
- /abort_request (admin): `{"rid": id}` or `{"abort_all": true}`; the affected requests
  end with finish_reason "abort".
- /update_weights_from_disk (admin): `{"model_path": ...}`; a weights flip (flips.py):
  running requests finish first (or are aborted, `abort_all_requests`, or put back in
  the queue, `retract`), then the checkpoint is copied into the live weights and the
  prefix cache dropped. 200 `{"success": true, ...}`; 400 with the reason when the
  checkpoint is refused (the old weights keep serving).
- /pause_generation (admin): `{"mode": "abort" | "retract" | "in_place" | "drain"}`
  (SGLang's, default abort; in_place is served as retract); returns once nothing runs
  (requests ended, back in the queue, or finished); new requests wait.
  /continue_generation (admin) lets them all go on.
- /release_memory_occupation (admin): `{"tags": [...], "timeout": s}` (SGLang's tags
  "weights", "kv_cache", "cuda_graph"; default all): once running requests finished,
  the executor gives up that device memory (the weights wait on the host, the KV cache
  and the prefix cache are dropped) and new requests wait; /resume_memory_occupation
  (admin) `{"tags": [...]}` takes it back, and requests run again once nothing is
  released. /update_weights_from_disk works while only the KV cache is released.
- /get_weights_by_name (admin): `{"name": HF checkpoint name, "truncate_size": 100}`:
  the first truncate_size rows of that weight as float32 lists (SGLang's; a trainer
  checks a weight sync with it); 400 for a name the model does not hold.
"""

from __future__ import annotations

import asyncio
import importlib.metadata

import msgspec
from aiohttp import web

from shunter.bus.messages import GenerateRequest, SamplingParams, WeightsQuery, WeightsSlice
from shunter.gateway.app import ctx_of, generation, json_response, read_body
from shunter.gateway.engine import new_id
from shunter.gateway.errors import APIError, bad_request
from shunter.gateway.schemas import decode_body

routes = web.RouteTableDef()


def _version() -> str:
    try:
        return importlib.metadata.version("shunter")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _unhealthy(message: str) -> web.Response:
    return APIError(503, message, code="unhealthy").response()


@routes.route("*", "/health")
async def health(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    try:
        ctx.engine.check_available()
    except APIError as e:
        return e.response()
    if not await ctx.engine.ping():
        return _unhealthy(f"the scheduler did not answer within {ctx.config.health_timeout_s} s")
    return web.Response(status=200, text="")


@routes.route("*", "/health_generate")
async def health_generate(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    try:
        ctx.engine.check_available()
    except APIError as e:
        return e.response()
    flips = ctx.engine.flips
    if flips.released:
        return _unhealthy(f"the device memory is released ({', '.join(sorted(flips.released))})")
    if flips.paused:
        return _unhealthy("generation is paused (/continue_generation resumes it)")
    req = GenerateRequest(
        new_id("health-"), SamplingParams(max_new_tokens=1, temperature=0.0, seed=0), input_ids=[0]
    )
    try:
        async with asyncio.timeout(ctx.config.health_timeout_s):
            async with generation(ctx, [req], tracked=False) as group:
                async for _ in group:
                    pass
    except TimeoutError:
        return _unhealthy(f"no generation within {ctx.config.health_timeout_s} s")
    except APIError as e:
        return _unhealthy(f"generation failed: {e.message}")
    return web.Response(status=200, text="")


@routes.get("/get_model_info")
async def get_model_info(request: web.Request) -> web.Response:
    cfg = ctx_of(request).config
    served = ctx_of(request).engine.flips.model_path or cfg.model_path
    return json_response({
        "model_path": served, "tokenizer_path": cfg.tokenizer_path or cfg.model_path,
        "served_model_name": cfg.served_model_name, "is_generation": True,
        "max_context_len": cfg.max_context_len,
        "weight_version": ctx_of(request).engine.flips.weight_version,
    })  # fmt: skip


@routes.get("/get_server_info")
async def get_server_info(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    cfg = ctx.config
    stats = ctx.engine.stats
    return json_response({
        **cfg.server_info,
        "served_model_name": cfg.served_model_name, "model_path": cfg.model_path,
        "max_context_len": cfg.max_context_len, "version": _version(),
        "gateway": msgspec.structs.asdict(ctx.engine.statistics()),
        "dead_actors": dict(ctx.engine.dead),
        "memory_released": sorted(ctx.engine.flips.released),
        "internal_states": [msgspec.structs.asdict(stats) if stats else {}],
        "cache": msgspec.structs.asdict(ctx.engine.cache_stats) if ctx.engine.cache_stats else {},
    })  # fmt: skip


@routes.get("/get_load")
async def get_load(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    stats = ctx.engine.stats
    running, waiting, pages = (
        (stats.num_running, stats.num_waiting, stats.num_used_pages) if stats else (0, 0, 0)
    )
    page_size = int(ctx.config.server_info.get("page_size") or 1)
    return json_response([{
        "dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting,
        "num_tokens": pages * page_size,
    }])  # fmt: skip


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    if not ctx.config.enable_metrics:
        raise APIError(404, "metrics are off; start the server with --enable-metrics")
    return web.Response(
        body=ctx.metrics.render().encode(),
        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
    )


@routes.post("/flush_cache")
async def flush_cache(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    ctx.engine.check_available()
    num = len(ctx.engine.streams)
    if num:
        raise bad_request(f"Cache not flushed: {num} request(s) in flight; retry when idle")
    result = await ctx.engine.flush_cache()
    if not result.ok:
        raise bad_request(f"Cache not flushed: {result.reason}")
    return web.Response(
        text=f"Cache flushed ({result.num_pages_reclaimed} pages reclaimed).\n", status=200
    )


_CLEARED = "Hierarchical cache storage backend cleared.\n"


@routes.post("/hicache/storage-backend/clear")
async def clear_store(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    ctx.engine.check_available()
    result = await ctx.engine.clear_store()
    if not result.ok:
        raise bad_request(f"Storage backend not cleared: {result.reason}")
    return web.Response(text=_CLEARED, status=200)


@routes.route("GET", "/clear_hicache_storage_backend")
@routes.route("POST", "/clear_hicache_storage_backend")
async def clear_store_old_path(request: web.Request) -> web.Response:
    response = await clear_store(request)
    response.text = "Deprecated endpoint. Use POST /hicache/storage-backend/clear.\n" + _CLEARED
    return response


class AbortBody(msgspec.Struct, kw_only=True):
    rid: str = ""
    abort_all: bool = False


@routes.post("/abort_request")
async def abort_request(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    body = decode_body(await read_body(request), AbortBody)
    if body.abort_all:
        found = await ctx.engine.abort_all("admin")
    elif body.rid:
        found = [body.rid] if await ctx.engine.abort_id(body.rid, "admin") else []
    else:
        raise bad_request("give rid or abort_all", param="rid")
    return json_response({"success": True, "num_aborted": len(found), "aborted": found})


def _check_timeout(timeout: float | None) -> None:
    if timeout is not None and not timeout > 0:
        raise bad_request("timeout must be > 0 seconds", param="timeout")


class UpdateWeightsBody(msgspec.Struct, kw_only=True):
    model_path: str
    load_format: str = "auto"
    weight_version: str | None = None
    abort_all_requests: bool = False  # end running requests (finish_reason "abort")
    retract: bool = False  # put running requests back in the queue; they go on afterwards
    timeout: float | None = None  # seconds to wait for running requests to finish


@routes.post("/update_weights_from_disk")
async def update_weights_from_disk(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    body = decode_body(await read_body(request), UpdateWeightsBody)
    ctx.engine.check_available()
    if not body.model_path:
        raise bad_request("model_path must not be empty", param="model_path")
    _check_timeout(body.timeout)
    if body.abort_all_requests:
        await ctx.engine.abort_all("admin")
    out = await ctx.engine.flips.update_weights(
        new_id("flip-"), body.model_path, body.load_format, weight_version=body.weight_version,
        retract=body.retract, drain_timeout_s=body.timeout,
    )  # fmt: skip
    reply = {"success": out.ok, "message": out.message,
             "num_paused_requests": out.num_paused_requests}  # fmt: skip
    return json_response(reply, status=200 if out.ok else 400)


class PauseBody(msgspec.Struct, kw_only=True):
    # SGLang's modes: "abort" ends every request; "retract" (and "in_place", which is
    # served the same way: the requests go on afterwards as they would have) puts the
    # running ones back in the queue; and "drain" lets them finish first
    mode: str = "abort"
    timeout: float | None = None  # seconds to wait for them to stop


@routes.post("/pause_generation")
async def pause_generation(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    body = decode_body(await read_body(request) or b"{}", PauseBody)
    ctx.engine.check_available()
    if body.mode not in ("abort", "retract", "in_place", "drain"):
        raise bad_request(f"mode must be abort, retract, in_place or drain, got {body.mode!r}",
                          param="mode")  # fmt: skip
    _check_timeout(body.timeout)
    flips, flip_id = ctx.engine.flips, new_id("pause-")
    flips.claim_pause(flip_id)  # before any abort: a second pause changes nothing
    if body.mode == "abort":
        try:
            await ctx.engine.abort_all("admin")
        except BaseException:
            flips.paused = None
            raise
    retract = body.mode in ("retract", "in_place")
    num = await flips.pause(flip_id, retract=retract, timeout_s=body.timeout)
    return json_response({"success": True, "num_paused_requests": num})


class WeightsBody(msgspec.Struct, kw_only=True):
    name: str
    truncate_size: int = 100


@routes.route("GET", "/get_weights_by_name")
@routes.route("POST", "/get_weights_by_name")
async def get_weights_by_name(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    body = decode_body(await read_body(request), WeightsBody)
    if body.truncate_size < 1:
        raise bad_request(f"truncate_size must be >= 1, got {body.truncate_size}",
                          param="truncate_size")  # fmt: skip
    ctx.engine.check_available()
    q = WeightsQuery(new_id("weights-"), body.name, body.truncate_size)
    got = await ctx.engine.ask(q, WeightsSlice, lambda r: r.query_id == q.query_id, "executor")
    if got.error:
        raise bad_request(got.error, param="name")
    return json_response(_nested(got.values, got.shape))


def _nested(values: list[float], shape: list[int]) -> list | float:
    """Flat row-major values as nested lists of `shape`."""
    if not shape:
        return values[0]
    if len(shape) == 1:
        return values
    step = len(values) // shape[0] if shape[0] else 0
    return [_nested(values[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


class MemoryBody(msgspec.Struct, kw_only=True):
    tags: list[str] | None = None  # None: all
    timeout: float | None = None  # release: seconds to wait for running requests


def _memory_body(raw: bytes) -> tuple[list[str], float | None]:
    body = decode_body(raw, MemoryBody) if raw.strip() else MemoryBody()
    tags = list(MEMORY_TAGS) if body.tags is None else body.tags
    if not tags or any(t not in MEMORY_TAGS for t in tags) or len(set(tags)) < len(tags):
        raise bad_request(f"tags must be distinct, some of {list(MEMORY_TAGS)}; got {tags}",
                          param="tags")  # fmt: skip
    _check_timeout(body.timeout)
    return tags, body.timeout


@routes.route("GET", "/release_memory_occupation")
@routes.route("POST", "/release_memory_occupation")
async def release_memory_occupation(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    tags, timeout = _memory_body(await read_body(request))
    ctx.engine.check_available()
    flips = ctx.engine.flips
    message = await flips.release_memory(new_id("release-"), tags, timeout_s=timeout)
    return json_response({"success": True, "message": message, "released": sorted(flips.released)})


@routes.route("GET", "/resume_memory_occupation")
@routes.route("POST", "/resume_memory_occupation")
async def resume_memory_occupation(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    tags, _ = _memory_body(await read_body(request))
    flips = ctx.engine.flips
    message = await flips.resume_memory(tags)
    return json_response({"success": True, "message": message, "released": sorted(flips.released)})


@routes.post("/continue_generation")
async def continue_generation(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    if not await ctx.engine.flips.resume():
        raise bad_request("generation is not paused")
    return json_response({"success": True})
