"""ModelConfig: the one description of a Llama-family decoder that the stack runs.

Theory of operation: every supported family (Llama 2/3/3.1, SmolLM2, Mistral, Qwen2/2.5,
Qwen3) is the same pre-norm decoder with a few switches: biases on q/k/v (Qwen2), a
per-head RMSNorm on q and k before rope (Qwen3), an explicit head_dim (Qwen3), a rope
frequency scaling (Llama 3.1), tied or untied embeddings, a sliding window (Mistral).
A ModelConfig is parsed from an HF config.json dict (`from_hf_dict`) or from GGUF
metadata (`from_gguf_metadata`); both land on the same fields, so the model code has
no per-family branches beyond those switches.

Invariants: num_heads is a multiple of num_kv_heads; head_dim is even (rope rotates
pairs); every size is positive. Violations raise ValueError (the loader wraps them).
"""

from __future__ import annotations

from typing import Any

import msgspec

# HF `architectures[0]` / `model_type` -> family name used here.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
HF_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}
# GGUF `general.architecture` values we can run.
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
ROPE_SCALING_TYPES = ("llama3", "linear")


class RopeScaling(msgspec.Struct, frozen=True):
    """Rope frequency scaling. "llama3": Llama 3.1's wavelength-banded scaling;
    "linear": positions divided by factor."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_SCALING_TYPES:
            raise ValueError(
                f"unsupported rope scaling {self.rope_type!r} (supported: {ROPE_SCALING_TYPES})"
            )
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor}")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("llama3 rope scaling needs high_freq_factor > low_freq_factor")


class ModelConfig(msgspec.Struct, frozen=True):
    """A Llama-family decoder's shape and switches."""

    family: str  # "llama" | "mistral" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rope_freq_factors: list[float] | None = None  # per-frequency divisors (GGUF rope_freqs)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # biases on q/k/v projections (Qwen2; attention_bias)
    o_bias: bool = False  # bias on the output projection (Llama/Qwen3 attention_bias)
    mlp_bias: bool = False  # biases on gate/up/down (Llama mlp_bias)
    qk_norm: bool = False  # per-head RMSNorm of q and k before rope (Qwen3)
    sliding_window: int | None = None  # keys older than this many positions are masked
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = []
    name: str = ""

    def __post_init__(self) -> None:
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                      "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):  # fmt: skip
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be > 0, got {getattr(self, field)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rope, got {self.head_dim}")
        if self.hidden_act not in ("silu", "swish"):
            raise ValueError(f"unsupported activation {self.hidden_act!r} (only silu)")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.rope_freq_factors is not None and (
            len(self.rope_freq_factors) != self.head_dim // 2 or min(self.rope_freq_factors) <= 0
        ):
            raise ValueError(f"rope_freq_factors must be {self.head_dim // 2} positive numbers")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be > 0, got {self.sliding_window}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self, elem_bytes: int) -> int:
        """K and V of one token over all layers."""
        return 2 * self.num_layers * self.kv_size * elem_bytes


def _eos_list(v: Any) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in v] if isinstance(v, list | tuple) else [int(v)]


def _rope_scaling_from_hf(d: dict) -> RopeScaling | None:
    rs = d.get("rope_scaling") or None
    params = d.get("rope_parameters") or None  # transformers >= 5 layout
    if rs is None and params is not None and params.get("rope_type", "default") != "default":
        rs = params
    if rs is None:
        return None
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return None
    return RopeScaling(
        rope_type=kind,
        factor=float(rs.get("factor", 1.0)),
        low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)),
    )


# HF config.json keys accepted as overrides for any source, and the field each sets
HF_KEY_ALIASES = {
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "rope_parameters": "rope_scaling",
}


def field_overrides(overrides: dict | None) -> dict[str, Any]:
    """Overrides keyed by ModelConfig field (HF aliases renamed). Raises ValueError
    naming any key that is neither a field nor an alias."""
    out: dict[str, Any] = {}
    fields = set(ModelConfig.__struct_fields__)
    for k, v in (overrides or {}).items():
        name = HF_KEY_ALIASES.get(k, k)
        if name not in fields:
            raise ValueError(f"unknown config override {k!r}")
        if name == "rope_scaling" and isinstance(v, dict):
            v = _rope_scaling_from_hf({"rope_scaling": v})
        if name == "eos_token_ids" and not isinstance(v, list):
            v = _eos_list(v)
        out[name] = v
    return out


_HF_KEYS_READ = frozenset((
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings",
    "tie_word_embeddings", "attention_bias", "mlp_bias", "sliding_window", "use_sliding_window",
    "hidden_act", "bos_token_id", "eos_token_id",
))  # fmt: skip


def from_hf_dict(d: dict, *, overrides: dict | None = None) -> ModelConfig:
    """Parse an HF config.json dict. `overrides` may use HF keys (applied to the dict
    before parsing) or ModelConfig field names. Raises ValueError for an unsupported
    architecture or an unknown override."""
    overrides = overrides or {}
    raw = {k: v for k, v in overrides.items() if k in d or k in _HF_KEYS_READ}
    fields = {k: v for k, v in overrides.items() if k not in raw}
    config = _from_hf_dict({**d, **raw})
    return replace(config, **field_overrides(fields)) if fields else config


def _from_hf_dict(d: dict) -> ModelConfig:
    archs = d.get("architectures") or []
    family = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
    if family is None:
        family = HF_MODEL_TYPES.get(d.get("model_type", ""))
    if family is None:
        raise ValueError(
            f"unsupported architecture {archs or d.get('model_type')!r} "
            f"(supported: {sorted(HF_ARCHITECTURES)})"
        )
    num_heads = int(d["num_attention_heads"])
    hidden = int(d["hidden_size"])
    theta = d.get("rope_theta")
    if theta is None:
        theta = (d.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    attention_bias = bool(d.get("attention_bias", False))
    sliding = d.get("sliding_window")
    if family in ("qwen2", "qwen3"):
        if d.get("use_sliding_window", False):
            raise ValueError(
                f"{family} with use_sliding_window (per-layer windows) is not supported"
            )
        sliding = None
    return ModelConfig(
        family=family,
        vocab_size=int(d["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(d["intermediate_size"]),
        num_layers=int(d["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
        head_dim=int(d.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        rope_scaling=_rope_scaling_from_hf(d),
        max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or attention_bias,
        o_bias=family in ("llama", "qwen3") and attention_bias,
        mlp_bias=bool(d.get("mlp_bias", False)),
        qk_norm=family == "qwen3",
        sliding_window=int(sliding) if sliding else None,
        hidden_act=d.get("hidden_act", "silu"),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=_eos_list(d.get("eos_token_id")),
        name=d.get("_name_or_path", "") or "",
    )


def from_gguf_metadata(meta: dict[str, Any], *, overrides: dict | None = None) -> ModelConfig:
    """Parse GGUF key/values (already decoded to Python values). `vocab_size` falls back
    to the tokenizer's token count; tied embeddings are decided by the loader (whether
    output.weight exists) and passed in overrides."""
    arch = meta.get("general.architecture")
    family = GGUF_ARCHITECTURES.get(arch or "")
    if family is None:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r} (supported: {sorted(GGUF_ARCHITECTURES)})"
        )

    def key(k: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{k}", default)

    hidden = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    vocab = key("vocab_size")
    if vocab is None:
        vocab = len(meta.get("tokenizer.ggml.tokens") or [])
    rs = None
    scaling_type = key("rope.scaling.type")
    if scaling_type in ("linear",) and float(key("rope.scaling.factor", 1.0)) != 1.0:
        rs = RopeScaling("linear", factor=float(key("rope.scaling.factor")))
    fields: dict[str, Any] = dict(
        family=family,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(key("attention.head_count_kv", num_heads)),
        head_dim=int(
            key("attention.key_length") or key("rope.dimension_count") or hidden // num_heads
        ),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=rs,
        max_position_embeddings=int(key("context_length", 4096)),
        qkv_bias=family == "qwen2",
        qk_norm=family == "qwen3",
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_eos_list(meta.get("tokenizer.ggml.eos_token_id")),
        name=meta.get("general.name", "") or "",
    )
    fields.update(field_overrides(overrides))
    return ModelConfig(**fields)


def replace(config: ModelConfig, **changes: Any) -> ModelConfig:
    """A copy with some fields changed (validated again)."""
    return msgspec.structs.replace(config, **changes)
