"""The benchmark's models: dummy model directories and what a step of one costs.

Theory of operation: `write_model_dir` writes an HF-style directory holding only
config.json (and, on request, a synthetic word-level tokenizer.json naming every id,
so the real server can run a dummy model end to end); the counting functions give the
parameters, the bytes a decode step must read (the roofline's denominator) and the
FLOPs of a prefill (the MFU's numerator) from a ModelConfig alone.

Invariants: counts are exact for the Llama-family model of actors/executor/models
(tests check them against the built model and torch's FLOP counter).
"""

from __future__ import annotations

import json
import pathlib

from shunter.actors.executor.models.config import ModelConfig

H200_PEAK_BF16_FLOPS = 989.4e12  # H200 SXM dense bf16, datasheet
LLAMA31_8B: dict = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
    "attention_bias": False, "mlp_bias": False, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}  # fmt: skip
# same family and switches, small enough for a CPU test (head_dim 64: flashinfer's smallest)
TINY_LLAMA: dict = {**LLAMA31_8B, "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
                    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                    "head_dim": 64, "max_position_embeddings": 16384, "torch_dtype": "float32",
                    "bos_token_id": None, "eos_token_id": None}  # fmt: skip
MODELS = {"llama-3.1-8b": LLAMA31_8B, "tiny-llama": TINY_LLAMA}


def write_model_dir(path: pathlib.Path, config: dict, tokenizer: bool = False) -> pathlib.Path:
    """An HF model directory holding config.json (for load_format "dummy") and, with
    `tokenizer`, a synthetic tokenizer.json covering the whole vocabulary."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    if tokenizer:
        write_tokenizer(path, config["vocab_size"])
    return path


def write_tokenizer(path: pathlib.Path, vocab_size: int) -> None:
    """tokenizer.json of a word-level vocabulary "t0" ... "t{V-1}" (whitespace split):
    every id the model can sample detokenizes, so a server can run a dummy model and
    a benchmark can send id prompts; the text means nothing."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.save(str(path / "tokenizer.json"))


# ---- counting: parameters, bytes per decode step, prefill FLOPs ----------------------


def layer_params(c: ModelConfig) -> int:
    """Parameters of one decoder layer (projections, biases, norms)."""
    h, i = c.hidden_size, c.intermediate_size
    n = h * (c.q_size + 2 * c.kv_size) + c.q_size * h + h * 2 * i + i * h + 2 * h
    n += (c.q_size + 2 * c.kv_size) * c.qkv_bias + h * c.o_bias + (3 * i + h) * c.mlp_bias
    return n + 2 * c.head_dim * c.qk_norm


def head_params(c: ModelConfig) -> int:
    """The logits projection (the embedding matrix itself when tied)."""
    return c.vocab_size * c.hidden_size


def model_params(c: ModelConfig) -> int:
    """Every parameter: embedding, layers, final norm, untied head."""
    tied_head = 0 if c.tie_word_embeddings else head_params(c)
    return c.vocab_size * c.hidden_size + c.num_layers * layer_params(c) + c.hidden_size + tied_head


def kv_bytes_per_token(c: ModelConfig, dtype_bytes: int) -> int:
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * dtype_bytes


def decode_step_bytes(c: ModelConfig, context_lens: list[int], dtype_bytes: int) -> int:
    """Bytes one decode step must read: every layer, the final norm and the head, one
    embedding row per entry, and the KV of each entry's context (its new token included)."""
    params = c.num_layers * layer_params(c) + c.hidden_size + head_params(c)
    params += len(context_lens) * c.hidden_size
    return params * dtype_bytes + kv_bytes_per_token(c, dtype_bytes) * sum(context_lens)


def prefill_flops(c: ModelConfig, num_tokens: int, num_logits: int = 1) -> float:
    """Model FLOPs of a causal prefill: 2 per weight per token through the layers, the
    head only for the rows whose logits are computed, and attention's QK^T and PV over
    the causal half: 2 * 2 * layers * heads * head_dim * T^2 / 2."""
    t = num_tokens
    dense = 2.0 * c.num_layers * layer_params(c) * t + 2.0 * head_params(c) * num_logits
    return dense + 2.0 * c.num_layers * c.num_heads * c.head_dim * t * t


# ---- arguments -------------------------------------------------------------------------

# defaults of the options bench_executor shares, on a GPU; --quick replaces them all
