"""Flips driven from the gateway: new weights from disk (`/update_weights_from_disk`),
a pause of generation (`/pause_generation` ... `/continue_generation`), and the
device memory given up and taken back (`/release_memory_occupation` ...
`/resume_memory_occupation`).

Theory of operation: a flip is a sequence of bus events, each answered by the actor that
owns the state it changes, and the gateway only sequences them:

    FlipBegin            -> scheduler: admission paused      (AdmissionPaused)
    ... running requests finish (or are retracted, or aborted by the caller) ...
                         <- scheduler: nothing runs          (FlipQuiesced)
    UpdateWeights        -> executor: checkpoint copied in   (WeightsUpdated)
    DropTree             -> cache manager: the prefix cache, computed with the old
                            weights, dropped, locked rows included (TreeDropped)
    FlipDone             -> scheduler: admission resumes under the new version

Every message carries the flip id, so `busctl tail -t flip.` shows the whole cutover.
Requests that arrive meanwhile wait in the scheduler's queue and run on the new
weights; a waiting request whose cached prefix was dropped matches again first. A
checkpoint the executor refuses (not found, another shape) leaves the old weights and
the cache as they were, and the flip still ends (FlipDone with ok false), so admission
never stays paused. One weights flip runs at a time. A pause is a flip of kind "pause"
that stays open (FlipBegin, FlipQuiesced) until continued (FlipDone); a weights flip
may run inside it, as a trainer syncing weights does. A memory release is a flip of
kind "release_memory" that stays open while anything is released:

    FlipBegin ... FlipQuiesced      as above, on the first release
    DropTree                     -> cache manager (when the KV cache goes)
    ReleaseMemory                -> executor: memory given up       (MemoryState)
    ... later, once or in parts ...
    ResumeMemory                 -> executor: memory taken back     (MemoryState)
    FlipDone                        once nothing is released

A weights flip may run inside it once the weights are back (an RL trainer resumes the
weights, syncs them, then resumes the KV cache).

Invariants: FlipDone is published once FlipBegin was, whatever happened between
(timeout, refusal, cancellation of the HTTP request). The drain may be cancelled (the
caller left, or its timeout passed); from UpdateWeights on the flip is shielded and
runs to its end, each stage bounded by the load timeout. An executor that has not
answered UpdateWeights by then may still copy the checkpoint in, so the flip drops the
prefix cache before it ends (a 504): nothing computed with the old weights is reused
once they change, and requests admitted after the flip queue behind the load, since
the executor takes its inbox in order. The version stays the old one; a load timeout
should exceed a checkpoint's load time.
"""

from __future__ import annotations

import math

import anyio
import msgspec

from shunter.bus.messages import (
    AdmissionPaused,
    DropTree,
    FlipBegin,
    FlipDone,
    FlipQuiesced,
    MemoryState,
    ReleaseMemory,
    ResumeMemory,
    TreeDropped,
    UpdateWeights,
    WeightsUpdated,
)
from shunter.bus.transport import Bus
from shunter.gateway.errors import APIError


class FlipOutcome(msgspec.Struct, frozen=True):
    ok: bool
    message: str
    num_paused_requests: int  # running when admission paused (drained or retracted)


class Flips:
    """The gateway's flip driver: the weights version it has cut over to, and a lock
    so that flips do not overlap."""

    def __init__(self, bus: Bus, *, load_timeout_s: float) -> None:
        self.bus = bus
        self.load_timeout_s = load_timeout_s
        self.version = 0
        self.weight_version = "default"  # what /get_model_info reports
        self.model_path: str | None = None  # the checkpoint now served, once updated
        self.paused: str | None = None  # the flip id of /pause_generation, until continued
        self._pausing: anyio.CancelScope | None = None  # a pause waiting for the drain
        self.released: set[str] = set()  # device memory given up (ReleaseMemory's tags)
        self.memory_flip: str | None = None  # the flip holding admission meanwhile
        self._lock = anyio.Lock()

    async def pause(self, flip_id: str, *, retract: bool, timeout_s: float | None) -> int:
        """Hold admission until `resume` (SGLang's /pause_generation): returns once
        nothing runs, the running requests having finished (retract False) or gone back
        to the queue (retract True); how many were running. APIError 400 when paused
        already; 504 (and not paused) when they do not stop in time; 409 when continued
        before they did."""
        self.claim_pause(flip_id)
        self._pausing = anyio.CancelScope()  # resume() may end the drain
        try:
            async with self.bus.subscribe(types=(AdmissionPaused, FlipQuiesced)) as sub:
                begin = FlipBegin(flip_id, "pause", {}, retract)
                num_running = await self._hold(sub, begin, timeout_s, self._pausing)
            if self.paused != flip_id:
                raise APIError(409, "generation was continued before it had paused")
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.resume()
            raise
        finally:
            self._pausing = None
        return num_running

    def claim_pause(self, flip_id: str) -> None:
        """Mark generation paused by `flip_id` (pause() then holds it); APIError 400 when
        another pause holds it. No await: a check and its claim cannot be split."""
        if self.paused not in (None, flip_id):
            raise APIError(400, f"generation is paused already ({self.paused})")
        self.paused = flip_id

    async def resume(self) -> bool:
        """End the pause (/continue_generation), a pause still waiting for its drain
        included; False when not paused."""
        flip_id, self.paused = self.paused, None
        if flip_id is None:
            return False
        if self._pausing is not None:
            self._pausing.cancel()
        await self.bus.publish(FlipDone(flip_id, self.version, True, "continued"))
        return True

    async def update_weights(
        self,
        flip_id: str,
        model_path: str,
        load_format: str = "auto",
        *,
        weight_version: str | None = None,
        retract: bool = False,
        drain_timeout_s: float | None = None,
    ) -> FlipOutcome:
        """Run one weights flip (see the module docstring). APIError 409 while another
        flip runs; 504 when a stage does not answer in time (the flip is ended)."""
        if self._lock.locked():
            raise APIError(409, "another flip is in progress; retry when it is done")
        if "weights" in self.released:
            raise APIError(400, "the weights are released; resume them first")
        async with self._lock:
            types = (AdmissionPaused, FlipQuiesced, WeightsUpdated, TreeDropped)
            async with self.bus.subscribe(types=types) as sub:
                params = {"model_path": model_path, "load_format": load_format}
                begin = FlipBegin(flip_id, "update_weights", params, retract)
                ok, message, num_paused = False, "", 0
                try:
                    num_paused = await self._hold(sub, begin, drain_timeout_s)
                    # Once the weights start to change, the flip runs to its end even if
                    # the caller goes away: the cache must not outlive the old weights.
                    with anyio.CancelScope(shield=True):
                        ok, message = await self._cutover(
                            sub, flip_id, model_path, load_format, weight_version
                        )
                finally:
                    with anyio.CancelScope(shield=True):
                        await self.bus.publish(FlipDone(flip_id, self.version, ok, message))
        return FlipOutcome(ok, message, num_paused)

    async def release_memory(self, flip_id: str, tags: list[str], *,
                             timeout_s: float | None = None) -> str:  # fmt: skip
        """Give up the executor's device memory of `tags` (SGLang's
        /release_memory_occupation; actors/executor/memory.py): the first release opens
        a flip that holds admission until everything is resumed, once the running
        requests finished (within timeout_s); releasing the KV cache drops the prefix
        cache first. What the executor did. APIError 400 for a tag released already,
        409 while another flip runs, 500 when the executor refuses."""
        taken = sorted(set(tags) & self.released)
        if taken:
            raise APIError(400, f"{taken} released already")
        if self._lock.locked():
            raise APIError(409, "another flip is in progress; retry when it is done")
        async with self._lock:
            types = (AdmissionPaused, FlipQuiesced, TreeDropped, MemoryState)
            async with self.bus.subscribe(types=types) as sub:
                if self.memory_flip is None:
                    begin = FlipBegin(flip_id, "release_memory", {"tags": ",".join(tags)})
                    self.memory_flip = flip_id
                    try:
                        await self._hold(sub, begin, timeout_s)
                    except BaseException:
                        with anyio.CancelScope(shield=True):
                            await self._end_memory_flip(False, "not released")
                        raise
                held = self.memory_flip
                with anyio.CancelScope(shield=True):  # from here on it runs to its end
                    if "kv_cache" in tags:
                        await self.bus.publish(DropTree(held, include_locked=True))
                        await self._next(sub, held, TreeDropped, self.load_timeout_s)
                    await self.bus.publish(ReleaseMemory(held, list(tags)))
                    try:
                        state = await self._next(sub, held, MemoryState, self.load_timeout_s)
                    except APIError:  # it may have been released: a resume can tell
                        self.released |= set(tags)
                        raise
                    self.released = set(state.released)
                    if not self.released:
                        await self._end_memory_flip(False, state.message)
        if not state.ok:
            raise APIError(500, state.message)
        return state.message

    async def resume_memory(self, tags: list[str]) -> str:
        """Take back the device memory of `tags` (/resume_memory_occupation); the flip
        ends, and admission resumes, once nothing is released. APIError 400 for a tag
        not released, 409 while another flip runs, 500 when the executor refuses."""
        missing = sorted(set(tags) - self.released)
        if missing:
            raise APIError(400, f"{missing} not released")
        if self._lock.locked():
            raise APIError(409, "another flip is in progress; retry when it is done")
        async with self._lock:
            held = self.memory_flip
            assert held is not None
            async with self.bus.subscribe(types=(MemoryState,)) as sub:
                with anyio.CancelScope(shield=True):
                    await self.bus.publish(ResumeMemory(held, list(tags)))
                    state = await self._next(sub, held, MemoryState, self.load_timeout_s)
                    self.released = set(state.released)
                    if not self.released:
                        await self._end_memory_flip(True, "resumed")
        if not state.ok:
            raise APIError(500, state.message)
        return state.message

    async def _end_memory_flip(self, ok: bool, message: str) -> None:
        flip_id, self.memory_flip = self.memory_flip, None
        if flip_id is not None:
            await self.bus.publish(FlipDone(flip_id, self.version, ok, message))

    async def _hold(
        self, sub, begin: FlipBegin, drain_timeout_s: float | None, drain_scope=None
    ) -> int:
        """Publish `begin` and wait until admission is paused and nothing runs (within
        `drain_scope`, which a caller may cancel); how many requests were running."""
        await self.bus.publish(begin)
        paused = await self._next(sub, begin.flip_id, AdmissionPaused, self.load_timeout_s)
        wait = math.inf if drain_timeout_s is None else drain_timeout_s
        with drain_scope or anyio.CancelScope():
            await self._next(sub, begin.flip_id, FlipQuiesced, wait, "drain")
        return paused.num_running

    async def _cutover(
        self, sub, flip_id: str, model_path: str, load_format: str, weight_version: str | None
    ) -> tuple[bool, str]:
        """New weights into the executor, then the prefix cache dropped: (ok, message)."""
        await self.bus.publish(UpdateWeights(flip_id, model_path, load_format))
        try:
            done = await self._next(sub, flip_id, WeightsUpdated, self.load_timeout_s)
        except APIError as e:
            if e.status != 504:
                raise
            # the load may still finish: drop what the old weights computed (module docstring)
            await self.bus.publish(DropTree(flip_id, include_locked=True, weights_changed=True))
            dropped = "dropped"
            try:
                await self._next(sub, flip_id, TreeDropped, self.load_timeout_s)
            except APIError:
                dropped = "asked to drop (no answer)"
            raise APIError(504, f"{e.message}; the executor may still load the checkpoint, so "
                                f"the prefix cache was {dropped}", code="timeout") from None  # fmt: skip
        if not done.ok:
            return False, done.message
        await self.bus.publish(DropTree(flip_id, include_locked=True, weights_changed=True))
        dropped = await self._next(sub, flip_id, TreeDropped, self.load_timeout_s)
        message = done.message
        if not dropped.ok:  # nothing copies KV here; say so if something did
            message += f" (prefix cache not dropped: {dropped.reason})"
        self.version += 1
        self.model_path = model_path
        self.weight_version = weight_version or f"v{self.version}"
        return True, message

    async def _next(self, sub, flip_id: str, kind: type, timeout_s: float, stage: str = ""):
        """The next `kind` message of this flip."""
        with anyio.move_on_after(timeout_s) as scope:
            async for received in sub:
                msg = received.msg
                if isinstance(msg, kind) and msg.flip_id == flip_id:  # type: ignore[attr-defined]
                    return msg
        if scope.cancelled_caught:
            what = stage or kind.__name__
            raise APIError(504, f"flip {flip_id}: no {what} in {timeout_s:g} s", code="timeout")
        raise APIError(503, "the bus closed during the flip")
