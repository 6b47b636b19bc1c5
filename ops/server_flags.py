"""The command-line flags of `shunter serve`: for each ServerArgs field its spellings
(SGLang's, with the aliases users type: `--tp`, `--max-prefill-num-token`, vLLM's
`--max-model-len`, ...), its help group and text; the SGLang options taken only so
that their command lines run (COMPAT_ONLY); and those refused with the reason
(REFUSED). Types, choices and defaults come from ServerArgs itself (server_args.py);
server_cli.py builds the parser from this table.
"""

from __future__ import annotations

# Options taken so that SGLang command lines run, with why each changes nothing here
# (done already, or meaningless): `shunter serve` says so at start.
COMPAT_ONLY = {
    "trust_remote_code": "no code from a model directory is ever run",
    "revision": "models are read from local files only",
    "enable_mixed_chunk": "prefill chunks always share steps with decodes",
    "enable_torch_compile": "the executor runs its own kernels and CUDA graphs",
    "enable_memory_saver": "/release_memory_occupation works without it",
    "enable_cache_report": "cached_tokens is always in the usage",
    "dist_init_addr": "one node serves alone",
}


def _compat(field: str) -> str:
    return f"accepted for compatibility ({COMPAT_ONLY[field]})"


# (field, flags, group, help). Types, choices and defaults come from ServerArgs itself.
OPTIONS: tuple[tuple[str, tuple[str, ...], str, str], ...] = (
    ("model_path", ("--model-path", "--model"), "model",
     "local HF directory or .gguf file (default: the bundled SmolLM2-135M-Instruct)"),
    ("tokenizer_path", ("--tokenizer-path",), "model", "tokenizer location (default: the model path)"),
    ("load_format", ("--load-format",), "model", "weight format; dummy = random weights"),
    ("weight_format", ("--weight-format",), "model",
     "keep projection weights packed (CPU decode reads fewer bytes; int4 is fastest at "
     "small batches); none keeps them in --dtype and greedy output exact"),
    ("dtype", ("--dtype",), "model", "weight and activation dtype"),
    ("device", ("--device",), "model", "where the model runs"),
    ("context_length", ("--context-length", "--max-model-len"), "model",
     "maximum tokens per sequence"),
    ("served_model_name", ("--served-model-name",), "model", "model name the API reports"),
    ("chat_template", ("--chat-template",), "model", "chat template file or inline template"),
    ("tool_call_parser", ("--tool-call-parser",), "model",
     "how the model writes tool calls (qwen25/hermes, llama3, mistral, pythonic): requests "
     "may pass tools"),
    ("random_seed", ("--random-seed", "--seed"), "model", "seed for request seeds"),
    ("trust_remote_code", ("--trust-remote-code",), "model",
     _compat("trust_remote_code")),
    ("revision", ("--revision",), "model",
     _compat("revision")),
    ("tokenizer_mode", ("--tokenizer-mode",), "model", "the HF fast tokenizer"),
    ("skip_tokenizer_init", ("--skip-tokenizer-init",), "model",
     "load no tokenizer: prompts are input_ids, outputs output_ids with empty text"),
    ("json_model_override_args", ("--json-model-override-args",), "model",
     "JSON object of config.json keys to override, e.g. '{\"num_hidden_layers\": 2}'"),
    ("allow_auto_truncate", ("--allow-auto-truncate",), "model",
     "cut a prompt as long as the context to its first context-1 tokens instead of a 400"),

    ("host", ("--host",), "server", "address to listen on"),
    ("port", ("--port",), "server", "HTTP port"),
    ("api_key", ("--api-key",), "server", "bearer key required on every endpoint"),
    ("admin_api_key", ("--admin-api-key",), "server", "bearer key for admin endpoints"),
    ("enable_metrics", ("--enable-metrics",), "server", "serve Prometheus text at /metrics"),
    ("incremental_streaming_output", ("--incremental-streaming-output",), "server",
     "/generate streams only each chunk's new text and ids (default: all so far)"),
    ("kv_events_config", ("--kv-events-config",), "server",
     "JSON, e.g. '{\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\"}': publish KV "
     "cache events (BlockStored, BlockRemoved) for cache-aware routers"),
    ("schedule_policy", ("--schedule-policy",), "scheduling", "waiting-queue order"),
    ("max_running_requests", ("--max-running-requests", "--max-num-seqs"), "scheduling",
     "most requests decoding at once (default: from the KV pool size)"),
    ("max_queued_requests", ("--max-queued-requests",), "scheduling",
     "most requests waiting for admission; more are refused with 503 (default: no bound)"),
    ("max_prefill_tokens", ("--max-prefill-tokens", "--max-prefill-num-token"), "scheduling",
     "token budget of one prefill batch (its first request is always admitted)"),
    ("chunked_prefill_size", ("--chunked-prefill-size",), "scheduling",
     "longest prefill chunk; -1 disables chunking"),
    ("disable_radix_cache", ("--disable-radix-cache",), "scheduling", "no prefix sharing"),
    ("disable_overlap_schedule", ("--disable-overlap-schedule",), "scheduling",
     "plan a step only after the previous one finished"),
    ("stream_interval", ("--stream-interval",), "scheduling", "tokens per streamed chunk"),
    ("schedule_conservativeness", ("--schedule-conservativeness",), "scheduling",
     "scales the output tokens admission reserves per request (larger: fewer retractions)"),
    ("enable_mixed_chunk", ("--enable-mixed-chunk",), "scheduling",
     _compat("enable_mixed_chunk")),
    ("prefill_max_requests", ("--prefill-max-requests",), "scheduling",
     "most requests with prefill work in one step (default: the token budgets only)"),
    ("retraction_policy", ("--retraction-policy",), "scheduling",
     "which running requests KV pressure retracts first: length (fewest outputs, longest "
     "prompt) or priority (lowest first)"),
    ("enable_priority_scheduling", ("--enable-priority-scheduling",), "scheduling",
     "order by request priority (as --schedule-policy priority) and preempt past the threshold"),
    ("priority_scheduling_preemption_threshold", ("--priority-scheduling-preemption-threshold",),
     "scheduling", "a waiting request this much higher in priority retracts the lowest "
     "running one when no slot is free"),
    ("radix_eviction_policy", ("--radix-eviction-policy",), "scheduling",
     "prefix-cache eviction order: lru, or lfu (fewest hits first)"),
    ("max_total_tokens", ("--max-total-tokens",), "memory", "KV pool size in tokens"),
    ("enable_hierarchical_cache", ("--enable-hierarchical-cache",), "memory",
     "keep evicted prefix pages in a host-memory KV tier and load them back on a match"),
    ("hicache_ratio", ("--hicache-ratio",), "memory",
     "host KV pool size as a multiple of the device pool's"),
    ("hicache_size", ("--hicache-size",), "memory",
     "host KV pool size in GB (overrides --hicache-ratio when > 0)"),
    ("hicache_write_policy", ("--hicache-write-policy",), "memory",
     "when cached pages are copied to the host: write_through (as they are cached), "
     "write_through_selective (once a match reuses them) or write_back (as they are evicted)"),
    ("hicache_storage_backend", ("--hicache-storage-backend",), "memory",
     "file: also keep backed-up prefixes in a file store, keyed by content, read back into "
     "the host tier on a match (and found again by a later server of the same model)"),
    ("hicache_storage_dir", ("--hicache-storage-dir",), "memory",
     "the file store's directory (default: $SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, "
     "else /tmp/hicache)"),
    ("hicache_storage_max_size", ("--hicache-storage-max-size",), "memory",
     "GB of block files the file store may hold on disk; past it the least recently used "
     "blocks are deleted (default: no cap)"),
    ("hicache_storage_prefetch_policy", ("--hicache-storage-prefetch-policy",), "memory",
     "wait_complete: a match waits for its blocks to be read from the file store; "
     "best_effort: it never waits (the read fills the host tier for later matches); "
     "timeout: it waits 1 s + 0.25 s per 1024 tokens at most"),
    ("mem_fraction_static", ("--mem-fraction-static", "--gpu-memory-utilization"), "memory",
     "fraction of device memory for weights and KV pool"),
    ("page_size", ("--page-size", "--block-size"), "memory", "tokens per KV page"),
    ("kv_cache_dtype", ("--kv-cache-dtype",), "memory", "KV cache dtype (auto: the model's)"),
    ("cuda_graph_max_bs", ("--cuda-graph-max-bs",), "memory", "largest CUDA-graph batch"),
    ("cuda_graph_bs", ("--cuda-graph-bs",), "memory",
     "decode batch sizes to capture as CUDA graphs (default: 1, 2, 4, 8, 12, 16, 24, ...)"),
    ("disable_cuda_graph", ("--disable-cuda-graph", "--enforce-eager"), "memory",
     "run every step without CUDA graphs (decode and piecewise)"),
    ("enable_piecewise_cuda_graph",
     ("--enable-piecewise-cuda-graph", "--enforce-piecewise-cuda-graph"), "memory",
     "replay prefill, extend and mixed steps from piecewise CUDA graphs (off by default: "
     "a server under load stalled with them, BENCHMARKS.md)"),
    ("disable_piecewise_cuda_graph", ("--disable-piecewise-cuda-graph",), "memory",
     "no piecewise CUDA graphs, whatever else says (the default)"),
    ("piecewise_cuda_graph_max_tokens", ("--piecewise-cuda-graph-max-tokens",), "memory",
     "largest prefill/extend step (new tokens) replayed from piecewise CUDA graphs "
     "(default 512)"),
    ("piecewise_cuda_graph_tokens", ("--piecewise-cuda-graph-tokens",), "memory",
     "step sizes (new tokens) captured piecewise (default: 4, 8, 12, ..., 32, 48, 64, ...)"),
    ("skip_server_warmup", ("--skip-server-warmup",), "memory",
     "no warm-up steps before ready (kernels built on first use then stall a request)"),
    ("attention_backend", ("--attention-backend",), "memory", "attention kernels"),
    ("decode_attention_backend", ("--decode-attention-backend",), "memory",
     "decode attention kernels (auto: triton for decode batches up to 256 under flashinfer)"),
    ("enable_torch_compile", ("--enable-torch-compile",), "memory",
     _compat("enable_torch_compile")),
    ("enable_memory_saver", ("--enable-memory-saver",), "memory",
     _compat("enable_memory_saver")),
    ("tp_size", ("--tp-size", "--tensor-parallel-size", "--tp"), "parallelism",
     "tensor parallel size"),
    ("dp_size", ("--dp-size", "--data-parallel-size", "--dp"), "parallelism",
     "data parallel size"),
    ("pp_size", ("--pp-size", "--pipeline-parallel-size", "--pp"), "parallelism",
     "pipeline parallel size"),
    ("ep_size", ("--ep-size", "--expert-parallel-size", "--ep"), "parallelism",
     "expert parallel size"),
    ("nnodes", ("--nnodes",), "parallelism", "number of nodes"),
    ("node_rank", ("--node-rank",), "parallelism", "this node's rank"),
    ("dist_init_addr", ("--dist-init-addr", "--nccl-init-addr"), "parallelism",
     "address of the first node (multi-node)"),
    ("log_level", ("--log-level",), "logging", "least severe level logged"),
    ("log_format", ("--log-format",), "logging", "console lines or JSON lines"),
    ("log_requests", ("--log-requests", "--enable-log-requests"), "logging",
     "log every finished request (ids, token counts, finish reason, latency)"),
    ("log_level_http", ("--log-level-http",), "logging",
     "level of one access log line per HTTP request (default: none logged)"),
    ("decode_log_interval", ("--decode-log-interval",), "logging",
     "decode steps between decode-batch log lines; 0: none"),
    ("enable_cache_report", ("--enable-cache-report",), "logging",
     _compat("enable_cache_report")),
    ("record_events", ("--record-events",), "logging",
     "record every bus message into this directory (replay with busctl)"),
    ("bus_dir", ("--bus-dir",), "logging",
     "directory of the bus sockets busctl attaches to (default: <tmp>/shunter-<uid>/<port>)"),
    ("multi_process", ("--multi-process",), "deployment",
     "one process per actor over a ZMQ broker (default: all actors in one event loop)"),
    ("shutdown_timeout", ("--shutdown-timeout",), "deployment",
     "seconds SIGTERM waits for in-flight requests"),
    ("watchdog_timeout", ("--watchdog-timeout",), "deployment",
     "seconds without a heartbeat (or to start) before an actor counts as dead"),
    ("heartbeat_interval", ("--heartbeat-interval",), "deployment",
     "seconds between actor heartbeats"),
    ("start_timeout", ("--start-timeout",), "deployment",
     "seconds an actor may take to become ready (load its model)"),
)  # fmt: skip

# SGLang options for what this server does not do yet: given, each stops the start with
# the reason (rather than argparse's "unrecognized arguments").
REFUSED: dict[tuple[str, ...], str] = {
    ("--quantization",): "quantized checkpoints are not supported yet (--weight-format "
    "packs the projection weights of a float checkpoint for the CPU)",
    ("--enable-lora", "--lora-paths"): "LoRA adapters are not supported yet",
    ("--speculative-algorithm",): "speculative decoding is not supported yet",
    ("--enable-dp-attention",): "data-parallel attention is not supported yet",
    ("--hicache-io-backend", "--hicache-mem-layout"): "choosing the host KV tier's copy "
    "path or layout is not supported (it copies by index over all layers, layer first)",
    ("--attention-context-parallel-size", "--attn-cp-size"): "context parallelism is not "
    "supported yet",
    ("--moe-data-parallel-size", "--moe-dp-size"): "MoE models are not supported yet",
    ("--pp-max-micro-batch-size",): "pipeline parallelism is not supported yet",
    ("--load-balance-method",): "data parallelism (which it balances) is not supported yet",
    ("--tokenizer-worker-num", "--detokenizer-worker-num"): "one tokenizer actor serves all "
    "requests (several are not supported yet)",
}

GROUPS = ("model", "server", "scheduling", "memory", "parallelism", "logging", "deployment")
