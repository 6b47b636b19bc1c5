"""Building an executor core from its config: device, dtype, model, KV pool, runner.

Theory of operation: `build_core` loads the model (loader.py), sizes the KV pool and
wraps both in a ModelRunner and an ExecutorCore. On CUDA the pool is sized as SGLang
sizes it: `mem_fraction_static` (default DEFAULT_CUDA_MEM_FRACTION) of the device's
total memory is the budget of everything static (weights, KV pool, slot table, graph
buffers), so the pool gets what is free after loading minus the (1 - fraction) share
kept for activations, minus the slot table and an estimate of what the decode and
piecewise graphs hold. The runner then captures its decode graphs and its piecewise
graphs of prefill/extend steps (progress bars) unless `disable_cuda_graph` (the
piecewise ones only with `piecewise_cuda_graph`), and the core runs the warm-up steps (warmup.py) unless
`skip_server_warmup`, so that the attention kernels flashinfer compiles on first use
are built before the executor is ready rather than inside a request's step. On a CPU
the pool is sized from host memory (kv_pool.py) and nothing needs warming. With
`enable_hierarchical_cache` a host pool (host_pool.py) is sized from the device pool
(hicache_ratio) or from hicache_size and allocated right after it; with
`hicache_storage_dir` too, a file store (file_store.py) below it, in a directory of
its own per model, weights and KV layout (`store_fingerprint`), so that a later run of
the same model finds the blocks an earlier one wrote and no other model ever does.

Invariants: blocking (seconds); the pool is never sized below one page (ValueError
from KVPool.from_budget says by how much the budget fell short).
"""

from __future__ import annotations

import functools
import os
import pathlib
import time

import structlog
import torch

from shunter.actors.executor.config import (
    DEFAULT_CUDA_GRAPH_MAX_BS,
    DEFAULT_PIECEWISE_MAX_TOKENS,
    ExecutorConfig,
)
from shunter.actors.executor.core import ExecutorCore
from shunter.actors.executor.cuda_graph import capture_sizes
from shunter.actors.executor.file_store import FileStore
from shunter.actors.executor.host_pool import HostKVPool, host_pool_pages
from shunter.actors.executor.kv_pool import KVPool
from shunter.actors.executor.loader import load_model
from shunter.actors.executor.models.config import ModelConfig
from shunter.actors.executor.runner import ModelRunner
from shunter.actors.executor.warmup import warm_up
from shunter.actors.grammar.token_fsm import GrammarCache, load_token_vocab
from shunter.actors.model_files import resolve_model
from shunter.kernels import jit_builds

log = structlog.get_logger(actor="executor")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CUDA_MEM_FRACTION = 0.88
# Activation workspace a captured decode graph keeps per batch row beyond its logits
# (hidden states, qkv, MLP intermediates, attention partials), as a multiple of the
# model's widest row in bytes; generous on purpose: the estimate only shrinks the pool.
_GRAPH_ROW_FACTOR = 8


def resolve_device(config: ExecutorConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def resolve_dtype(config: ExecutorConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[config.dtype]


def graph_max_bs(config: ExecutorConfig, device: torch.device) -> int | None:
    """Largest captured decode batch, or None when no graph is captured."""
    if device.type != "cuda" or config.disable_cuda_graph:
        return None
    largest = config.cuda_graph_max_bs
    if config.cuda_graph_bs is not None:
        largest = min(largest or max(config.cuda_graph_bs), max(config.cuda_graph_bs))
    return min(largest or DEFAULT_CUDA_GRAPH_MAX_BS, config.max_num_rows)


def graph_bytes(mcfg: ModelConfig, max_bs: int | None, elem: int) -> int:
    """What the decode graphs are expected to hold: every bucket's float32 logits plus
    its activations."""
    if max_bs is None:
        return 0
    row = mcfg.vocab_size * 4 + _GRAPH_ROW_FACTOR * elem * max(
        mcfg.hidden_size, mcfg.intermediate_size * 2, mcfg.q_size + 2 * mcfg.kv_size
    )
    return sum(capture_sizes(max_bs)) * row + (256 << 20)


def piecewise_max_tokens(config: ExecutorConfig, device: torch.device) -> int | None:
    """Largest step replayed from piecewise graphs, or None when none is captured."""
    if device.type != "cuda" or config.disable_cuda_graph or not config.piecewise_cuda_graph:
        return None
    largest = config.piecewise_cuda_graph_max_tokens or DEFAULT_PIECEWISE_MAX_TOKENS
    if config.piecewise_cuda_graph_tokens is not None:
        largest = min(largest, max(config.piecewise_cuda_graph_tokens))
    return largest


def piecewise_bytes(mcfg: ModelConfig, max_tokens: int | None, elem: int) -> int:
    """What the piecewise graphs are expected to hold: the buffers the pieces share and
    the largest piece's activations (the MLP's, twice its width), for the largest step."""
    if max_tokens is None:
        return 0
    qkv = mcfg.q_size + 2 * mcfg.kv_size
    shared = qkv + mcfg.q_size + 2 * mcfg.hidden_size
    piece = 2 * (2 * mcfg.intermediate_size) + qkv + 2 * mcfg.hidden_size
    return max_tokens * elem * (shared + piece) + (64 << 20)


def cuda_kv_budget(
    config: ExecutorConfig, device: torch.device, reserved: int
) -> tuple[int, dict[str, int]]:
    """Bytes for the KV pool on CUDA after loading, and the figures it came from."""
    free, total = torch.cuda.mem_get_info(device)
    frac = config.mem_fraction_static or DEFAULT_CUDA_MEM_FRACTION
    keep = int(total * (1.0 - frac))
    budget = free - keep - reserved
    if budget <= 0:
        raise ValueError(
            f"no memory left for the KV pool: {free / 2**30:.1f} GiB free after loading, "
            f"{keep / 2**30:.1f} GiB kept by mem_fraction_static={frac}, "
            f"{reserved / 2**30:.1f} GiB for the slot table and decode graphs; raise "
            "--mem-fraction-static or lower --cuda-graph-max-bs / --context-length"
        )
    return budget, {"free": free, "total": total, "keep": keep, "reserved": reserved}


STORE_BLOCK_TOKENS = 64  # tokens per file store block, rounded up to whole pages


def store_fingerprint(config: ExecutorConfig, mcfg: ModelConfig, pool: KVPool,
                      block_pages: int) -> str:  # fmt: skip
    """What a file store block's contents depend on besides its tokens: the weights
    (the checkpoint's files by name, size and modification time, or a dummy's seed),
    the model's shape and dtype, and the KV layout."""
    path = pathlib.Path(resolve_model(config.model_path).path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    weights = [(str(p.relative_to(path) if path.is_dir() else p.name), st.st_size,
                st.st_mtime_ns) for p in files if (st := os.stat(p))]  # fmt: skip
    if config.load_format == "dummy":
        weights = [("dummy", config.seed)]
    kv = pool.config
    return repr((
        str(path.resolve()), config.load_format, config.weight_format, weights,
        sorted(config.model_overrides.items()), str(pool.dtype), mcfg.num_layers,
        kv.num_kv_heads, kv.head_dim, pool.page_size, block_pages,
    ))  # fmt: skip


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
    on_cuda = device.type == "cuda"
    max_bs = graph_max_bs(config, device)
    pw_tokens = piecewise_max_tokens(config, device)
    mem_bytes = None
    if on_cuda and config.max_total_tokens is None:
        elem = torch.empty((), dtype=dtype).element_size()
        table = (config.max_num_rows + 1) * max_context_len * 4
        graphs = graph_bytes(mcfg, max_bs, elem) + piecewise_bytes(mcfg, pw_tokens, elem)
        mem_bytes, facts = cuda_kv_budget(config, device, table + graphs)
        log.info("kv budget", **{k: round(v / 2**30, 2) for k, v in facts.items()},
                 kv_gib=round(mem_bytes / 2**30, 2))  # fmt: skip
    pool = KVPool.from_budget(
        mcfg,
        dtype=dtype,
        device=device,
        page_size=config.page_size,
        max_total_tokens=config.max_total_tokens,
        mem_bytes=mem_bytes,
        host_mem_fraction=config.mem_fraction_static if not on_cuda else None,
        pad_page=on_cuda,
    )
    host_pool = None
    if config.enable_hierarchical_cache:
        num_host = host_pool_pages(pool, config.hicache_ratio, config.hicache_size)
        host_pool = HostKVPool(num_host, like=pool)
    file_store = None
    if host_pool is not None and config.hicache_storage_dir:
        block_pages = -(-STORE_BLOCK_TOKENS // pool.page_size)
        file_store = FileStore(config.hicache_storage_dir, host_pool, block_pages,
                               store_fingerprint(config, mcfg, pool, block_pages),
                               max_bytes=int(config.hicache_storage_max_size * 1e9))  # fmt: skip
    t1 = time.perf_counter()
    if on_cuda:
        jit_builds.install()  # every Triton build from here on is recorded (and logged)
    runner = ModelRunner(
        model,
        pool,
        attention_backend=config.attention_backend,
        decode_attention_backend=config.decode_attention_backend,
        max_num_rows=config.max_num_rows if on_cuda else None,
        max_context_len=max_context_len,
        cuda_graph_max_bs=max_bs,
        progress=config.load_progress,
        cuda_graph_sizes=config.cuda_graph_bs,
        piecewise_max_tokens=pw_tokens,
        piecewise_sizes=config.piecewise_cuda_graph_tokens,
    )
    core = ExecutorCore(
        runner,
        eos_token_ids=mcfg.eos_token_ids,
        max_context_len=max_context_len,
        max_num_rows=config.max_num_rows,
        grammars=GrammarCache(
            functools.partial(load_token_vocab, config.model_path, config.tokenizer_path)
        ),
        host_pool=host_pool,
        file_store=file_store,
    )
    t2 = time.perf_counter()
    if on_cuda and not config.skip_server_warmup:  # first-use builds now, not in a request
        log.info("warming up the attention paths", backend=runner.backend)
        warm_up(core)
    built = jit_builds.drain()  # capture's and warm-up's (the hooks are set above)
    log.info("executor loaded", actor_id=config.actor_id, model=mcfg.name, dtype=str(dtype),
             device=str(device), backend=runner.backend, num_pages=pool.num_pages,
             page_size=pool.page_size, num_host_pages=host_pool.num_pages if host_pool else 0,
             host_pinned=host_pool.pinned if host_pool else False, cuda_graph_max_bs=max_bs,
             piecewise_max_tokens=pw_tokens, kernels_built=len(built),
             kernel_build_s=round(sum(ms for _, ms in built) / 1e3, 2),
             load_s=round(t1 - t0, 2), capture_s=round(t2 - t1, 2), warmup_s=round(time.perf_counter() - t2, 2))  # fmt: skip
    return core
