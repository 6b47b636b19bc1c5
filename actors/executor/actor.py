"""The executor actor's async shell.

Entry point for `shunter serve`:

    async def run(config: ExecutorConfig, bus: Bus, *, core: ExecutorCore | None = None) -> None

Theory of operation: loads the model and sizes the KV pool in a worker thread (seconds,
under a progress bar; `core` skips that when the caller already built one), subscribes
to INBOX (batches, the flips' messages, weight queries, profile controls), publishes
`Ready(actor="executor", info=...)` (what the cache manager and scheduler size
themselves from: num_pages, page_size, max_context_len, vocab_size,
eos_token_ids as a comma-separated string), then feeds every batch to
`ExecutorCore.submit` in a worker thread, so the event loop keeps moving messages while
the model computes. submit launches the batch and answers the one submitted before it,
so while batches keep coming (the overlap scheduler sends step N+1 before it reads step
N's result) each forward is launched before the previous step's tokens are read, unless
that step is already done on the device (then its result goes out first). When
no further batch is waiting after a submit, the shell waits for whichever comes
first: the next batch (submitted at once: the overlap goes on) or the device
finishing the step in flight (`wait_step_ready`); then it calls `flush` and
publishes that step's result, rather than holding it for a batch that may only come
once the scheduler has it. On the CPU a step is done when submit returns, so there
it flushes at once. Each StepResult is stamped with `forward_us`, the wall
time from its batch's submit to its result; a step slower than SLOW_STEP_S is logged
("slow step") with its tokens, rows and how the runner ran it (a decode graph,
piecewise graphs or eagerly), so a stall shows which steps it was, and so is every
Triton kernel a step had to build first ("kernel built in a step", kernels/jit_builds.py:
a shape class the warm-up did not reach). Runs until cancelled.

A flip's UpdateWeights comes when nothing runs: the step in flight, if any, is flushed,
the new checkpoint is copied into the live weights in a worker thread (reload.py), and
WeightsUpdated says whether it was (a refused one leaves the old weights serving).
ReleaseMemory and ResumeMemory come the same way and give up or take back the device
memory of the weights, the KV cache and the decode graphs (memory.py); MemoryState
says what is released now. WeightsQuery (/get_weights_by_name) is answered between
batches with the first rows of a weight, named as in HF checkpoints. SpillPages and
LoadPages (the cache manager's host KV tier) are started between batches in a worker
thread (`ExecutorCore.copies`, copies.py) without flushing the step in flight: on
CUDA they run on copy streams behind the forwards queued so far, on the CPU a forward
is done when submit returns. StorePages, FetchPages and EraseBlocks (the file store
below the host tier) run on the file store's own thread. A copy is answered
(PagesSpilled, PagesLoaded, PagesStored, PagesFetched, BlocksErased) once it has
finished: a CPU spill or load before the next message is taken, the rest when its
event or future completes, which the loop waits for beside the next message and the
step in flight. ProfileStart and ProfileStop (the gateway's /start_profile,
/stop_profile) start and end a torch.profiler session between batches (profiling.py);
a session asked for a number of steps ends by itself once that many results are
published.

A malformed batch or a failed forward is a StepResult with `error` (the core's job);
a failure to load is actor-scoped: LoadError propagates to the supervisor.

Invariants: batches and copies enter the core one at a time, in arrival order (the
core's mirror depends on that order); the core never runs on the event loop's thread;
every ForwardBatch gets exactly one StepResult, published in arrival order, and every
page copy exactly one reply.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass

import anyio
import msgspec
import structlog
import torch

from shunter.actors.executor.build import build_core
from shunter.actors.executor.config import ExecutorConfig
from shunter.actors.executor.copies import Copy, CopyReply
from shunter.actors.executor.core import ExecutorCore
from shunter.actors.executor.loader import LoadError
from shunter.actors.executor.memory import DeviceMemory
from shunter.actors.executor.profiling import Profiler
from shunter.actors.executor.reload import reload_weights
from shunter.bus.messages import (
    EraseBlocks,
    FetchPages,
    ForwardBatch,
    LoadPages,
    MemoryState,
    ProfileStart,
    ProfileStop,
    Ready,
    ReleaseMemory,
    ResumeMemory,
    SpillPages,
    StepResult,
    StorePages,
    UpdateWeights,
    WeightsQuery,
    WeightsSlice,
    WeightsUpdated,
)
from shunter.bus.subscription import Subscription
from shunter.bus.transport import Bus
from shunter.kernels import jit_builds

log = structlog.get_logger(actor="executor")

SLOW_STEP_S = 1.0  # a step whose result comes later than this after its submit is logged

INBOX = (ForwardBatch, UpdateWeights, ReleaseMemory, ResumeMemory, ProfileStart, ProfileStop,
         WeightsQuery, SpillPages, LoadPages, StorePages, FetchPages, EraseBlocks)  # fmt: skip
Inbound = (ForwardBatch | UpdateWeights | ReleaseMemory | ResumeMemory | ProfileStart
           | ProfileStop | WeightsQuery | Copy)  # fmt: skip
MAX_WEIGHT_VALUES = 1 << 22  # the most values one WeightsSlice carries
FLIPS = (UpdateWeights, ReleaseMemory, ResumeMemory)  # come when nothing runs


def ready_info(core: ExecutorCore) -> dict[str, int | float | str]:
    runner = core.runner
    return {
        "num_pages": core.num_pages,
        "page_size": core.page_size,
        "max_context_len": core.max_context_len,
        "vocab_size": core.vocab_size,
        "eos_token_ids": ",".join(str(t) for t in core.eos_token_ids),
        "num_layers": runner.config.num_layers,
        "dtype": str(runner.dtype).removeprefix("torch."),
        "device": str(runner.device),
        "attention_backend": runner.backend,
        "decode_attention_backend": runner.decode_attention_backend,
        "cuda_graph_max_bs": runner.graphs.max_bs if runner.graphs is not None else 0,
        "max_num_rows": core.max_num_rows,
        "num_host_pages": core.host_pool.num_pages if core.host_pool is not None else 0,
        "store_block_tokens": core.file_store.block_tokens if core.file_store else 0,
        "store_path": str(core.file_store.path) if core.file_store else "",
        "store_max_blocks": core.file_store.max_blocks if core.file_store else 0,
    }


async def run(config: ExecutorConfig, bus: Bus, *, core: ExecutorCore | None = None) -> None:
    if core is None:
        core = await anyio.to_thread.run_sync(build_core, config)
    async with bus.subscribe(types=INBOX) as sub:
        await bus.publish(Ready("executor", config.actor_id, ready_info(core)))
        log.info("executor ready", actor_id=config.actor_id)
        await _serve(core, config, sub, bus)


async def _serve(core: ExecutorCore, config: ExecutorConfig, sub: Subscription, bus: Bus) -> None:
    """submit every batch; flush whenever no next batch is already waiting, and before
    a submit when the step in flight is already done (always on a CPU, where a forward
    runs inside submit: holding its result through the next forward would only delay
    it by a step). A flip's message (FLIPS) comes between batches: what is in flight,
    the step and the page copies, is finished first. Weight queries and profile controls
    are answered as they come; a page copy once it has finished on the device, whatever
    the loop is waiting for then."""
    submitted: deque[_Step] = deque()  # each unanswered step, in submit order
    prof = Profiler(config.actor_id, core.runner.device)
    memory = DeviceMemory(core)
    out = _Out(bus, submitted, prof)
    # the threads that wait for page copies, which a message arriving first leaves
    # running: bounded apart from the threads that run the core
    copy_waits = anyio.CapacityLimiter(4)
    batch = await _receive(sub)
    while batch is not None:
        if isinstance(batch, FLIPS):
            if submitted:
                await out.publish(await anyio.to_thread.run_sync(core.flush))
            await _publish_copies(bus, await anyio.to_thread.run_sync(core.copies.done, True))
            await bus.publish(await anyio.to_thread.run_sync(_flip, core, config, memory, batch))
        elif isinstance(batch, ProfileStart | ProfileStop):
            await bus.publish(await anyio.to_thread.run_sync(prof.handle, batch))
        elif isinstance(batch, WeightsQuery):
            await bus.publish(await anyio.to_thread.run_sync(_weights, core, memory, batch))
        elif isinstance(batch, Copy):
            reply = await anyio.to_thread.run_sync(core.copies.copy, batch)
            await _publish_copies(bus, [] if reply is None else [reply])
        else:
            if submitted and core.step_ready():
                await out.publish(await anyio.to_thread.run_sync(core.flush))
            step = _Step(time.perf_counter_ns(), len(batch.input_ids), len(batch.rows))
            submitted.append(step)
            core.runner.last_path = ""
            results = await anyio.to_thread.run_sync(core.submit, batch)
            step.path = core.runner.last_path or "not run"  # a batch refused before its forward
            for kernel, ms in jit_builds.drain():  # the engine waited on each
                log.warning("kernel built in a step", step_id=batch.step_id, kernel=kernel,
                            ms=round(ms, 1), path=step.path)  # fmt: skip
            await out.publish(results)
        batch = _WOKE
        while batch is _WOKE:  # until a message comes (or the subscription closes)
            await _publish_copies(bus, core.copies.done())
            if not submitted:
                batch = await _receive_unless_done(core, sub, copy_waits, step=False)
                continue
            batch = _receive_nowait(sub) or await _receive_unless_done(core, sub, copy_waits,
                                                                       step=True)  # fmt: skip
            if batch is _WOKE and core.step_ready():
                await out.publish(await anyio.to_thread.run_sync(core.flush))


async def _publish_copies(bus: Bus, replies: list[CopyReply]) -> None:
    for reply in replies:
        if not reply.ok:
            log.warning("page copy failed", copy_id=reply.copy_id, error=reply.error)
        await bus.publish(reply)


def _flip(core: ExecutorCore, config: ExecutorConfig, memory: DeviceMemory,
          msg: UpdateWeights | ReleaseMemory | ResumeMemory) -> WeightsUpdated | MemoryState:  # fmt: skip
    if isinstance(msg, UpdateWeights):
        if "weights" in memory.released:
            return WeightsUpdated(msg.flip_id, False, "the weights are released; resume them first")
        return _update(core, config, msg)
    try:
        if isinstance(msg, ReleaseMemory):
            what = memory.release(msg.tags)
        else:
            what = memory.resume(msg.tags)
    except ValueError as e:
        return MemoryState(msg.flip_id, False, sorted(memory.released), str(e))
    log.info("device memory", flip_id=msg.flip_id, what=what, released=sorted(memory.released))
    return MemoryState(msg.flip_id, True, sorted(memory.released), what)


def _weights(core: ExecutorCore, memory: DeviceMemory, q: WeightsQuery) -> WeightsSlice:
    """The first rows of a weight, by its HF checkpoint name (/get_weights_by_name)."""
    if "weights" in memory.released:
        return WeightsSlice(q.query_id, error="the weights are released; resume them first")
    try:
        t = core.runner.model.weight_by_hf_name(q.name)
    except KeyError:
        return WeightsSlice(q.query_id, error=f"no weight named {q.name!r} (HF checkpoint names)")
    rows = t[: max(q.truncate_size, 0)] if t.dim() else t
    if rows.numel() > MAX_WEIGHT_VALUES:
        return WeightsSlice(q.query_id, error=f"{rows.numel()} values asked for; at most "
                            f"{MAX_WEIGHT_VALUES} (lower truncate_size)")  # fmt: skip
    values = rows.detach().to("cpu", torch.float32).reshape(-1).tolist()
    return WeightsSlice(q.query_id, values, list(rows.shape))


def _update(core: ExecutorCore, config: ExecutorConfig, msg: UpdateWeights) -> WeightsUpdated:
    try:
        what = reload_weights(core, config, msg.model_path, msg.load_format)
    except LoadError as e:
        log.warning("weights not updated", flip_id=msg.flip_id, error=str(e))
        return WeightsUpdated(msg.flip_id, False, str(e))
    log.info("weights updated", flip_id=msg.flip_id, model_path=msg.model_path, loaded=what)
    return WeightsUpdated(msg.flip_id, True, what)


_WOKE = object()  # what _receive_unless_done returns when the device finished something


async def _receive_unless_done(core: ExecutorCore, sub: Subscription,
                               copy_waits: anyio.CapacityLimiter, *, step: bool):  # fmt: skip
    """The next message (None once the subscription is closed), unless first the step
    in flight (with `step`) or a page copy finishes on the device: then _WOKE.
    Receiving is cancellation-safe (a message being handed over when the race ends
    stays queued). The copies' waits take `copy_waits`' threads: one left running
    ends no later than the copy a new one would wait for (each direction's copies end
    in order), so a wait held up by the limit is late by no more than that."""
    waits = [(core.wait_step_ready, None)] if step else []
    if step and core.step_ready():
        return _WOKE
    waits += [(w, copy_waits) for w in core.copies.waiters()]
    if not waits:
        return await _receive(sub)
    got: list[Inbound | None] = []
    async with anyio.create_task_group() as tg:

        async def done(wait, limiter) -> None:
            # A device error is the step's or the copy's: flush or copies.done reports it.
            with contextlib.suppress(Exception):
                await anyio.to_thread.run_sync(wait, abandon_on_cancel=True, limiter=limiter)
            tg.cancel_scope.cancel()

        async def arrives() -> None:
            got.append(await _receive(sub))
            tg.cancel_scope.cancel()

        for wait, limiter in waits:
            tg.start_soon(done, wait, limiter)
        tg.start_soon(arrives)
    return got[0] if got else _WOKE


async def _receive(sub: Subscription) -> Inbound | None:
    """The next message, waiting for it; None once the subscription is closed."""
    try:
        msg = (await sub.receive()).msg
    except (anyio.ClosedResourceError, anyio.EndOfStream):
        return None
    assert isinstance(msg, INBOX)
    return msg


def _receive_nowait(sub: Subscription) -> Inbound | None:
    """The next message if one is already queued, else None."""
    try:
        msg = sub.receive_nowait().msg
    except (anyio.WouldBlock, anyio.ClosedResourceError, anyio.EndOfStream):
        return None
    assert isinstance(msg, INBOX)
    return msg


@dataclass
class _Step:
    """A submitted step: when, its new tokens and rows, how the runner ran it."""

    t_ns: int  # perf_counter_ns at its submit
    tokens: int
    rows: int
    path: str = ""


class _Out:
    """Publishes step results, each stamped with its forward time (a slow one logged),
    and ends a profile whose steps are all recorded."""

    def __init__(self, bus: Bus, submitted: deque[_Step], prof: Profiler) -> None:
        self.bus, self.submitted, self.prof = bus, submitted, prof

    async def publish(self, results: list[StepResult]) -> None:
        now = time.perf_counter_ns()
        for out in results:
            step = self.submitted.popleft()
            forward_us = (now - step.t_ns) // 1000
            if forward_us >= SLOW_STEP_S * 1e6:
                log.warning("slow step", step_id=out.step_id, ms=forward_us // 1000,
                            tokens=step.tokens, rows=step.rows, path=step.path)  # fmt: skip
            if out.error is not None:
                log.warning("step failed", step_id=out.step_id, error=out.error)
            await self.bus.publish(msgspec.structs.replace(out, forward_us=forward_us))
            if self.prof.step_done():
                await self.bus.publish(await anyio.to_thread.run_sync(self.prof.stop))
