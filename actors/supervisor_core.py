"""Supervisor core: the decisions of starting, watching and stopping the actors, no I/O.

Theory of operation
    The shell (actors/supervisor.py) starts actors, relays what it sees, and carries out
    the actions this core returns. Everything the core knows arrives through `handle(
    event, now_ns)`: a bus message it watches (Ready, Heartbeat, the request lifecycle),
    or a fact from the shell (an actor was started or exited, a Tick, SIGTERM).

    Start-up is staged. Each actor has a stage number; stage n starts only when every
    actor of the earlier stages said Ready (the executor must report its KV pool size
    before the cache manager can be configured; the gateway, in the last stage, opens
    its port only after everything else is Ready). When the last stage is Ready the
    server is "serving".

    Liveness: an actor is dead when its task/process exits, when it misses its start
    deadline (not Ready within start_timeout of being started), or when no
    Heartbeat arrived within watchdog_timeout. A death during start-up stops the
    server (exit 1: it could never serve). A death while serving publishes ActorDied
    and fails every in-flight request with RequestFailed(code "actor_died", 503): the
    server stays up, reports "unhealthy", and never leaves a client hanging.

    The core follows the request lifecycle on the bus (GenerateRequest opens a request;
    a final TextDelta or a RequestFailed ends it), which is what lets it fail in-flight
    requests and know when a drain is done, whatever the gateway does. An AbortRequest
    also ends a request in this view: its client is gone, so a drain need not wait.

    Drain (SIGTERM): publish Shutdown, refuse every request that still arrives
    (RequestFailed "shutting_down" 503 and an AbortRequest so no actor keeps working
    on it), wait until no request is in flight or shutdown_timeout passed (then the
    requests still in flight fail with "shutting_down"), and exit 0. A second
    Terminate exits at once.

    Stalls: if Ticks arrive late (the observer's own loop was blocked, e.g. by a long
    synchronous load in the embedded mode), the time it was blind is added to every
    deadline, so actors are not declared dead for the observer's own stall.

Invariants
    - Each actor dies at most once; its ActorDied is published once.
    - Every request the core saw open ends exactly once in its view.
    - Exit is returned at most once; after it the core ignores everything.
"""

from __future__ import annotations

import msgspec

from shunter.bus.messages import (
    AbortRequest,
    ActorDied,
    GenerateRequest,
    Heartbeat,
    Msg,
    Ready,
    RequestFailed,
    Shutdown,
    TextDeltas,
)

NS = 1_000_000_000


class ActorSpec(msgspec.Struct, frozen=True):
    actor_id: str  # e.g. "executor.0"; unique
    kind: str  # "executor", "cache", "scheduler", "tokenizer", "gateway", ...
    stage: int = 0  # start order; a stage starts when all earlier stages are Ready


class SupervisorConfig(msgspec.Struct, frozen=True):
    actors: list[ActorSpec]
    watchdog_timeout_s: float = 300.0  # longest silence (no heartbeat) of a Ready actor
    start_timeout_s: float = 600.0  # longest time from start to Ready (loading weights)
    shutdown_timeout_s: float = 30.0
    tick_interval_s: float = 0.25  # how often the shell sends Tick (for stall detection)

    def __post_init__(self) -> None:
        ids = [a.actor_id for a in self.actors]
        if not ids:
            raise ValueError("supervisor: no actors to supervise")
        if len(set(ids)) != len(ids):
            raise ValueError(f"supervisor: actor ids repeat: {sorted(ids)}")
        if not (self.watchdog_timeout_s > 0 and self.start_timeout_s > 0):
            raise ValueError("supervisor: watchdog_timeout_s and start_timeout_s must be > 0")
        if self.shutdown_timeout_s < 0:
            raise ValueError("supervisor: shutdown_timeout_s must be >= 0")


# ---- events from the shell ----------------------------------------------------------


class Started(msgspec.Struct, frozen=True):
    actor_id: str


class Exited(msgspec.Struct, frozen=True):
    actor_id: str
    reason: str  # "exit code 1", "raised RuntimeError: ...", "returned"


class Tick(msgspec.Struct, frozen=True):
    pass


class Terminate(msgspec.Struct, frozen=True):
    signal: str = "SIGTERM"


Event = Started | Exited | Tick | Terminate | Msg

# ---- actions for the shell ----------------------------------------------------------


class StartActors(msgspec.Struct, frozen=True):
    actor_ids: list[str]


class Publish(msgspec.Struct, frozen=True):
    msg: Msg


class StopActor(msgspec.Struct, frozen=True):
    """Kill a dead-but-running actor (hung: no heartbeat), so it cannot come back."""

    actor_id: str


class HealthChanged(msgspec.Struct, frozen=True):
    state: str  # "starting", "serving", "unhealthy", "draining", "stopped"
    reason: str = ""


class Exit(msgspec.Struct, frozen=True):
    code: int
    reason: str


Action = StartActors | Publish | StopActor | HealthChanged | Exit


class SupervisorStats(msgspec.Struct, frozen=True):
    state: str
    num_actors: int
    num_ready: int
    num_dead: int
    num_in_flight: int
    num_failed_by_death: int  # requests failed because an actor died
    num_refused_while_draining: int
    num_heartbeats: int
    stall_ns: int  # total observer stall added to deadlines


class _Actor:
    __slots__ = ("deadline_ns", "spec", "started", "state")

    def __init__(self, spec: ActorSpec) -> None:
        self.spec = spec
        self.state = "pending"  # pending -> starting -> ready -> dead | exited
        self.started = False
        self.deadline_ns = 0


class SupervisorCore:
    def __init__(self, config: SupervisorConfig) -> None:
        self.config = config
        self._actors = {a.actor_id: _Actor(a) for a in config.actors}
        self._stages = sorted({a.stage for a in config.actors})
        self._next_stage_idx = 0
        self._watchdog_ns = int(config.watchdog_timeout_s * NS)
        self._start_ns = int(config.start_timeout_s * NS)
        self._state = "starting"
        self._in_flight: set[str] = set()
        self._drain_deadline_ns = 0
        self._last_tick_ns: int | None = None
        self._done = False
        self._num_failed_by_death = 0
        self._num_refused = 0
        self._num_beats = 0
        self._stall_ns = 0
        self.ready_info: dict[str, Ready] = {}

    # -- the one entry point --

    def handle(self, event: Event, now_ns: int) -> list[Action]:
        if self._done:
            return []
        match event:
            case Started(actor_id):
                return self._started(actor_id, now_ns)
            case Ready():
                return self._ready(event, now_ns)
            case Heartbeat(actor_id):
                self._num_beats += 1
                actor = self._actors.get(actor_id)
                if actor is not None and actor.state == "ready":
                    actor.deadline_ns = now_ns + self._watchdog_ns
                return []
            case Exited(actor_id, reason):
                return self._exited(actor_id, reason, now_ns)
            case Tick():
                return self._tick(now_ns)
            case Terminate(sig):
                return self._terminate(sig, now_ns)
            case GenerateRequest(request_id=rid):
                return self._request_opened(rid)
            case TextDeltas(deltas):
                for d in deltas:
                    if d.finish_reason is not None:
                        self._in_flight.discard(d.request_id)
                return self._maybe_drained()
            case RequestFailed(request_id=rid) | AbortRequest(request_id=rid):
                # An aborted request's client is gone (or its stop string matched): there
                # is nobody left to drain it for.
                self._in_flight.discard(rid)
                return self._maybe_drained()
        return []

    def start(self, now_ns: int) -> list[Action]:
        """The first actions: start stage 0."""
        self._last_tick_ns = now_ns
        return [HealthChanged("starting"), *self._start_next_stage()]

    @property
    def state(self) -> str:
        return self._state

    def statistics(self) -> SupervisorStats:
        states = [a.state for a in self._actors.values()]
        return SupervisorStats(
            state=self._state,
            num_actors=len(states),
            num_ready=states.count("ready"),
            num_dead=states.count("dead"),
            num_in_flight=len(self._in_flight),
            num_failed_by_death=self._num_failed_by_death,
            num_refused_while_draining=self._num_refused,
            num_heartbeats=self._num_beats,
            stall_ns=self._stall_ns,
        )

    # -- start-up --

    def _start_next_stage(self) -> list[Action]:
        if self._next_stage_idx >= len(self._stages):
            return []
        stage = self._stages[self._next_stage_idx]
        self._next_stage_idx += 1
        ids = [a.actor_id for a in self.config.actors if a.stage == stage]
        return [StartActors(ids)]

    def _started(self, actor_id: str, now_ns: int) -> list[Action]:
        actor = self._actors.get(actor_id)
        if actor is None or actor.started:
            return []
        actor.started = True
        if actor.state == "pending":
            actor.state = "starting"
            actor.deadline_ns = now_ns + self._start_ns
        return []

    def _ready(self, msg: Ready, now_ns: int) -> list[Action]:
        actor = self._actors.get(msg.actor_id)
        if actor is None or actor.state not in ("pending", "starting"):
            return []  # unknown, repeated, or too late (already declared dead)
        actor.state = "ready"
        actor.deadline_ns = now_ns + self._watchdog_ns
        self.ready_info[msg.actor_id] = msg
        if self._state != "starting":
            return []
        current = self._stages[self._next_stage_idx - 1]
        if any(a.state != "ready" for a in self._actors.values() if a.spec.stage <= current):
            return []
        if self._next_stage_idx < len(self._stages):
            return self._start_next_stage()
        self._state = "serving"
        return [HealthChanged("serving")]

    # -- deaths --

    def _exited(self, actor_id: str, reason: str, now_ns: int) -> list[Action]:
        actor = self._actors.get(actor_id)
        if actor is None or actor.state in ("dead", "exited"):
            return []
        if self._state == "draining" and actor.spec.kind == "gateway":
            # The gateway finished its own drain; without it nothing can be asked.
            actor.state = "exited"
            return self._exit(0, f"drained: gateway exited ({reason})")
        return self._died(actor, f"{actor_id} stopped: {reason}", now_ns, kill=False)

    def _died(self, actor: _Actor, reason: str, now_ns: int, *, kill: bool) -> list[Action]:
        actor.state = "dead"
        out: list[Action] = [StopActor(actor.spec.actor_id)] if kill else []
        out.append(Publish(ActorDied(actor.spec.actor_id, reason)))
        if self._state == "starting":
            return [*out, *self._exit(1, f"start-up failed: {reason}")]
        for rid in sorted(self._in_flight):
            out.append(Publish(RequestFailed(rid, "actor_died", reason, http_status=503)))
        self._num_failed_by_death += len(self._in_flight)
        self._in_flight.clear()
        if actor.spec.kind == "gateway":
            return [*out, *self._exit(1, reason)]
        if self._state == "draining":
            return [*out, *self._maybe_drained()]
        if self._state == "serving":
            self._state = "unhealthy"
            out.append(HealthChanged("unhealthy", reason))
        return out

    def _tick(self, now_ns: int) -> list[Action]:
        if self._last_tick_ns is not None:
            late_ns = now_ns - self._last_tick_ns - int(2 * self.config.tick_interval_s * NS)
            if late_ns > 0:
                self._stall_ns += late_ns
                for a in self._actors.values():
                    a.deadline_ns += late_ns
                self._drain_deadline_ns += late_ns if self._drain_deadline_ns else 0
        self._last_tick_ns = now_ns
        out: list[Action] = []
        for a in self._actors.values():
            if a.state == "starting" and now_ns > a.deadline_ns:
                limit = self.config.start_timeout_s
                out += self._died(a, f"{a.spec.actor_id} not ready after {limit:g} s", now_ns,
                                  kill=True)  # fmt: skip
            elif a.state == "ready" and now_ns > a.deadline_ns:
                limit = self.config.watchdog_timeout_s
                out += self._died(a, f"{a.spec.actor_id} sent no heartbeat for {limit:g} s",
                                  now_ns, kill=True)  # fmt: skip
            if self._done:
                return out
        if self._state == "draining" and now_ns >= self._drain_deadline_ns:
            n = len(self._in_flight)
            reason = f"drain timed out with {n} request(s) in flight"
            for rid in sorted(self._in_flight):
                out.append(Publish(RequestFailed(rid, "shutting_down", reason, http_status=503)))
            self._in_flight.clear()
            out += self._exit(0, reason)
        return out

    # -- requests and drain --

    def _request_opened(self, request_id: str) -> list[Action]:
        if self._state != "draining":
            self._in_flight.add(request_id)
            return []
        self._num_refused += 1
        return [
            Publish(RequestFailed(request_id, "shutting_down",
                                  "the server is shutting down", http_status=503)),
            Publish(AbortRequest(request_id, reason="shutdown")),
        ]  # fmt: skip

    def _terminate(self, sig: str, now_ns: int) -> list[Action]:
        if self._state == "draining":
            return self._exit(0, f"second {sig}: stopping without waiting")
        if self._state == "starting":
            return self._exit(0, f"{sig} during start-up")
        self._state = "draining"
        self._drain_deadline_ns = now_ns + int(self.config.shutdown_timeout_s * NS)
        out: list[Action] = [
            HealthChanged("draining", sig),
            Publish(Shutdown(sig, drain_timeout_s=self.config.shutdown_timeout_s)),
        ]
        return out + self._maybe_drained()

    def _maybe_drained(self) -> list[Action]:
        if self._state == "draining" and not self._in_flight:
            return self._exit(0, "drained: no request in flight")
        return []

    def _exit(self, code: int, reason: str) -> list[Action]:
        self._done = True
        self._state = "stopped"
        return [HealthChanged("stopped", reason), Exit(code, reason)]
