"""GGUF weights and config: read with gguf.GGUFReader, dequantized to float32.

llama.cpp's converter permutes the rows of q and k for the "llama" architecture (it
rotates interleaved pairs, HF rotates halves); `unpermute_qk` undoes that so weights
match HF and the half-rotated rope here. qwen2/qwen3 GGUFs are stored unpermuted.
output.weight absent means tied embeddings.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from shunter.actors.executor.models.config import ModelConfig, from_gguf_metadata

# GGUF tensor name (after "blk.{i}.") -> HF name (after "model.layers.{i}.")
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_SKIP = {"rope_freqs.weight"}


def open_reader(path: str) -> Any:
    import gguf

    return gguf.GGUFReader(path)


def read_metadata(reader: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("tokenizer.ggml.") and name not in (
            "tokenizer.ggml.bos_token_id",
            "tokenizer.ggml.eos_token_id",
        ):
            if name == "tokenizer.ggml.tokens":
                meta[name] = [None] * len(field.data)  # only the count is needed
            continue
        try:
            meta[name] = field.contents()
        except Exception:  # a field of an exotic type: not one the config reads
            continue
    return meta


def config_from_reader(reader: Any, overrides: dict | None = None) -> ModelConfig:
    meta = read_metadata(reader)
    names = {t.name for t in reader.tensors}
    fields: dict[str, Any] = {"tie_word_embeddings": "output.weight" not in names}
    if "rope_freqs.weight" in names:
        raise ValueError(
            "this GGUF carries rope_freqs (Llama 3.1 rope scaling in tensor form), "
            "which is not supported; load the HF directory instead"
        )
    fields.update(overrides or {})
    return from_gguf_metadata(meta, overrides=fields)


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's rope permutation of q/k rows: [n_head*D, in] -> same shape."""
    rows = w.shape[0]
    return (
        w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def dequantize(tensor: Any) -> torch.Tensor:
    """A ReaderTensor -> float32 torch tensor in HF (row-major [out, in]) shape."""
    import gguf

    qtype = tensor.tensor_type
    if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        arr = np.asarray(tensor.data, dtype=np.float32)
    else:
        arr = gguf.quants.dequantize(tensor.data, qtype)
    shape = tuple(int(x) for x in reversed(tensor.shape.tolist()))
    return torch.from_numpy(np.array(arr, dtype=np.float32, copy=True).reshape(shape))


def iter_weights(reader: Any, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every tensor of the file."""
    for t in reader.tensors:
        name = t.name
        if name in _SKIP:
            continue
        if name in _TOP_NAMES:
            hf = _TOP_NAMES[name]
        elif name.startswith("blk."):
            _, idx, rest = name.split(".", 2)
            if rest not in _BLOCK_NAMES:
                raise ValueError(f"GGUF tensor {name} is not one this model has")
            hf = f"model.layers.{idx}.{_BLOCK_NAMES[rest]}"
        else:
            raise ValueError(f"GGUF tensor {name} is not one this model has")
        w = dequantize(t)
        if config.family == "llama":
            if rest_is(name, "attn_q.weight"):
                w = unpermute_qk(w, config.num_heads)
            elif rest_is(name, "attn_k.weight"):
                w = unpermute_qk(w, config.num_kv_heads)
        yield hf, w


def rest_is(name: str, suffix: str) -> bool:
    return name.startswith("blk.") and name.endswith("." + suffix)
