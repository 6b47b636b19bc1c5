"""Configuration of the gateway actor (a frozen Struct, validated on construction)."""

from __future__ import annotations

from typing import Any

import msgspec


class GatewayConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What the gateway needs; `shunter serve` builds it from server args."""

    host: str = "127.0.0.1"
    """--host: address to listen on."""

    port: int = 30000
    """--port: 0 picks a free port (reported through `task_status.started(port)`)."""

    api_key: str | None = None
    """--api-key: when set, every endpoint requires `Authorization: Bearer <key>`."""

    admin_api_key: str | None = None
    """--admin-api-key: when set, admin endpoints (/flush_cache, /abort_request) require
    it (and accept no other key); other endpoints accept it as well as api_key."""

    served_model_name: str = "default"
    """--served-model-name: the model id of /v1/models; other names get 404."""

    tool_call_parser: str | None = None
    """--tool-call-parser: how the model writes tool calls (gateway/tool_calls.py); None
    refuses chat requests with tools."""

    model_path: str = ""
    """Reported by /get_model_info and /v1/models (root)."""

    tokenizer_path: str = ""

    max_context_len: int = 8192
    """The model's context length (prompt + output), for /v1/models and early checks."""

    incremental_streaming_output: bool = False
    """--incremental-streaming-output: /generate streams each chunk's new text, ids and
    logprobs only (SGLang's default is the whole output so far in every chunk)."""

    log_level_http: str | None = None
    """--log-level-http: log one access line per HTTP request at this level; None: none."""

    max_n: int = 64
    """Largest `n` (choices per prompt) accepted."""

    max_prompts: int = 256
    """Largest batch of prompts in one /v1/completions or /generate request."""

    max_top_logprobs: int = 20

    enable_metrics: bool = False
    """--enable-metrics: serve /metrics (Prometheus text); 404 otherwise."""
    log_requests: bool = False
    """--log-requests: log every finished request at info level (else debug)."""
    weights_load_timeout_s: float = 600.0
    """How long a flip waits for the executor to load new weights (and for each other
    stage but the drain)."""

    health_timeout_s: float = 20.0
    """/health and /health_generate answer 503 when the engine does not answer in time."""

    query_timeout_s: float = 30.0
    """Bound on tokenizer queries (/v1/tokenize, /v1/detokenize, echo) and /flush_cache."""

    request_timeout_s: float | None = None
    """When set, a request whose next output takes longer than this fails with 504 (and is
    aborted). Unstreamed requests get a delta only every `non_stream_interval` tokens
    (tokenizer), so allow for that many decode steps."""

    max_body_bytes: int = 64 * 1024 * 1024

    actor_id: str = "gateway"

    server_info: dict[str, Any] = {}
    """Server arguments and facts reported as they are by /get_server_info."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_context_len < 2:
            raise ValueError(f"max_context_len must be >= 2, got {self.max_context_len}")
        for name in ("max_n", "max_prompts", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_top_logprobs < 0:
            raise ValueError(f"max_top_logprobs must be >= 0, got {self.max_top_logprobs}")
        for name in ("health_timeout_s", "query_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.api_key == "" or self.admin_api_key == "":
            raise ValueError("an API key must not be empty (leave it unset to disable)")
        if not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
