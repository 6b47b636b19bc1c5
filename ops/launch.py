"""Process launching for `shunter serve --multi-process`: one actor per process.

    python -m shunter.ops.launch KIND --actor-id ID --config-json JSON|- \\
        [--frontend EP --backend EP] [--heartbeat-interval S] [--log-level L]

Theory of operation
    KIND names a registered actor (`ACTORS`: executor, cache, scheduler, tokenizer,
    gateway) or is a `module:function` (with `--config-type module:Type`, or the config
    stays a dict). The child configures logging, connects a ZmqBus to the broker under
    ID, decodes the config with the actor's own config type (so a bad config is a clear
    exit 2 before anything loads), and runs `entry(config, bus)` beside the heartbeat
    task. The supervisor passes the config on stdin (`--config-json -`), so API keys
    never show in the process list.

    Exit codes: 0 after SIGTERM/SIGINT or when the actor returned, 1 when the actor
    raised (logged with its traceback), 2 for bad arguments or config. A child whose
    parent died (it was re-parented) stops on its own, so no orphan keeps a model
    loaded after a crashed server.

    In the parent, `spawn_actor` starts a child and returns a `ProcessActor`: the
    supervisor's handle (wait for the exit, terminate with a grace period, kill).
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping
from typing import Any

import anyio
import anyio.abc
import msgspec
import structlog

from shunter.actors.supervisor import ActorHandle, describe_failure, run_with_heartbeats

log = structlog.get_logger("shunter.launch")

# kind -> (entry "module:function" taking (config, bus), config type "module:Type")
ACTORS: dict[str, tuple[str, str]] = {
    "executor": ("shunter.actors.executor.actor:run", "shunter.actors.executor.config:ExecutorConfig"),
    "cache": ("shunter.actors.cache_manager.actor:run", "shunter.actors.cache_manager.config:CacheConfig"),
    "scheduler": ("shunter.actors.scheduler.actor:run", "shunter.actors.scheduler.config:SchedulerConfig"),
    "tokenizer": ("shunter.actors.tokenizer.actor:run", "shunter.actors.tokenizer.config:TokenizerConfig"),
    "gateway": ("shunter.gateway.actor:run", "shunter.gateway.config:GatewayConfig"),
}  # fmt: skip

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def load_object(path: str) -> Any:
    """'package.module:name' -> the object; ValueError with the reason otherwise."""
    module_name, sep, name = path.partition(":")
    if not sep or not module_name or not name:
        raise ValueError(f"{path!r}: expected module:name")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{path!r}: cannot import {module_name}: {e}") from None
    try:
        return getattr(module, name)
    except AttributeError:
        raise ValueError(f"{path!r}: {module_name} has no {name!r}") from None


def resolve(kind: str, config_type: str | None = None) -> tuple[Callable, type | None]:
    """An actor kind -> (entry function, config type or None for a plain dict)."""
    if kind in ACTORS:
        entry_path, type_path = ACTORS[kind]
        return load_object(entry_path), load_object(type_path)
    if ":" not in kind:
        raise ValueError(f"unknown actor {kind!r}: one of {', '.join(ACTORS)} or module:function")
    return load_object(kind), load_object(config_type) if config_type else None


def decode_config(text: str | bytes, config_type: type | None) -> Any:
    """JSON -> the actor's config object, with the validation message on failure."""
    try:
        if config_type is None:
            value = msgspec.json.decode(text)
            if not isinstance(value, dict):
                raise ValueError("the config must be a JSON object")
            return value
        return msgspec.json.decode(text, type=config_type)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ValueError(f"bad config: {e}") from None


# ---- the child -----------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The child's options (also what a `shunter launch` subcommand would take)."""
    from shunter.bus.zmq_transport import default_endpoints

    eps = default_endpoints()
    p.add_argument("actor", help=f"{', '.join(ACTORS)}, or module:function")
    p.add_argument("--actor-id", required=True, help="bus publisher id (e.g. executor.0)")
    p.add_argument("--config-json", default="{}", help="the config as JSON, or - for stdin")
    p.add_argument("--config-type", help="module:Type of the config of a module:function actor")
    p.add_argument("--frontend", default=eps.frontend, help="broker endpoint for publishers")
    p.add_argument("--backend", default=eps.backend, help="broker endpoint for subscribers")
    p.add_argument("--heartbeat-interval", type=float, default=1.0, metavar="SECONDS")
    p.add_argument("--connect-timeout", type=float, default=30.0, metavar="SECONDS")
    p.add_argument("--log-level", default="info")
    p.add_argument("--log-format", default="auto")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m shunter.ops.launch", allow_abbrev=False,
        description="run one actor in this process, on the ZMQ bus",
    )  # fmt: skip
    add_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run one actor until it ends or a signal stops it; returns the exit code."""
    from shunter.ops import logging as shunter_logging

    try:
        shunter_logging.configure(args.log_level, args.log_format)
        if not args.heartbeat_interval > 0:
            raise ValueError("--heartbeat-interval must be > 0")
        entry, config_type = resolve(args.actor, args.config_type)
        text = sys.stdin.buffer.read() if args.config_json == "-" else args.config_json
        config = decode_config(text, config_type)
    except ValueError as e:
        print(f"launch {args.actor} ({args.actor_id}): {e}", file=sys.stderr)
        return EXIT_USAGE
    structlog.contextvars.bind_contextvars(actor=args.actor_id)
    return anyio.run(_child, args, entry, config, backend="asyncio")


async def _child(args: argparse.Namespace, entry: Callable, config: Any) -> int:
    from shunter.bus.zmq_transport import BusEndpoints, ZmqBus

    code = EXIT_OK
    bus = ZmqBus(args.actor_id, BusEndpoints(args.frontend, args.backend))
    try:
        await bus.wait_connected(args.connect_timeout)
        async with anyio.create_task_group() as tg:
            tg.start_soon(_stop_on_signal, tg.cancel_scope)
            tg.start_soon(_stop_when_orphaned, tg.cancel_scope, os.getppid())
            try:
                await run_with_heartbeats(
                    args.actor_id, lambda: entry(config, bus), bus, args.heartbeat_interval
                )
                log.info("actor returned")
            except Exception as e:
                log.exception("actor failed", reason=describe_failure(e))
                code = EXIT_FAILED
            tg.cancel_scope.cancel()
    except TimeoutError:
        log.error("bus not reachable", frontend=args.frontend, backend=args.backend)
        code = EXIT_FAILED
    finally:
        with anyio.CancelScope(shield=True):
            await bus.aclose()
    return code


async def _stop_on_signal(scope: anyio.CancelScope) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("stopping", signal=signal.Signals(signum).name)
            scope.cancel()
            return


async def _stop_when_orphaned(scope: anyio.CancelScope, parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        await anyio.sleep(1.0)
    log.error("parent process died; stopping", parent_pid=parent_pid)
    scope.cancel()


# ---- the parent's handle -------------------------------------------------------------


class ProcessActor(ActorHandle):
    """An actor running in a child process."""

    def __init__(self, actor_id: str, process: anyio.abc.Process) -> None:
        self.actor_id = actor_id
        self.process = process

    @property
    def pid(self) -> int:
        return self.process.pid

    async def wait(self) -> str:
        return exit_reason(await self.process.wait())

    def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()

    async def stop(self, grace_s: float) -> None:
        if self.process.returncode is None:
            self.process.terminate()
            with anyio.move_on_after(grace_s):
                await self.process.wait()
        if self.process.returncode is None:
            log.warning("actor did not stop in time; killing", actor=self.actor_id)
            self.process.kill()
            await self.process.wait()


def exit_reason(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


async def spawn_actor(
    kind: str,
    actor_id: str,
    config: Any,
    endpoints: Any,
    *,
    heartbeat_interval_s: float = 1.0,
    log_level: str = "info",
    log_format: str = "auto",
    config_type: str | None = None,
    env: Mapping[str, str] | None = None,
) -> ProcessActor:
    """Start `python -m shunter.ops.launch KIND` with the config on its stdin."""
    cmd = [
        sys.executable, "-m", "shunter.ops.launch", kind, "--actor-id", actor_id,
        "--config-json", "-", "--frontend", endpoints.frontend, "--backend", endpoints.backend,
        "--heartbeat-interval", repr(heartbeat_interval_s), "--log-level", log_level,
        "--log-format", log_format,
    ]  # fmt: skip
    if config_type is not None:
        cmd += ["--config-type", config_type]
    process = await anyio.open_process(
        cmd, stdin=subprocess.PIPE, stdout=None, stderr=None, start_new_session=True,
        env={**os.environ, **env} if env is not None else None,
    )  # fmt: skip
    assert process.stdin is not None
    try:
        await process.stdin.send(msgspec.json.encode(config))
    finally:
        await process.stdin.aclose()
    log.info("actor process started", actor=actor_id, pid=process.pid)
    return ProcessActor(actor_id, process)


if __name__ == "__main__":
    raise SystemExit(main())
