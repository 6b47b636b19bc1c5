"""SGLang's /start_profile and /stop_profile (admin): a torch.profiler trace of the
executor's next steps, written where the executor runs.

/start_profile takes (all optional) `output_dir` (default $SHUNTER_TORCH_PROFILER_DIR,
else the system's temporary directory), `num_steps` (end by itself after that many
steps; none: at /stop_profile), `activities` ("CPU", "GPU"; default both, GPU where
there is one), `record_shapes`, `with_stack`, and answers once the executor records:
`{"success": true, "message", "profile_id", "trace_path"}`. /stop_profile ends it and
answers once the trace is written: `{"success": true, "message", "profile_id",
"trace_path", "num_steps"}`. A start while one runs is 409; a stop with none running,
SGLang's options not served here (start_step, profile_by_stage, other activities)
and malformed values are 400; a trace that could not be written is 500. Both paths
take GET with no body as well, as SGLang's do.

Theory of operation: the handler publishes ProfileStart or ProfileStop and waits for
the executor's ProfileStatus answering it (actors/executor/profiling.py).
"""

from __future__ import annotations

import os
import tempfile

import msgspec
from aiohttp import web

from shunter.bus.messages import ProfileStart, ProfileStatus, ProfileStop
from shunter.gateway.app import ctx_of, json_response, read_body
from shunter.gateway.engine import new_id
from shunter.gateway.errors import APIError, bad_request
from shunter.gateway.schemas import decode_body

routes = web.RouteTableDef()

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 600.0  # writing the trace of many steps takes a while
ACTIVITIES = ("CPU", "GPU")


class StartBody(msgspec.Struct, kw_only=True):
    output_dir: str | None = None
    num_steps: int | None = None
    activities: list[str] | None = None
    record_shapes: bool = False
    with_stack: bool = False
    start_step: int | None = None  # SGLang's; refused here
    profile_by_stage: bool = False  # SGLang's; refused here


def _start_msg(body: StartBody) -> ProfileStart:
    if body.start_step is not None:
        raise bad_request("start_step is not supported: profiling starts at the next step",
                          param="start_step")  # fmt: skip
    if body.profile_by_stage:
        raise bad_request("profile_by_stage is not supported", param="profile_by_stage")
    if body.num_steps is not None and body.num_steps < 1:
        raise bad_request(f"num_steps must be >= 1, got {body.num_steps}", param="num_steps")
    activities = body.activities if body.activities is not None else list(ACTIVITIES)
    unknown = [a for a in activities if a not in ACTIVITIES]
    if unknown or not activities:
        raise bad_request(f"activities must be some of {list(ACTIVITIES)}, got {activities}",
                          param="activities")  # fmt: skip
    out = body.output_dir
    if out is None:
        out = os.environ.get("SHUNTER_TORCH_PROFILER_DIR") or tempfile.gettempdir()
    if not out:
        raise bad_request("output_dir must not be empty", param="output_dir")
    return ProfileStart(new_id("prof-"), out, body.num_steps or 0, activities,
                        body.record_shapes, body.with_stack)  # fmt: skip


async def _ask(request: web.Request, msg: ProfileStart | ProfileStop, timeout_s: float):
    ctx = ctx_of(request)
    ctx.engine.check_available()
    return await ctx.engine.ask(msg, ProfileStatus, lambda s: s.request_id == msg.request_id,
                                "executor", timeout_s)  # fmt: skip


def _reply(status: ProfileStatus, message: str) -> web.Response:
    out = {"success": True, "message": message, "profile_id": status.profile_id,
           "trace_path": status.trace_path}  # fmt: skip
    if status.state == "stopped":
        out["num_steps"] = status.num_steps
    return json_response(out)


@routes.route("GET", "/start_profile")
@routes.route("POST", "/start_profile")
async def start_profile(request: web.Request) -> web.Response:
    raw = await read_body(request)
    msg = _start_msg(decode_body(raw, StartBody) if raw.strip() else StartBody())
    status = await _ask(request, msg, START_TIMEOUT_S)
    if status.state == "busy":
        raise APIError(409, status.message)
    if not status.ok:
        raise bad_request(status.message)
    return _reply(status, "Start profiling.")


@routes.route("GET", "/stop_profile")
@routes.route("POST", "/stop_profile")
async def stop_profile(request: web.Request) -> web.Response:
    status = await _ask(request, ProfileStop(new_id("prof-stop-")), STOP_TIMEOUT_S)
    if status.state == "refused":
        raise bad_request(status.message)
    if not status.ok:
        raise APIError(500, status.message)
    return _reply(status, f"Stop profiling: {status.message}.")
