"""The executor actor's async shell.

Entry point for `shunter serve`:

    async def run(config: ExecutorConfig, bus: Bus, *, core: ExecutorCore | None = None) -> None

Theory of operation: loads the model and sizes the KV pool in a worker thread (seconds,
under a progress bar; `core` skips that when the caller already built one), subscribes
to ForwardBatch, publishes `Ready(actor="executor", info=...)` (what the cache manager
and scheduler size themselves from: num_pages, page_size, max_context_len, vocab_size,
eos_token_ids as a comma-separated string), then runs every batch through
`ExecutorCore.handle` in a worker thread, so the event loop keeps moving messages
while the model computes, and publishes the StepResult stamped with the step's
wall time in `forward_us`. Batches are handled one at a time, in arrival order (the
core's mirror depends on that order). Runs until cancelled.

A malformed batch or a failed forward is a StepResult with `error` (the core's job);
a failure to load is actor-scoped: LoadError propagates to the supervisor.

Invariants: one batch is in the core at a time, in arrival order; the core never runs
on the event loop's thread; every ForwardBatch gets exactly one StepResult.
"""

from __future__ import annotations

import time

import anyio
import msgspec
import structlog
import torch

from shunter.actors.executor.config import ExecutorConfig
from shunter.actors.executor.core import ExecutorCore
from shunter.actors.executor.kv_pool import KVPool
from shunter.actors.executor.loader import load_model
from shunter.actors.executor.runner import ModelRunner
from shunter.bus.messages import ForwardBatch, Ready, StepResult
from shunter.bus.transport import Bus

log = structlog.get_logger(actor="executor")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(config: ExecutorConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def resolve_dtype(config: ExecutorConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[config.dtype]


def build_core(config: ExecutorConfig) -> ExecutorCore:
    """Load the model, size the KV pool, wrap both in a core (blocking; seconds)."""
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    device = resolve_device(config)
    dtype = resolve_dtype(config, device)
    t0 = time.perf_counter()
    model, mcfg = load_model(
        config.model_path,
        dtype=dtype,
        device=device,
        load_format=config.load_format,
        seed=config.seed,
        progress=config.load_progress,
        config_overrides=dict(config.model_overrides) or None,
        weight_format=config.weight_format,
    )
    max_context_len = min(config.context_length or mcfg.max_position_embeddings,
                          mcfg.max_position_embeddings)  # fmt: skip
    mem_bytes = None
    if config.max_total_tokens is None and device.type == "cuda" and config.mem_fraction_static:
        free, _ = torch.cuda.mem_get_info(device)
        mem_bytes = int(free * config.mem_fraction_static)
    pool = KVPool.from_budget(
        mcfg,
        dtype=dtype,
        device=device,
        page_size=config.page_size,
        max_total_tokens=config.max_total_tokens,
        mem_bytes=mem_bytes,
        host_mem_fraction=config.mem_fraction_static if device.type == "cpu" else None,
    )
    core = ExecutorCore(
        ModelRunner(model, pool),
        eos_token_ids=mcfg.eos_token_ids,
        max_context_len=max_context_len,
        max_num_rows=config.max_num_rows,
    )
    log.info("executor loaded", actor_id=config.actor_id, model=mcfg.name, dtype=str(dtype),
             device=str(device), num_pages=pool.num_pages, page_size=pool.page_size,
             load_s=round(time.perf_counter() - t0, 2))  # fmt: skip
    return core


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
        "max_num_rows": core.max_num_rows,
    }


async def run(config: ExecutorConfig, bus: Bus, *, core: ExecutorCore | None = None) -> None:
    if core is None:
        core = await anyio.to_thread.run_sync(build_core, config)
    async with bus.subscribe("sched.batch", types=(ForwardBatch,)) as sub:
        await bus.publish(Ready("executor", config.actor_id, ready_info(core)))
        log.info("executor ready", actor_id=config.actor_id)
        async for received in sub:
            batch = received.msg
            assert isinstance(batch, ForwardBatch)
            t0 = time.perf_counter_ns()
            outs = await anyio.to_thread.run_sync(core.handle, batch)
            forward_us = (time.perf_counter_ns() - t0) // 1000
            for out in outs:
                if isinstance(out, StepResult):
                    if out.error is not None:
                        log.warning("step failed", step_id=out.step_id, error=out.error)
                    out = msgspec.structs.replace(out, forward_us=forward_us)
                await bus.publish(out)
