"""The gateway's bus side: requests out, deltas routed back to per-request queues.

Theory of operation
-------------------
`Engine.listen` is one task that reads the gateway's inbox (TextDeltas, RequestFailed,
ActorDied, SchedulerStats, CacheStats, Shutdown) and puts each delta or failure on the
queue of the request it belongs to. HTTP handlers call `Engine.generate`, which
registers the queues *before* publishing the GenerateRequests, so no output can arrive
unrouted, and read them through `RequestStream.next`. A handler that ends before its requests finish
(client gone, error elsewhere) calls `Engine.abort`, which publishes AbortRequest and
forgets the queues: late outputs for them are dropped.

Invariants
----------
- Every registered request ends: a delta with finish_reason, a RequestFailed, an
  ActorDied (all in-flight requests fail with 503), the gateway's own abort, or a 504
  when `request_timeout_s` passes without output.
- A request id is in flight at most once.
- Queues are unbounded so one slow client never holds up the reader (deltas are small
  and a request produces a bounded number of them).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid

import anyio
import msgspec
import structlog

from shunter.bus.messages import (
    AbortRequest,
    ActorDied,
    CacheStats,
    ClearStore,
    DetokenizeQuery,
    DetokenizeReply,
    DropTree,
    GenerateRequest,
    HealthPing,
    HealthPong,
    RequestFailed,
    SchedulerStats,
    Shutdown,
    StoreCleared,
    TextDelta,
    TextDeltas,
    TokenizeQuery,
    TokenizeReply,
    TreeDropped,
)
from shunter.bus.transport import Bus
from shunter.gateway.config import GatewayConfig
from shunter.gateway.errors import APIError, from_request_failed
from shunter.gateway.flips import Flips
from shunter.gateway.metrics import Metrics

log = structlog.get_logger(actor="gateway")

INBOX_TYPES = (TextDeltas, RequestFailed, ActorDied, SchedulerStats, CacheStats, Shutdown)


def new_id(prefix: str = "") -> str:
    return prefix + uuid.uuid4().hex


def draw_seed() -> int:
    """A fresh sampling seed for a request that gave none (the gateway is no core)."""
    return random.getrandbits(31)


class RequestStream:
    """One request's bookkeeping; its outputs go to its group's queue."""

    def __init__(self, group: RequestGroup, request_id: str, tracked: bool = True) -> None:
        self.group = group
        self.request_id = request_id
        self.tracked = tracked  # counted in metrics (health probes are not)
        self.done = False  # saw its end (or was aborted)
        self.arrival_s = time.monotonic()
        self.first_s: float | None = None
        self.last_s: float | None = None
        self.last: TextDelta | None = None


class RequestGroup:
    """The requests of one HTTP call (n choices, several prompts): their outputs arrive
    on one queue, in the order the engine produced them."""

    def __init__(self, engine: Engine, request_ids: list[str], tracked: bool = True) -> None:
        self.engine = engine
        self.queue: asyncio.Queue[TextDelta | RequestFailed] = asyncio.Queue()
        self.streams = [RequestStream(self, rid, tracked) for rid in request_ids]
        self.index = {rid: i for i, rid in enumerate(request_ids)}
        self.num_open = len(request_ids)

    @property
    def done(self) -> bool:
        return self.num_open == 0

    async def next(self) -> tuple[int, TextDelta]:
        """(index of the request, its next delta); raises APIError when one failed or
        the engine went quiet past request_timeout_s."""
        timeout = self.engine.config.request_timeout_s
        try:
            item = await asyncio.wait_for(self.queue.get(), timeout)
        except TimeoutError:
            for s in self.streams:
                self.engine._fail(s.request_id)
            raise APIError(
                504, f"no output from the engine for {timeout} s", code="timeout"
            ) from None
        if isinstance(item, RequestFailed):
            raise from_request_failed(item.code, item.message, item.http_status)
        if item.finish_reason is not None:
            self.num_open -= 1
        return self.index[item.request_id], item

    def __aiter__(self):
        return self

    async def __anext__(self) -> tuple[int, TextDelta]:
        if self.done:
            raise StopAsyncIteration
        return await self.next()


class GatewayStats(msgspec.Struct, frozen=True):
    num_in_flight: int  # requests the gateway waits on
    num_requests: int  # received since start (health probes excluded)
    num_failed: int
    dead_actors: tuple[str, ...]
    shutting_down: bool


class Engine:
    def __init__(self, bus: Bus, config: GatewayConfig, metrics: Metrics) -> None:
        self.bus = bus
        self.config = config
        self.metrics = metrics
        self.streams: dict[str, RequestStream] = {}
        self.dead: dict[str, str] = {}  # actor id -> reason, from ActorDied
        self.shutting_down: str | None = None
        self.stats: SchedulerStats | None = None
        self.cache_stats: CacheStats | None = None
        self.flips = Flips(bus, load_timeout_s=config.weights_load_timeout_s)

    def statistics(self) -> GatewayStats:
        m = self.metrics
        return GatewayStats(
            len(self.streams), m.num_requests_total, m.num_failed_total,
            tuple(sorted(self.dead)), self.shutting_down is not None,
        )  # fmt: skip

    # -- the reader task -----------------------------------------------------------------

    async def listen(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        async with self.bus.subscribe(types=INBOX_TYPES) as sub:
            task_status.started()
            async for received in sub:
                self._on(received.msg)

    def _on(self, msg) -> None:
        match msg:
            case TextDeltas():
                now = time.monotonic()
                for d in msg.deltas:
                    s = self.streams.get(d.request_id)
                    if s is not None:
                        self._route(s, d, now)
            case RequestFailed():
                self._fail(msg.request_id, msg)
            case ActorDied():
                log.error("actor died; failing in-flight requests", actor_id=msg.actor_id,
                          reason=msg.reason, num_in_flight=len(self.streams))  # fmt: skip
                self.dead[msg.actor_id] = msg.reason
                for rid in list(self.streams):
                    self._fail(rid, RequestFailed(
                        rid, "actor_died", f"the engine failed: {msg.actor_id} died ({msg.reason})",
                        503))  # fmt: skip
            case SchedulerStats():
                self.stats = msg
                self.metrics.stats = msg
            case CacheStats():
                self.cache_stats = msg
                self.metrics.cache = msg
            case Shutdown():
                self.shutting_down = msg.reason

    def _route(self, s: RequestStream, d: TextDelta, now: float) -> None:
        if s.first_s is None:
            s.first_s = now
            if s.tracked:
                self.metrics.first_token(now - s.arrival_s)
        elif s.tracked:
            self.metrics.tokens(len(d.token_ids), now - (s.last_s or now))
        s.last_s = now
        s.last = d
        s.group.queue.put_nowait(d)
        if d.finish_reason is not None:
            del self.streams[s.request_id]
            s.done = True
            self._finished(s, d.finish_reason, d, now)

    def _finished(self, s: RequestStream, reason: str, d: TextDelta | None, now: float) -> None:
        (log.info if self.config.log_requests else log.debug)(
            "request finished", request_id=s.request_id, finish_reason=reason,
            num_prompt_tokens=d.num_prompt_tokens if d else 0,
            num_completion_tokens=d.num_completion_tokens if d else 0,
            num_cached_tokens=d.num_cached_tokens if d else 0,
            e2e_s=round(now - s.arrival_s, 6),
        )  # fmt: skip
        if not s.tracked:
            return
        self.metrics.request_finished(
            reason,
            num_prompt_tokens=d.num_prompt_tokens if d else 0,
            num_completion_tokens=d.num_completion_tokens if d else 0,
            num_cached_tokens=d.num_cached_tokens if d else 0,
            e2e_s=now - s.arrival_s,
            decode_s=now - (s.first_s or now),
        )

    def _fail(self, rid: str, failure: RequestFailed | None = None) -> None:
        s = self.streams.pop(rid, None)
        if s is None:
            return
        s.done = True
        if s.tracked:
            self.metrics.request_failed()
        if failure is not None:
            s.group.queue.put_nowait(failure)
        else:  # timed out: the engine may still hold it
            with contextlib.suppress(anyio.WouldBlock):
                self.bus.publish_nowait(AbortRequest(rid, "client"))

    # -- what handlers call --------------------------------------------------------------

    def check_available(self) -> None:
        if self.dead:
            actor, reason = next(iter(self.dead.items()))
            raise APIError(503, f"the engine is unavailable: {actor} died ({reason})",
                           code="engine_unavailable")  # fmt: skip
        if self.shutting_down is not None:
            raise APIError(503, f"the server is shutting down ({self.shutting_down})",
                           code="shutting_down")  # fmt: skip

    async def generate(
        self, requests: list[GenerateRequest], *, tracked: bool = True
    ) -> RequestGroup:
        """Register and publish requests; their group (streams in the same order).
        Untracked requests (health probes) stay out of the metrics."""
        self.check_available()
        ids = [r.request_id for r in requests]
        taken = [rid for rid in ids if rid in self.streams]
        if taken or len(set(ids)) != len(ids):
            raise APIError(400, f"request id {(taken or ids)[0]!r} is already in flight",
                           param="rid", code="duplicate_request_id")  # fmt: skip
        group = RequestGroup(self, ids, tracked)
        for s in group.streams:
            self.streams[s.request_id] = s
        if tracked:
            self.metrics.request_started(len(ids))
        try:
            for r in requests:
                await self.bus.publish(r)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.abort(group.streams, "disconnect")
            raise
        return group

    async def abort(self, streams: list[RequestStream], reason: str) -> None:
        """End requests that are still running (client gone, admin, sibling failed)."""
        now = time.monotonic()
        for s in streams:
            if s.done:
                continue
            s.done = True
            self.streams.pop(s.request_id, None)
            self._finished(s, "abort", s.last, now)
            await self.bus.publish(AbortRequest(s.request_id, reason))

    async def abort_id(self, request_id: str, reason: str) -> bool:
        """Admin abort by id; a request split by n also matches its `id-i` parts."""

        def matches(rid: str) -> bool:
            suffix = rid[len(request_id) + 1 :]
            return rid == request_id or (rid.startswith(request_id + "-") and suffix.isdigit())

        hits = [s for rid, s in self.streams.items() if matches(rid)]
        for s in hits:
            last = s.last
            s.group.queue.put_nowait(
                TextDelta(
                    s.request_id, "", [], finish_reason="abort",
                    num_prompt_tokens=last.num_prompt_tokens if last else 0,
                    num_completion_tokens=last.num_completion_tokens if last else 0,
                    num_cached_tokens=last.num_cached_tokens if last else 0,
                )
            )  # fmt: skip
        await self.abort(hits, reason)
        return bool(hits)

    async def abort_all(self, reason: str) -> list[str]:
        """Admin abort of every request in flight; the ids that were aborted."""
        return [rid for rid in sorted(self.streams) if await self.abort_id(rid, reason)]

    async def tokenize(self, query: TokenizeQuery) -> TokenizeReply:
        self.check_available()
        return await self._query(query, TokenizeReply)

    async def detokenize(self, query: DetokenizeQuery) -> DetokenizeReply:
        self.check_available()
        return await self._query(query, DetokenizeReply)

    async def ask(self, msg, reply_type, match, who: str, timeout_s: float | None = None):
        """Publish `msg` and return the first `reply_type` message `match` accepts; 504
        naming `who` when none comes within timeout_s (default query_timeout_s)."""
        timeout_s = self.config.query_timeout_s if timeout_s is None else timeout_s
        try:
            return await self.bus.request(msg, reply=reply_type, match=match, timeout_s=timeout_s)
        except TimeoutError:
            raise APIError(504, f"the {who} did not answer in {timeout_s:g} s",
                           code="timeout") from None  # fmt: skip

    async def _query(self, query, reply_type):
        reply = await self.ask(query, reply_type, lambda r: r.query_id == query.query_id,
                               "tokenizer")  # fmt: skip
        if reply.error:
            raise APIError(400, reply.error)
        return reply

    async def ping(self) -> bool:
        """Round-trip a HealthPing through the scheduler's loop."""
        ping_id = new_id("ping-")
        try:
            await self.bus.request(
                HealthPing(ping_id, "scheduler"), reply=HealthPong,
                match=lambda p: p.ping_id == ping_id, timeout_s=self.config.health_timeout_s,
            )  # fmt: skip
        except TimeoutError:
            return False
        return True

    async def clear_store(self) -> StoreCleared:
        clear_id = new_id("clear-")
        return await self.ask(ClearStore(clear_id), StoreCleared,
                              lambda c: c.clear_id == clear_id, "cache manager")  # fmt: skip

    async def flush_cache(self) -> TreeDropped:
        flip_id = new_id("flush-")
        return await self.ask(DropTree(flip_id, include_locked=False), TreeDropped,
                              lambda t: t.flip_id == flip_id, "cache manager")  # fmt: skip
