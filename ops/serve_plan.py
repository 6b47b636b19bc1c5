"""The plan of `shunter serve`: which actors start, in which stage (`actor_specs`), and
each one's config, built from the server arguments and the Readys of the stages before
it (`build_config`). ops/serve.py runs it under the supervisor.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from typing import Any

from shunter.actors.supervisor_core import ActorSpec, SupervisorConfig
from shunter.bus.messages import Ready
from shunter.ops.server_args import ServerArgs

EXECUTOR_ID = "executor.0"


def actor_specs(a: ServerArgs) -> list[ActorSpec]:
    return [
        ActorSpec(EXECUTOR_ID, "executor", 0),
        # without a tokenizer, it takes the vocabulary and eos ids from the executor
        ActorSpec("tokenizer", "tokenizer", 1 if a.skip_tokenizer_init else 0),
        ActorSpec("cache", "cache", 1),
        ActorSpec("scheduler", "scheduler", 1),
        ActorSpec("gateway", "gateway", 2),
    ]


def console_logs(a: ServerArgs) -> bool:
    """Whether logs are console lines (else JSON lines, which a progress bar sharing the
    stream would corrupt, so bars are only drawn for console logs)."""
    return a.log_format == "console" or (a.log_format == "auto" and sys.stderr.isatty())


def draw_seed(a: ServerArgs) -> int:
    """--random-seed, or one drawn now (the only randomness; it reaches actors as data)."""
    return a.random_seed if a.random_seed is not None else int.from_bytes(os.urandom(8)) >> 1


def storage_dir(a: ServerArgs) -> str:
    """The file store's root with --hicache-storage-backend file ("" without): the
    flag, else SGLang's SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, else /tmp/hicache."""
    if a.hicache_storage_backend != "file":
        return ""
    return (a.hicache_storage_dir
            or os.environ.get("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR") or "/tmp/hicache")  # fmt: skip


def _executor_facts(ready: Mapping[str, Ready]) -> dict[str, Any]:
    info = ready[EXECUTOR_ID].info
    eos = str(info.get("eos_token_ids", ""))
    return {
        "num_pages": int(info["num_pages"]),
        "page_size": int(info["page_size"]),
        "max_context_len": int(info["max_context_len"]),
        "vocab_size": int(info["vocab_size"]),
        "num_host_pages": int(info.get("num_host_pages", 0)),
        "store_block_tokens": int(info.get("store_block_tokens", 0)),
        "store_path": str(info.get("store_path", "")),
        "store_max_blocks": int(info.get("store_max_blocks", 0)),
        "eos_token_ids": tuple(int(t) for t in eos.split(",") if t.strip()),
    }


def public_server_info(a: ServerArgs) -> dict[str, Any]:
    """What /get_server_info may show: every argument except the secrets."""
    info = a.to_dict()
    for secret in ("api_key", "admin_api_key"):
        info[secret] = None if info[secret] is None else "<set>"
    return info


def build_config(spec: ActorSpec, a: ServerArgs, ready: Mapping[str, Ready], seed: int) -> Any:
    """The config object of one actor, from the server args and earlier Readys."""
    from shunter.actors.model_files import resolve_model

    match spec.kind:
        case "executor":
            from shunter.actors.executor.config import ExecutorConfig

            return ExecutorConfig(
                actor_id=spec.actor_id, model_path=a.model_path, dtype=a.dtype, device=a.device,
                tokenizer_path=a.tokenizer_path,
                load_format=a.load_format, weight_format=a.weight_format, page_size=a.page_size,
                max_total_tokens=a.max_total_tokens, mem_fraction_static=a.mem_fraction_static,
                context_length=a.context_length, seed=seed % 2**32,
                # the scheduler's rows are below max_running_requests (256 unless set)
                max_num_rows=a.max_running_requests or 256,
                attention_backend=a.attention_backend, cuda_graph_max_bs=a.cuda_graph_max_bs,
                decode_attention_backend=a.decode_attention_backend,
                disable_cuda_graph=a.disable_cuda_graph, load_progress=console_logs(a),
                skip_server_warmup=a.skip_server_warmup,
                cuda_graph_bs=tuple(a.cuda_graph_bs) if a.cuda_graph_bs else None,
                piecewise_cuda_graph=a.enable_piecewise_cuda_graph
                and not a.disable_piecewise_cuda_graph,
                piecewise_cuda_graph_max_tokens=a.piecewise_cuda_graph_max_tokens,
                piecewise_cuda_graph_tokens=tuple(a.piecewise_cuda_graph_tokens)
                if a.piecewise_cuda_graph_tokens else None,
                model_overrides=json.loads(a.json_model_override_args or "{}"),
                enable_hierarchical_cache=a.enable_hierarchical_cache,
                hicache_ratio=a.hicache_ratio, hicache_size=float(a.hicache_size),
                hicache_storage_dir=storage_dir(a),
                hicache_storage_max_size=a.hicache_storage_max_size or 0.0,
            )  # fmt: skip
        case "tokenizer":
            from shunter.actors.tokenizer.config import TokenizerConfig

            facts: dict[str, Any] = {"context_len": a.context_length}
            if a.skip_tokenizer_init:  # what a tokenizer would tell, from the executor
                ex = _executor_facts(ready)
                facts = {"skip_tokenizer_init": True, "vocab_size": ex["vocab_size"],
                         "eos_token_ids": ex["eos_token_ids"],
                         "context_len": ex["max_context_len"]}  # fmt: skip
            return TokenizerConfig(
                actor_id=spec.actor_id, model_path=a.model_path, tokenizer_path=a.tokenizer_path,
                chat_template=a.chat_template, stream_interval=a.stream_interval,
                non_stream_interval=max(a.stream_interval, 32),
                allow_auto_truncate=a.allow_auto_truncate, **facts,
            )  # fmt: skip
        case "cache":
            from shunter.actors.cache_manager.config import CacheConfig

            facts = _executor_facts(ready)
            return CacheConfig(
                actor_id=spec.actor_id, num_pages=facts["num_pages"],
                page_size=facts["page_size"], disable_radix_cache=a.disable_radix_cache,
                eviction_policy=a.radix_eviction_policy,
                num_host_pages=facts["num_host_pages"], write_policy=a.hicache_write_policy,
                store_block_tokens=facts["store_block_tokens"], store_path=facts["store_path"],
                store_max_blocks=facts["store_max_blocks"],
                store_prefetch_policy=a.hicache_storage_prefetch_policy,
            )  # fmt: skip
        case "scheduler":
            from shunter.actors.scheduler.config import from_server_args

            facts = _executor_facts(ready)
            return from_server_args(
                a, num_total_pages=facts["num_pages"], max_context_len=facts["max_context_len"],
                eos_token_ids=facts["eos_token_ids"], seed=seed,
            )  # fmt: skip
        case "gateway":
            from shunter.gateway.config import GatewayConfig

            facts = _executor_facts(ready)
            source = resolve_model(a.model_path)
            info = public_server_info(a) | {
                "num_kv_pages": facts["num_pages"], "max_context_len": facts["max_context_len"],
                "max_total_num_tokens": facts["num_pages"] * facts["page_size"],
                # what the executor resolved: device, dtype, attention backend, graphs
                "executor": dict(ready[EXECUTOR_ID].info),
            }  # fmt: skip
            return GatewayConfig(
                actor_id=spec.actor_id, host=a.host, port=a.port, api_key=a.api_key,
                admin_api_key=a.admin_api_key, enable_metrics=a.enable_metrics,
                log_requests=a.log_requests, log_level_http=a.log_level_http,
                incremental_streaming_output=a.incremental_streaming_output,
                served_model_name=a.served_model_name or source.name, model_path=source.path,
                tool_call_parser=a.tool_call_parser,
                tokenizer_path=a.tokenizer_path or source.path,
                max_context_len=facts["max_context_len"], server_info=info,
            )  # fmt: skip
    raise ValueError(f"no config for actor kind {spec.kind!r}")


def supervisor_config(a: ServerArgs) -> SupervisorConfig:
    return SupervisorConfig(
        actor_specs(a), watchdog_timeout_s=a.watchdog_timeout, start_timeout_s=a.start_timeout,
        shutdown_timeout_s=a.shutdown_timeout, tick_interval_s=min(0.25, a.heartbeat_interval),
    )  # fmt: skip
