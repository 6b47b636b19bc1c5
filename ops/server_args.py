"""Server arguments: every `shunter serve` option, its aliases and help, and validation
(ops/server_cli.py turns a command line and a config file into them).

Theory of operation
    One table (`OPTIONS`, in ops/server_flags.py with the compatibility-only and
    refused SGLang options) declares each option once: its field in `ServerArgs`, every
    command-line spelling (SGLang's names first, then their aliases, all declared
    explicitly: ops/server_cli.py builds the parser with allow_abbrev=False, so no prefix
    guessing), its --help group, and its help text. argparse records only the options
    the user typed (every default is SUPPRESS); the values then merge as

        ServerArgs defaults  <  --config file  <  command line

    and `ServerArgs.__post_init__` validates the result with ValueError messages that
    name the flag as the user spells it.

Invariants
    - A `ServerArgs` that exists is valid: ranges hold, choices are known, and sizes the
      engine cannot honour (tp/dp/pp above 1) were refused, not ignored.
    - Checks that touch the file system (model path, tokenizer path, config file,
      chat template file) live in `check_paths()`, so constructing ServerArgs in a test
      or from a recorded log needs no files.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import msgspec

from shunter.ops.server_flags import COMPAT_ONLY, GROUPS, OPTIONS, REFUSED

__all__ = ["COMPAT_ONLY", "GROUPS", "OPTIONS", "REFUSED", "ServerArgs", "check_paths"]

SCHEDULE_POLICIES = ("fcfs", "lpm", "priority", "lof", "random")
TOOL_CALL_PARSERS = ("qwen25", "hermes", "llama3", "mistral", "pythonic")  # tool_calls.py's
DTYPES = ("auto", "float32", "bfloat16", "float16")
# other spellings of a dtype that SGLang and vLLM take, as ServerArgs stores them
DTYPE_ALIASES = {"half": "float16", "fp16": "float16", "float": "float32", "fp32": "float32",
                 "bf16": "bfloat16"}  # fmt: skip
KV_CACHE_DTYPES = ("auto",)
TOKENIZER_MODES = ("auto",)
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DEVICES = ("auto", "cpu", "cuda")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMATS = ("auto", "console", "json")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flashinfer")
DECODE_ATTENTION_BACKENDS = ("auto", "triton", "flashinfer")
WEIGHT_FORMATS = ("none", "bf16", "int8", "int4")
RETRACTION_POLICIES = ("length", "priority")
RADIX_EVICTION_POLICIES = ("lru", "lfu")
HICACHE_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES = ("wait_complete", "best_effort", "timeout")


class ServerArgs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything `shunter serve` can be told. Field names are SGLang's."""

    # model
    model_path: str | None = None
    """A local HF directory or .gguf file; None (or "smollm2") is the default model."""
    tokenizer_path: str | None = None
    """Defaults to the model path."""
    load_format: str = "auto"
    weight_format: str = "none"
    """Projection weights packed as bf16/int8/int4 for faster CPU decode; none: as loaded."""
    dtype: str = "auto"
    """auto: bfloat16 on CUDA, float32 on the CPU."""
    device: str = "auto"
    context_length: int | None = None
    """None: the model's own maximum."""
    served_model_name: str | None = None
    chat_template: str | None = None
    tool_call_parser: str | None = None
    """A file path, or the template text itself."""
    random_seed: int | None = None
    """Seed of the per-request seeds drawn at the gateway; None draws one at start."""
    trust_remote_code: bool = False  # accepted for compatibility: COMPAT_ONLY
    revision: str | None = None  # accepted for compatibility: COMPAT_ONLY
    tokenizer_mode: str = "auto"
    skip_tokenizer_init: bool = False
    json_model_override_args: str | None = None
    """A JSON object of config.json keys (or model config fields) to override."""
    allow_auto_truncate: bool = False
    """Cut prompts as long as the context (keeping their start) instead of a 400."""

    # server
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    admin_api_key: str | None = None
    enable_metrics: bool = False
    incremental_streaming_output: bool = False
    kv_events_config: str | None = None
    """SGLang's JSON: publish the prefix cache's KV events on ZMQ for routers."""

    # scheduling
    schedule_policy: str = "fcfs"
    max_running_requests: int | None = None
    max_queued_requests: int | None = None
    """Most requests waiting for admission; more fail with 503 at once. None: no bound."""
    max_prefill_tokens: int = 16384
    chunked_prefill_size: int | None = None
    """None: chosen by the engine; -1 turns chunking off."""
    disable_radix_cache: bool = False
    disable_overlap_schedule: bool = False
    stream_interval: int = 1
    schedule_conservativeness: float = 1.0
    """Scales the new-token reservation of admission (SGLang's init/min new token ratios)."""
    enable_mixed_chunk: bool = False  # accepted for compatibility: COMPAT_ONLY
    prefill_max_requests: int | None = None
    retraction_policy: str = "length"
    enable_priority_scheduling: bool = False
    priority_scheduling_preemption_threshold: int = 10
    radix_eviction_policy: str = "lru"

    # memory
    max_total_tokens: int | None = None
    mem_fraction_static: float | None = None
    page_size: int = 1
    kv_cache_dtype: str = "auto"
    cuda_graph_max_bs: int | None = None
    cuda_graph_bs: list[int] | None = None
    disable_cuda_graph: bool = False
    disable_piecewise_cuda_graph: bool = False
    enable_piecewise_cuda_graph: bool = False
    piecewise_cuda_graph_max_tokens: int | None = None
    piecewise_cuda_graph_tokens: list[int] | None = None
    skip_server_warmup: bool = False
    attention_backend: str = "auto"
    decode_attention_backend: str = "auto"
    """Kernels of all-decode steps; auto: triton up to 256 entries under flashinfer (faster)."""
    enable_torch_compile: bool = False  # accepted for compatibility: COMPAT_ONLY
    enable_memory_saver: bool = False  # accepted for compatibility: COMPAT_ONLY
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0
    """Host KV pool size as a multiple of the device pool's."""
    hicache_size: int = 0
    """Host KV pool size in GB (overrides hicache_ratio when > 0)."""
    hicache_write_policy: str = "write_through"
    hicache_storage_backend: str | None = None
    """"file": a content-keyed file store below the host tier (needs it)."""
    hicache_storage_dir: str | None = None
    """The file store's root (default: $SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, else
    /tmp/hicache)."""
    hicache_storage_max_size: float | None = None
    """GB of block files the file store may hold; past it the least recently used
    blocks are evicted (None: no cap)."""
    hicache_storage_prefetch_policy: str = "wait_complete"

    # parallelism
    tp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None

    # logging
    log_level: str = "info"
    log_format: str = "auto"
    """auto: console lines on a terminal, JSON lines otherwise."""
    log_requests: bool = False
    """Log every finished request at info level (ids, token counts, finish reason)."""
    log_level_http: str | None = None
    """Level of the HTTP access log lines; None: no access log."""
    decode_log_interval: int = 40
    """Log the decode batch (running, queued, token usage, throughput) every this many
    steps; 0: never."""
    enable_cache_report: bool = False  # accepted for compatibility: COMPAT_ONLY
    record_events: str | None = None
    """A directory: the bus recorder writes every message there."""
    bus_dir: str | None = None
    """Directory of the bus's ipc:// sockets, where `busctl tail --runtime-dir` attaches;
    None: <tmp>/shunter-<uid>/<port>."""

    # deployment
    multi_process: bool = False
    shutdown_timeout: float = 30.0
    """Seconds SIGTERM waits for in-flight requests before stopping anyway."""
    watchdog_timeout: float = 300.0
    """Seconds an actor may miss heartbeats (or a start may take) before it is dead."""
    heartbeat_interval: float = 1.0
    start_timeout: float = 600.0
    """Seconds an actor may take from start to Ready (loading weights) before start-up fails."""

    def __post_init__(self) -> None:
        for message in _problems(self):
            raise ValueError(message)

    @property
    def effective_tokenizer_path(self) -> str | None:
        return self.tokenizer_path if self.tokenizer_path is not None else self.model_path

    def to_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)


FIELDS: frozenset[str] = frozenset(ServerArgs.__struct_fields__)
# field -> the spelling used in error messages (the primary flag)
FLAG_OF: dict[str, str] = {field: flags[0] for field, flags, _, _ in OPTIONS}
FLAG_OF["config"] = "--config"
CHOICES: dict[str, tuple[str, ...]] = {
    "schedule_policy": SCHEDULE_POLICIES, "dtype": DTYPES, "load_format": LOAD_FORMATS,
    "device": DEVICES, "log_level": LOG_LEVELS, "log_format": LOG_FORMATS,
    "attention_backend": ATTENTION_BACKENDS, "weight_format": WEIGHT_FORMATS,
    "decode_attention_backend": DECODE_ATTENTION_BACKENDS, "kv_cache_dtype": KV_CACHE_DTYPES,
    "tokenizer_mode": TOKENIZER_MODES, "retraction_policy": RETRACTION_POLICIES,
    "radix_eviction_policy": RADIX_EVICTION_POLICIES,
    "hicache_write_policy": HICACHE_WRITE_POLICIES,
}  # fmt: skip
_PARALLEL_NAMES = {"tp_size": "tensor", "dp_size": "data", "pp_size": "pipeline",
                   "ep_size": "expert"}  # fmt: skip
assert {f for f, *_ in OPTIONS} == FIELDS, "every ServerArgs field needs exactly one OPTIONS row"


def _problems(a: ServerArgs) -> list[str]:
    """Every range/choice violation, as messages naming the flag."""
    out: list[str] = []

    def flag(field: str) -> str:
        return f"{FLAG_OF[field]} {getattr(a, field)!r}".replace("'", "")

    if a.tool_call_parser is not None and a.tool_call_parser not in TOOL_CALL_PARSERS:
        out.append(f"{flag('tool_call_parser')}: must be one of {', '.join(TOOL_CALL_PARSERS)}")

    for field, choices in CHOICES.items():
        if getattr(a, field) not in choices:
            out.append(f"{flag(field)}: must be one of {', '.join(choices)}")
    if a.decode_attention_backend == "flashinfer" and a.attention_backend in ("torch", "triton"):
        out.append(f"{flag('decode_attention_backend')}: needs --attention-backend flashinfer "
                   "(or auto)")  # fmt: skip
    for field, kind in _PARALLEL_NAMES.items():
        size = getattr(a, field)
        if size < 1:
            out.append(f"{flag(field)}: must be >= 1")
        elif size != 1:
            out.append(f"{flag(field)}: {kind} parallelism is not supported yet (only 1)")
    if a.nnodes != 1:
        out.append(f"{flag('nnodes')}: must be 1 (multi-node serving is not supported yet)")
    if a.node_rank != 0:
        out.append(f"{flag('node_rank')}: must be 0 (multi-node serving is not supported yet)")
    if not a.schedule_conservativeness > 0:
        out.append(f"{flag('schedule_conservativeness')}: must be > 0")
    if not 1 <= a.port <= 65535:
        out.append(f"{flag('port')}: must be a TCP port in 1..65535")
    if not a.host:
        out.append("--host: must not be empty")
    at_least_one = ("max_running_requests", "max_queued_requests", "max_prefill_tokens",
                    "max_total_tokens", "context_length", "page_size", "stream_interval",
                    "cuda_graph_max_bs", "prefill_max_requests",
                    "piecewise_cuda_graph_max_tokens")  # fmt: skip
    for field in at_least_one:
        value = getattr(a, field)
        if value is not None and value < 1:
            out.append(f"{flag(field)}: must be >= 1")
    if a.chunked_prefill_size is not None and (
        a.chunked_prefill_size == 0 or a.chunked_prefill_size < -1
    ):
        out.append(f"{flag('chunked_prefill_size')}: must be >= 1, or -1 to disable chunking")
    if not a.hicache_ratio > 0:
        out.append(f"{flag('hicache_ratio')}: must be > 0")
    if a.hicache_size < 0:
        out.append(f"{flag('hicache_size')}: must be >= 0 (GB; 0 uses --hicache-ratio)")
    if a.hicache_storage_backend is not None:
        if a.hicache_storage_backend != "file":
            out.append(f"{flag('hicache_storage_backend')}: "
                       f"{a.hicache_storage_backend!r} is not supported (only 'file' is)")  # fmt: skip
        if not a.enable_hierarchical_cache:
            out.append(f"{flag('hicache_storage_backend')}: needs "
                       "--enable-hierarchical-cache (blocks move through the host tier)")  # fmt: skip
    if a.hicache_storage_max_size is not None:
        if not a.hicache_storage_max_size > 0:
            out.append(f"{flag('hicache_storage_max_size')}: must be > 0 (GB; leave it out "
                       "for no cap)")  # fmt: skip
        if a.hicache_storage_backend != "file":
            out.append(f"{flag('hicache_storage_max_size')}: needs --hicache-storage-backend "
                       "file (it caps the file store)")  # fmt: skip
    if a.hicache_storage_prefetch_policy not in PREFETCH_POLICIES:
        out.append(f"{flag('hicache_storage_prefetch_policy')}: must be one of "
                   f"{', '.join(PREFETCH_POLICIES)}")  # fmt: skip
    if a.enable_hierarchical_cache and a.disable_radix_cache:
        out.append("--enable-hierarchical-cache: needs the radix cache (drop "
                   "--disable-radix-cache)")  # fmt: skip
    if a.mem_fraction_static is not None and not 0.0 < a.mem_fraction_static <= 1.0:
        out.append(f"{flag('mem_fraction_static')}: must be in (0, 1]")
    if a.random_seed is not None and not 0 <= a.random_seed < 2**63:
        out.append(f"{flag('random_seed')}: must be in [0, 2**63)")
    if a.shutdown_timeout < 0:
        out.append(f"{flag('shutdown_timeout')}: must be >= 0 seconds")
    for field in ("watchdog_timeout", "heartbeat_interval", "start_timeout"):
        if not getattr(a, field) > 0:
            out.append(f"{flag(field)}: must be > 0 seconds")
    if a.heartbeat_interval > 0 and a.watchdog_timeout <= 2 * a.heartbeat_interval:
        out.append(
            f"{flag('watchdog_timeout')}: must exceed twice --heartbeat-interval "
            f"({a.heartbeat_interval:g} s), or one late beat would count as a death"
        )
    if a.cuda_graph_bs is not None and (not a.cuda_graph_bs or min(a.cuda_graph_bs) < 1):
        out.append(f"{flag('cuda_graph_bs')}: batch sizes must be >= 1")
    tokens = a.piecewise_cuda_graph_tokens
    if tokens is not None and (not tokens or min(tokens) < 1):
        out.append(f"{flag('piecewise_cuda_graph_tokens')}: token counts must be >= 1")
    for field in ("decode_log_interval", "priority_scheduling_preemption_threshold"):
        if getattr(a, field) < 0:
            out.append(f"{flag(field)}: must be >= 0")
    if a.log_level_http is not None and a.log_level_http not in LOG_LEVELS:
        out.append(f"{flag('log_level_http')}: must be one of {', '.join(LOG_LEVELS)}")
    if a.kv_events_config is not None:
        from shunter.bus.kv_events import parse_config

        try:
            parse_config(a.kv_events_config)
        except ValueError as e:
            out.append(str(e))
    if a.json_model_override_args is not None:
        try:
            overrides = json.loads(a.json_model_override_args)
        except json.JSONDecodeError as e:
            overrides = e
        if not isinstance(overrides, dict):
            out.append(f"{FLAG_OF['json_model_override_args']}: must be a JSON object")
    for field in ("api_key", "admin_api_key", "served_model_name"):
        if getattr(a, field) == "":
            out.append(f"{FLAG_OF[field]}: must not be empty")
    return out


def check_paths(a: ServerArgs) -> None:
    """File-system checks, with messages naming the flag. Raises ValueError."""
    from shunter.actors.model_files import ModelNotFound, resolve_model

    try:
        source = resolve_model(a.model_path)
    except ModelNotFound as e:
        raise ValueError(f"--model-path: {e}") from None
    if a.load_format == "gguf" and source.kind != "gguf":
        raise ValueError(f"--load-format gguf: {source.path} is not a .gguf file")
    if a.load_format == "safetensors" and source.kind != "hf_dir":
        raise ValueError(
            f"--load-format safetensors: {source.path} is not a directory with config.json"
        )
    if a.tokenizer_path is not None and not pathlib.Path(a.tokenizer_path).expanduser().exists():
        raise ValueError(f"--tokenizer-path: {a.tokenizer_path} does not exist")
    template = a.chat_template
    if (template is not None and _looks_like_path(template)
            and not pathlib.Path(template).expanduser().is_file()):  # fmt: skip
        raise ValueError(
            f"--chat-template: {template} is not a file (an inline template "
            "must contain '{{' or '{%')"
        )
    if a.record_events is not None:
        p = pathlib.Path(a.record_events).expanduser()
        if p.exists() and not p.is_dir():
            raise ValueError(f"--record-events: {p} exists and is not a directory")
        if not p.exists() and not p.parent.is_dir():
            raise ValueError(f"--record-events: {p.parent} does not exist")


def _looks_like_path(template: str) -> bool:
    return "{{" not in template and "{%" not in template
