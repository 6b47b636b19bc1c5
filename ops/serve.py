"""`shunter serve`: server arguments in, a supervised deployment of every actor out.

Theory of operation
    `run(args)` merges the command line with `--config FILE` into a validated
    ServerArgs (a bad option is exit 2 with one line naming it), checks the paths, sets
    up logging, and hands over to `serve()`, which returns the exit code.

    The plan (ops/serve_plan.py: `actor_specs`, `build_config`): stage 0 starts the
    executor (loads the weights and sizes the KV pool) and the tokenizer side by side;
    stage 1 the cache manager and the scheduler, whose configs need the pool size,
    context length and eos ids the executor reported in its Ready; stage 2 the gateway,
    which opens the port only once everything else is Ready. The supervisor
    (actors/supervisor.py) enforces that order, the start timeout, heartbeats and the
    SIGTERM drain; a LoopWatchdog thread ends this process (exit 3, stacks dumped) if
    its own event loop stalls past --watchdog-timeout, since a blocked loop could not
    even answer /health.

    Deployments:
    - embedded (default): every actor is a task of this process's event loop, on the
      in-process bus. A tap copies every frame, unchanged (envelopes included), to a
      ZMQ broker in a thread, so `busctl tail` can watch the server live.
    - --multi-process: this process runs the supervisor and the ZMQ broker (a thread),
      and each actor runs in its own process (ops/launch.py), over ipc:// sockets.
      Children get their own session, so a terminal's Ctrl-C reaches only the
      supervisor, which drains and then stops them.
    Either way the broker's sockets live in --bus-dir (default <tmp>/shunter-<uid>/<port>)
    and are removed on exit; `busctl tail --runtime-dir DIR` attaches there.

    `--record-events DIR` starts the bus recorder before any actor, so the log holds
    every message from the first Ready on.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from collections.abc import Callable, Mapping

import anyio
import structlog

from shunter.actors.supervisor import (
    EmbeddedActor,
    LoopWatchdog,
    Supervisor,
    run_with_heartbeats,
)
from shunter.actors.supervisor_core import ActorSpec
from shunter.bus.messages import Ready
from shunter.ops.serve_plan import actor_specs, build_config, draw_seed, supervisor_config
from shunter.ops.server_args import COMPAT_ONLY, FLAG_OF, ServerArgs, check_paths
from shunter.ops.server_cli import add_server_arguments, namespace_to_server_args

log = structlog.get_logger("shunter.serve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser)


def run(args: argparse.Namespace) -> int:
    try:
        server_args = namespace_to_server_args(args)
        check_paths(server_args)
        check_device(server_args)
    except ValueError as e:
        print(f"shunter serve: {e}", file=sys.stderr)
        return 2
    from shunter.ops import logging as shunter_logging

    shunter_logging.configure(server_args.log_level, server_args.log_format)
    for note in no_effect_notes(server_args):
        log.warning("option has no effect in this build", note=note)
    return anyio.run(serve, server_args, backend="asyncio")


def check_device(a: ServerArgs) -> None:
    """--device cuda needs a CUDA device; CUDA-only kernels need CUDA (imports torch only
    when one of those was asked for). Raises ValueError."""
    kernels = []  # the CUDA-only kernel choices given, as flags
    if a.attention_backend in ("triton", "flashinfer"):
        kernels.append(f"--attention-backend {a.attention_backend}")
    if a.decode_attention_backend != "auto":
        kernels.append(f"--decode-attention-backend {a.decode_attention_backend}")
    if a.device != "cuda" and not kernels:
        return
    import torch

    if not torch.cuda.is_available():
        flag = "--device cuda" if a.device == "cuda" else kernels[0]
        raise ValueError(f"{flag}: no CUDA device is available (torch {torch.__version__})")
    if a.device == "cpu" and kernels:
        raise ValueError(f"{kernels[0]}: needs a CUDA device, not --device cpu")


def no_effect_notes(a: ServerArgs) -> list[str]:
    """Options accepted for SGLang compatibility that this build does not act on: each is
    said out loud at start rather than silently ignored."""
    notes = []
    if a.device == "cpu" and (a.cuda_graph_max_bs is not None or a.disable_cuda_graph
                              or a.piecewise_cuda_graph_max_tokens is not None
                              or a.enable_piecewise_cuda_graph):  # fmt: skip
        notes.append("--cuda-graph-max-bs / --disable-cuda-graph / --piecewise-cuda-graph-*: "
                     "CUDA graphs exist only on a CUDA device")  # fmt: skip
    if a.device == "cpu" and a.skip_server_warmup:
        notes.append("--skip-server-warmup: only a CUDA executor warms up")
    for field, why in COMPAT_ONLY.items():
        if getattr(a, field) not in (None, False):
            notes.append(f"{FLAG_OF[field]}: {why}")
    return notes


# ---- running it ----------------------------------------------------------------------


async def serve(
    a: ServerArgs,
    *,
    handle_signals: bool = True,
    on_health: Callable[[str, str], None] | None = None,
) -> int:
    """Run the whole server until it stops; returns the exit code."""
    seed = draw_seed(a)
    log.info("serving", model=a.model_path or "default", deployment=(
        "multi-process" if a.multi_process else "embedded"), host=a.host, port=a.port)  # fmt: skip

    def health(state: str, reason: str) -> None:
        if state == "serving":
            log.info("server ready", url=f"http://{a.host}:{a.port}")
        if on_health is not None:
            on_health(state, reason)

    if a.multi_process:
        return await _serve_multi_process(a, seed, handle_signals, health)
    return await _serve_embedded(a, seed, handle_signals, health)


def bus_dir(a: ServerArgs) -> str:
    """Where this server's broker sockets go (see --bus-dir)."""
    if a.bus_dir is not None:
        return os.path.expanduser(a.bus_dir)
    return os.path.join(tempfile.gettempdir(), f"shunter-{os.getuid()}", str(a.port))


def _start_broker(a: ServerArgs):
    """Start the broker thread in bus_dir(a); returns (broker, endpoints, cleanup) or
    None when it cannot start (logged)."""
    from shunter.bus.broker import Broker
    from shunter.bus.zmq_transport import default_endpoints

    runtime_dir = bus_dir(a)
    os.makedirs(runtime_dir, mode=0o700, exist_ok=True)
    endpoints = default_endpoints(runtime_dir)
    broker = Broker(endpoints.frontend, endpoints.backend)
    try:
        broker.start()
    except Exception as e:  # zmq errors included; ops/ does not import zmq itself
        log.error("the bus broker could not start", error=f"{type(e).__name__}: {e}",
                  frontend=endpoints.frontend)  # fmt: skip
        return None

    def cleanup() -> None:
        broker.stop()
        for ep in endpoints:
            path = ep.removeprefix("ipc://")
            if os.path.exists(path):
                os.unlink(path)
        with contextlib.suppress(OSError):
            os.rmdir(runtime_dir)

    log.info("bus broker started", bus_dir=runtime_dir,
             watch=f"busctl tail --runtime-dir {runtime_dir}")  # fmt: skip
    return broker, endpoints, cleanup


async def _tap(hub, endpoints, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
    """Copy every frame of the in-process hub to the broker, as it is."""
    from shunter.bus.zmq_transport import ZmqBus

    inside = hub.connect("bus-tap")
    outside = ZmqBus("bus-tap", endpoints)
    try:
        async with inside.subscribe_raw("") as sub:
            task_status.started()
            while True:
                for frames in await sub.receive_many(256):
                    await outside.publish_frames(frames)
    finally:
        with anyio.CancelScope(shield=True):
            await outside.aclose()
            await inside.aclose()


async def _serve_embedded(a: ServerArgs, seed: int, handle_signals: bool, health) -> int:
    from shunter.bus.inproc import InProcHub
    from shunter.ops.launch import resolve

    hub = InProcHub()
    started = _start_broker(a)
    if started is None:
        log.warning("serving without a bus tap: busctl tail cannot attach to this server")

    async with anyio.create_task_group() as actors_tg:
        if started is not None:
            await actors_tg.start(_tap, hub, started[1])

        async def launch(spec: ActorSpec, ready: Mapping[str, Ready]) -> EmbeddedActor:
            config = build_config(spec, a, ready, seed)
            entry, _ = resolve(spec.kind)
            bus = hub.connect(spec.actor_id)

            async def main() -> None:
                try:
                    await run_with_heartbeats(
                        spec.actor_id, lambda: entry(config, bus), bus, a.heartbeat_interval
                    )
                finally:
                    with anyio.CancelScope(shield=True):
                        await bus.aclose()

            handle = EmbeddedActor(spec.actor_id, main)
            actors_tg.start_soon(handle.run)
            return handle

        try:
            code = await _supervise(a, hub.connect, launch, handle_signals, health)
        finally:
            actors_tg.cancel_scope.cancel()
    if started is not None:
        started[2]()
    return code


async def _serve_multi_process(a: ServerArgs, seed: int, handle_signals: bool, health) -> int:
    from shunter.bus.zmq_transport import ZmqBus
    from shunter.ops.launch import spawn_actor

    started = _start_broker(a)
    if started is None:
        return 1
    _, endpoints, cleanup = started

    async def launch(spec: ActorSpec, ready: Mapping[str, Ready]):
        config = build_config(spec, a, ready, seed)
        return await spawn_actor(
            spec.kind, spec.actor_id, config, endpoints,
            heartbeat_interval_s=a.heartbeat_interval, log_level=a.log_level,
            log_format=a.log_format,
        )  # fmt: skip

    try:
        return await _supervise(
            a, lambda pid: ZmqBus(pid, endpoints), launch, handle_signals, health
        )
    finally:
        cleanup()


async def _supervise(a: ServerArgs, connect, launch, handle_signals: bool, health) -> int:
    """The recorder (if asked for), then the supervisor over every actor kind."""
    kinds = {s.kind for s in actor_specs(a)}
    sup_bus = connect("supervisor")
    try:
        async with anyio.create_task_group() as tg:
            watchdog = LoopWatchdog(a.watchdog_timeout, interval_s=min(1.0, a.watchdog_timeout / 4))
            tg.start_soon(watchdog.run)
            if a.record_events is not None:
                from shunter.bus.log import record

                rec_bus = connect("recorder")
                await tg.start(record, rec_bus, a.record_events)
            if a.kv_events_config is not None:
                from shunter.bus.kv_events import export_kv_events, parse_config

                kv_bus = connect("kv-events")
                await tg.start(lambda task_status: export_kv_events(
                    kv_bus, parse_config(a.kv_events_config), task_status=task_status))  # fmt: skip
            supervisor = Supervisor(
                supervisor_config(a), sup_bus, dict.fromkeys(kinds, launch),
                handle_signals=handle_signals, on_health=health,
                stop_grace_s=5.0,
            )  # fmt: skip
            code = await supervisor.run()
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await sup_bus.aclose()
            if a.record_events is not None:
                await rec_bus.aclose()
            if a.kv_events_config is not None:
                await kv_bus.aclose()
    return code
