"""Supervisor shell: starts the actors, relays what it sees to the core, carries out its
decisions (start the next stage, publish ActorDied / RequestFailed / Shutdown, stop a
hung actor, exit).

Theory of operation
    `supervise()` owns one bus connection. It subscribes to the messages the core
    watches (Ready, Heartbeat, and the request lifecycle: GenerateRequest, TextDeltas,
    RequestFailed, AbortRequest), sends the core a Tick every `tick_interval_s`, turns SIGTERM/SIGINT
    into Terminate, and starts each actor through a `Launcher` when the core says so.
    A launcher returns an `ActorHandle`: an `EmbeddedActor` (a task in this event loop,
    for the single-process deployment) or a process handle (ops/launch.py, for
    --multi-process). Either way, the supervisor awaits the handle's end and reports it
    to the core as Exited.

    The loop itself is watched too: `LoopWatchdog` (a thread) ends the process when the
    event loop stalls past the watchdog timeout, since then nothing in it can answer.

    Heartbeats: `run_with_heartbeats()` runs an actor's main coroutine beside a task
    that publishes Heartbeat on the actor's own bus every interval. A beat proves the
    actor's event loop turns; an actor whose loop is stuck (or whose process is frozen)
    stops beating and is declared dead by the core's watchdog.

Invariants
    - The supervisor returns exactly one exit code, after every actor it started has
      been stopped (tasks cancelled, processes terminated then killed), the later
      stages (the gateway) first, and after a clean exit only `flush_s` after the last
      failure/abort was published, so the gateway can still deliver it.
    - Every action the core returns is carried out in order before the next event is
      handled (one lock around core + actions), so the core's view and the world agree.
"""

from __future__ import annotations

import abc
import faulthandler
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Mapping

import anyio
import structlog

from shunter.actors.supervisor_core import (
    Action,
    ActorSpec,
    Exit,
    Exited,
    HealthChanged,
    Publish,
    StartActors,
    Started,
    StopActor,
    SupervisorConfig,
    SupervisorCore,
    SupervisorStats,
    Terminate,
    Tick,
)
from shunter.bus.messages import (
    AbortRequest,
    GenerateRequest,
    Heartbeat,
    Ready,
    RequestFailed,
    TextDeltas,
)
from shunter.bus.transport import Bus

log = structlog.get_logger("shunter.supervisor")

WATCHED = (Ready, Heartbeat, GenerateRequest, TextDeltas, RequestFailed, AbortRequest)


async def run_with_heartbeats(
    actor_id: str, main: Callable[[], Awaitable[object]], bus: Bus, interval_s: float
) -> None:
    """Run `main()` and publish Heartbeat(actor_id, n) every interval_s until it ends."""

    async def beat() -> None:
        n = 0
        while True:
            await bus.publish(Heartbeat(actor_id, n))
            n += 1
            await anyio.sleep(interval_s)

    async with anyio.create_task_group() as tg:
        tg.start_soon(beat)
        await main()
        tg.cancel_scope.cancel()


def describe_failure(e: BaseException) -> str:
    """ "raised RuntimeError: boom", looking through single-member exception groups
    (an actor's task group wraps what one of its tasks raised)."""
    while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
        e = e.exceptions[0]
    return f"raised {type(e).__name__}: {e}"


class ActorHandle(abc.ABC):
    """A started actor, wherever it runs."""

    actor_id: str

    @abc.abstractmethod
    async def wait(self) -> str:
        """Wait for the actor to end; returns why ("returned", "exit code 1", ...)."""

    @abc.abstractmethod
    def kill(self) -> None:
        """Stop it now (it may be hung)."""

    @abc.abstractmethod
    async def stop(self, grace_s: float) -> None:
        """Ask it to stop, wait up to grace_s, then kill it; returns when it is gone."""


class EmbeddedActor(ActorHandle):
    """An actor as a task in the supervisor's own event loop."""

    def __init__(self, actor_id: str, main: Callable[[], Awaitable[object]]) -> None:
        self.actor_id = actor_id
        self._main = main
        self._scope = anyio.CancelScope()
        self._done = anyio.Event()
        self.reason = ""

    async def run(self) -> None:
        with self._scope:
            try:
                await self._main()
                self.reason = "returned"
            except Exception as e:  # an actor-scoped failure: the supervisor decides
                log.exception("actor failed", actor=self.actor_id)
                self.reason = describe_failure(e)
        if not self.reason:
            self.reason = "cancelled"
        self._done.set()

    async def wait(self) -> str:
        await self._done.wait()
        return self.reason

    def kill(self) -> None:
        self._scope.cancel()

    async def stop(self, grace_s: float) -> None:
        self._scope.cancel()
        with anyio.move_on_after(max(grace_s, 0.1)):
            await self._done.wait()


class LoopWatchdog:
    """Ends the process when its event loop stops turning for longer than timeout_s.

    In the embedded deployment one blocked loop blocks every actor and the HTTP server
    with it, so nothing inside could report the hang, and clients would wait forever.
    A thread outside the loop notices instead: it dumps every thread's stack (where the
    loop is stuck) and exits the process with STALL_EXIT_CODE, for the process manager
    to restart it. `run()` is the loop's side: it stamps the time every interval_s."""

    STALL_EXIT_CODE = 3

    def __init__(self, timeout_s: float, *, interval_s: float = 1.0) -> None:
        if not 0 < interval_s < timeout_s:
            raise ValueError("LoopWatchdog: need 0 < interval_s < timeout_s")
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self._last = time.monotonic()
        self._stop = threading.Event()

    async def run(self) -> None:
        thread = threading.Thread(target=self._watch, name="loop-watchdog", daemon=True)
        thread.start()
        try:
            while True:
                self._last = time.monotonic()
                await anyio.sleep(self.interval_s)
        finally:
            self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            stalled_s = time.monotonic() - self._last
            if stalled_s > self.timeout_s:
                log.critical("event loop stalled; exiting", stalled_s=round(stalled_s, 1),
                             timeout_s=self.timeout_s)  # fmt: skip
                faulthandler.dump_traceback(all_threads=True)
                os._exit(self.STALL_EXIT_CODE)


Launcher = Callable[[ActorSpec, Mapping[str, Ready]], Awaitable[ActorHandle]]


class Supervisor:
    """One supervised deployment. `run()` returns the process exit code."""

    def __init__(
        self,
        config: SupervisorConfig,
        bus: Bus,
        launchers: Mapping[str, Launcher],
        *,
        handle_signals: bool = True,
        stop_grace_s: float = 5.0,
        flush_s: float = 0.5,
        on_health: Callable[[str, str], None] | None = None,
    ) -> None:
        missing = {a.kind for a in config.actors} - set(launchers)
        if missing:
            raise ValueError(f"supervisor: no launcher for actor kind(s) {sorted(missing)}")
        self.config = config
        self.bus = bus
        self.core = SupervisorCore(config)
        self.launchers = launchers
        self.handle_signals = handle_signals
        self.stop_grace_s = stop_grace_s
        self.flush_s = flush_s
        self.on_health = on_health
        self.handles: dict[str, ActorHandle] = {}
        self.health = "starting"
        self.health_reason = ""
        self.exit: Exit | None = None
        self._lock = anyio.Lock()
        self._tg: anyio.abc.TaskGroup | None = None

    def statistics(self) -> SupervisorStats:
        return self.core.statistics()

    async def terminate(self, signal_name: str = "SIGTERM") -> None:
        """What SIGTERM does; callable directly (tests, embedding)."""
        await self._feed(Terminate(signal_name))

    async def run(self) -> int:
        async with anyio.create_task_group() as outer:
            self._tg = outer
            sub = self.bus.subscribe(types=WATCHED)
            await sub.wait_connected()
            outer.start_soon(self._pump, sub)
            outer.start_soon(self._ticker)
            if self.handle_signals:
                outer.start_soon(self._signals)
            async with self._lock:
                await self._apply(self.core.start(time.monotonic_ns()))
            # Everything else happens in the tasks; _apply(Exit) cancels this group.
        assert self.exit is not None
        if self.exit.code == 0:
            # Failures and aborts published just now must reach their clients before the
            # gateway goes away.
            with anyio.CancelScope(shield=True):
                await anyio.sleep(self.flush_s)
        await self._stop_all()
        log.info("supervisor exit", code=self.exit.code, reason=self.exit.reason)
        return self.exit.code

    # -- feeding the core --

    async def _feed(self, event) -> None:
        async with self._lock:
            if self.exit is None:
                await self._apply(self.core.handle(event, time.monotonic_ns()))

    async def _pump(self, sub) -> None:
        async for received in sub:
            await self._feed(received.msg)

    async def _ticker(self) -> None:
        while True:
            await anyio.sleep(self.config.tick_interval_s)
            await self._feed(Tick())

    async def _signals(self) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                name = signal.Signals(signum).name
                log.info("signal received", signal=name)
                await self._feed(Terminate(name))

    async def _watch(self, handle: ActorHandle) -> None:
        reason = await handle.wait()
        await self._feed(Exited(handle.actor_id, reason))

    # -- carrying out actions --

    async def _apply(self, actions: list[Action]) -> None:
        for action in actions:
            if self.exit is not None:
                return
            match action:
                case StartActors(ids):
                    for actor_id in ids:
                        if self.exit is None:
                            await self._start(actor_id)
                case Publish(msg):
                    await self.bus.publish(msg)
                case StopActor(actor_id):
                    handle = self.handles.get(actor_id)
                    if handle is not None:
                        log.warning("stopping hung actor", actor=actor_id)
                        handle.kill()
                case HealthChanged(state, reason):
                    self.health, self.health_reason = state, reason
                    log.info("health", state=state, reason=reason)
                    if self.on_health is not None:
                        self.on_health(state, reason)
                case Exit():
                    self.exit = action
                    assert self._tg is not None
                    self._tg.cancel_scope.cancel()
                    return

    async def _start(self, actor_id: str) -> None:
        spec = next(a for a in self.config.actors if a.actor_id == actor_id)
        log.info("starting actor", actor=actor_id, stage=spec.stage)
        try:
            handle = await self.launchers[spec.kind](spec, dict(self.core.ready_info))
        except ValueError as e:  # a config the actor refuses, an actor missing: one line
            log.error("actor could not be started", actor=actor_id, error=str(e))
            await self._apply(self.core.handle(Started(actor_id), time.monotonic_ns()))
            reason = f"could not start: {e}"
            await self._apply(self.core.handle(Exited(actor_id, reason), time.monotonic_ns()))
            return
        except Exception as e:
            log.exception("actor could not be started", actor=actor_id)
            await self._apply(self.core.handle(Started(actor_id), time.monotonic_ns()))
            reason = f"could not start: {type(e).__name__}: {e}"
            await self._apply(self.core.handle(Exited(actor_id, reason), time.monotonic_ns()))
            return
        self.handles[actor_id] = handle
        await self._apply(self.core.handle(Started(actor_id), time.monotonic_ns()))
        assert self._tg is not None
        self._tg.start_soon(self._watch, handle)

    async def _stop_all(self) -> None:
        """Stop every actor, the later stages (the gateway) first."""
        order = sorted(self.config.actors, key=lambda a: -a.stage)
        with anyio.CancelScope(shield=True):
            for spec in order:
                handle = self.handles.get(spec.actor_id)
                if handle is not None:
                    await handle.stop(self.stop_grace_s)


async def supervise(
    config: SupervisorConfig, bus: Bus, launchers: Mapping[str, Launcher], **kw
) -> int:
    return await Supervisor(config, bus, launchers, **kw).run()
