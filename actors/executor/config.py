"""ExecutorConfig: what one executor (one device / TP rank) needs to start."""

from __future__ import annotations

from typing import Any

import msgspec

from shunter.actors.executor.models.quant import WEIGHT_FORMATS

DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flashinfer")
DECODE_ATTENTION_BACKENDS = ("auto", "triton", "flashinfer")
# Decode batch sizes captured as CUDA graphs up to cuda_graph_max_bs (and that bound itself)
DEFAULT_CUDA_GRAPH_MAX_BS = 256
# Largest step (new tokens) replayed from piecewise graphs unless told: above it the device,
# not the host's launches, sets a step's time (BENCHMARKS.md, "piecewise graphs")
DEFAULT_PIECEWISE_MAX_TOKENS = 512
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


class ExecutorConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Config of one executor actor. Validated on construction (ValueError)."""

    actor_id: str = "executor.0"
    """Bus publisher id and Ready.actor_id."""
    model_path: str | None = None
    """HF directory, .gguf file, or None / "smollm2" for the default model."""
    tokenizer_path: str | None = None
    """--tokenizer-path: read for the token texts of constrained decoding (regex)."""
    dtype: str = "auto"
    """Weights and KV dtype; "auto" is float32 on a CPU and bfloat16 on CUDA."""
    device: str = "auto"
    """"cpu", "cuda", "cuda:N" or "auto" (CUDA when available)."""
    load_format: str = "auto"
    page_size: int = 1
    """Tokens per KV page (must match the cache manager's)."""
    max_total_tokens: int | None = None
    """KV pool size in tokens; None sizes it from mem_fraction_static."""
    mem_fraction_static: float | None = None
    """Share of free memory for the KV pool (host memory on a CPU); None: the pool's default."""
    context_length: int | None = None
    """Longest sequence a row may reach; None: the model's own limit."""
    seed: int = 0
    """Seed of random weights under load_format "dummy"."""
    num_threads: int | None = None
    """torch intra-op threads on a CPU; None leaves torch's default."""
    max_num_rows: int = 4096
    """Row indices must be below this (rows are the scheduler's running slots)."""
    load_progress: bool = True
    """Show a progress bar while loading weights."""
    model_overrides: dict[str, Any] = {}
    """ModelConfig fields to override (e.g. num_layers for a small dummy model)."""
    weight_format: str = "none"
    """Projection weights kept as "bf16", "int8" or "int4" (models/quant.py) to cut the
    bytes a CPU decode step reads; "none" keeps them in the model dtype."""

    attention_backend: str = "auto"
    """"torch" (any device), "triton" or "flashinfer" (CUDA); "auto": flashinfer on CUDA
    when it imports, else triton; torch on a CPU."""
    decode_attention_backend: str = "auto"
    """Kernels of all-decode steps under the flashinfer backend: "triton" (split-KV
    decode over the device slot table) or "flashinfer"; "auto": triton for batches of at
    most backends.TRITON_DECODE_MAX_BS entries, flashinfer above. Other backends decode
    with their own kernels ("flashinfer" then refused, and both refused on a CPU)."""
    cuda_graph_max_bs: int | None = None
    """Largest decode batch replayed from a CUDA graph; None: DEFAULT_CUDA_GRAPH_MAX_BS
    (capped by max_num_rows). Larger decode batches and every prefill run eagerly."""
    disable_cuda_graph: bool = False
    """Run every step eagerly on CUDA (no graph capture)."""
    cuda_graph_bs: tuple[int, ...] | None = None
    """The decode batch sizes captured (SGLang's --cuda-graph-bs); the largest is the
    largest replayed unless cuda_graph_max_bs is smaller. None: the default buckets."""
    piecewise_cuda_graph: bool = False
    """Replay prefill, extend and mixed steps from piecewise graphs (piecewise_graph.py).
    Off by default: on an H200 it halved short steps, but a server under a request rate
    stalled for seconds with it on, not yet explained (BENCHMARKS.md)."""
    piecewise_cuda_graph_max_tokens: int | None = None
    """Largest step (new tokens) replayed from piecewise graphs (piecewise_graph.py);
    None: DEFAULT_PIECEWISE_MAX_TOKENS."""
    piecewise_cuda_graph_tokens: tuple[int, ...] | None = None
    """The step sizes (new tokens) captured piecewise; None: the default sizes."""
    skip_server_warmup: bool = False
    """On CUDA, skip the warm-up steps (warmup.py) that build the attention kernels
    compiled on first use before the executor is ready."""
    enable_hierarchical_cache: bool = False
    """Keep a host-memory KV tier (host_pool.py) that SpillPages and LoadPages copy
    pages to and from."""
    hicache_ratio: float = 2.0
    """Host pool pages per device pool page."""
    hicache_size: float = 0.0
    """GB of host memory for the host pool; 0: use hicache_ratio."""
    hicache_storage_dir: str = ""
    """With the host tier: a directory for the file store below it (file_store.py),
    which StorePages and FetchPages write and read; "": none."""
    hicache_storage_max_size: float = 0.0
    """GB (1e9 bytes) of block files the file store may hold (the cache manager evicts
    to stay under it); 0: no cap."""

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
        if self.decode_attention_backend not in DECODE_ATTENTION_BACKENDS:
            raise ValueError(
                f"decode_attention_backend must be one of {DECODE_ATTENTION_BACKENDS}, "
                f"got {self.decode_attention_backend!r}"
            )
        if self.cuda_graph_bs is not None and (
            not self.cuda_graph_bs or min(self.cuda_graph_bs) < 1
        ):
            raise ValueError(f"cuda_graph_bs must be sizes >= 1, got {self.cuda_graph_bs}")
        tokens = self.piecewise_cuda_graph_tokens
        if tokens is not None and (not tokens or min(tokens) < 1):
            raise ValueError(f"piecewise_cuda_graph_tokens must be sizes >= 1, got {tokens}")
        if (
            self.piecewise_cuda_graph_max_tokens is not None
            and self.piecewise_cuda_graph_max_tokens < 1
        ):
            raise ValueError("piecewise_cuda_graph_max_tokens must be >= 1, got "
                             f"{self.piecewise_cuda_graph_max_tokens}")  # fmt: skip
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if not self.hicache_storage_max_size >= 0:
            raise ValueError("hicache_storage_max_size must be >= 0 GB (0: no cap), got "
                             f"{self.hicache_storage_max_size}")  # fmt: skip
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ValueError(f"max_total_tokens must be >= 1, got {self.max_total_tokens}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static <= 1:
            raise ValueError(
                f"mem_fraction_static must be in (0, 1], got {self.mem_fraction_static}"
            )
        if self.context_length is not None and self.context_length < 1:
            raise ValueError(f"context_length must be >= 1, got {self.context_length}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.weight_format not in WEIGHT_FORMATS:
            raise ValueError(
                f"weight_format must be one of {WEIGHT_FORMATS}, got {self.weight_format!r}"
            )
        if self.max_num_rows < 1:
            raise ValueError(f"max_num_rows must be >= 1, got {self.max_num_rows}")
        if not self.hicache_ratio > 0:
            raise ValueError(f"hicache_ratio must be > 0, got {self.hicache_ratio}")
        if not self.hicache_size >= 0:
            raise ValueError(f"hicache_size must be >= 0, got {self.hicache_size}")
