"""GGUF weights and config, dequantized to float32.

The header is parsed here (`open_reader`): the tokenizer's arrays are skipped, not
decoded, and tensor data stays memory-mapped until each tensor is dequantized (Q4_1
and Q8_0 in torch, other types through gguf.quants), so a load costs about one pass
over the file. A truncated or malformed file raises GGUFFormatError naming the spot.

llama.cpp's converter permutes the rows of q and k for the "llama" architecture (it
rotates interleaved pairs, HF rotates halves); `unpermute_qk` undoes that so weights
match HF and the half-rotated rope here. qwen2/qwen3 GGUFs are stored unpermuted.
output.weight absent means tied embeddings.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
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


class GGUFFormatError(ValueError):
    """The file is not a well-formed GGUF file (bad magic, truncated, ...)."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # GGUF order (innermost first), as llama.cpp writes it
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray  # raw bytes (quantized: uint8 [rows, row_bytes]) or typed array


@dataclass(frozen=True)
class GGUFFile:
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]


# GGUF value types: id -> struct format (scalars); 8 = string, 9 = array
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}  # fmt: skip
# array keys whose contents are not needed here: only their length is kept
_SKIP_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                "tokenizer.ggml.scores")  # fmt: skip


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GGUFFormatError(f"truncated header at byte {self.pos}")
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise GGUFFormatError(f"truncated string at byte {self.pos}")
        v = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return v

    def value(self, vtype: int, keep: bool = True) -> Any:
        if vtype in _SCALAR:
            return self.unpack(_SCALAR[vtype])
        if vtype == 8:
            if keep:
                return self.string()
            n = self.unpack("<Q")
            self.pos += n
            if self.pos > len(self.buf):
                raise GGUFFormatError("truncated string array")
            return None
        if vtype == 9:
            etype, count = self.unpack("<I"), self.unpack("<Q")
            if count > len(self.buf) - self.pos:  # every element takes at least one byte
                raise GGUFFormatError(f"array of {count} elements overruns the file")
            if not keep and etype in _SCALAR:  # skip fixed-size elements in one jump
                self.pos += count * struct.calcsize(_SCALAR[etype])
                if self.pos > len(self.buf):
                    raise GGUFFormatError("truncated array")
                return [None] * count
            items = [self.value(etype, keep) for _ in range(count)]
            return items if keep else [None] * count
        raise GGUFFormatError(f"unknown GGUF value type {vtype}")


def open_reader(path: str) -> GGUFFile:
    """Parse a GGUF file's header and map its tensors (no data is copied or
    dequantized here). Raises GGUFFormatError on a malformed or truncated file."""
    import gguf

    with open(path, "rb") as f:
        mm = np.memmap(f, dtype=np.uint8, mode="r")
    buf = memoryview(mm)
    cur = _Cursor(buf)
    if bytes(buf[:4]) != b"GGUF":
        raise GGUFFormatError("not a GGUF file (bad magic)")
    cur.pos = 4
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise GGUFFormatError(f"unsupported GGUF version {version}")
    num_tensors, num_kv = cur.unpack("<Q"), cur.unpack("<Q")
    meta: dict[str, Any] = {}
    for _ in range(num_kv):
        key = cur.string()
        meta[key] = cur.value(cur.unpack("<I"), keep=key not in _SKIP_ARRAYS)
    infos = []
    for _ in range(num_tensors):
        name = cur.string()
        dims = tuple(cur.unpack("<Q") for _ in range(cur.unpack("<I")))
        infos.append((name, dims, cur.unpack("<I"), cur.unpack("<Q")))
    align = int(meta.get("general.alignment", 32))
    data_start = -(-cur.pos // align) * align
    tensors = []
    for name, dims, tid, offset in infos:
        try:
            qtype = gguf.GGMLQuantizationType(tid)
        except ValueError:
            raise GGUFFormatError(f"tensor {name}: unknown type id {tid}") from None
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        num_elems = int(np.prod(dims)) if dims else 1
        nbytes = num_elems // block * type_size
        begin = data_start + offset
        if begin + nbytes > len(mm):
            raise GGUFFormatError(
                f"truncated: tensor {name} needs bytes {begin}..{begin + nbytes}, file has {len(mm)}"
            )
        raw = mm[begin : begin + nbytes]
        rows = num_elems // dims[0] if dims else 1
        if qtype == gguf.GGMLQuantizationType.F32:
            data = raw.view(np.float32).reshape(*reversed(dims))
        elif qtype == gguf.GGMLQuantizationType.F16:
            data = raw.view(np.float16).reshape(*reversed(dims))
        else:
            data = raw.reshape(rows, -1)
        tensors.append(GGUFTensor(name, dims, qtype, data))
    return GGUFFile(meta, tensors)


def read_metadata(reader: GGUFFile) -> dict[str, Any]:
    return reader.metadata


def config_from_reader(reader: Any, overrides: dict | None = None) -> ModelConfig:
    meta = read_metadata(reader)
    names = {t.name for t in reader.tensors}
    fields: dict[str, Any] = {"tie_word_embeddings": "output.weight" not in names}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":  # Llama 3.1 scaling, stored as frequency divisors
            fields["rope_freq_factors"] = dequantize(t).reshape(-1).tolist()
    return from_gguf_metadata(meta, overrides={**fields, **(overrides or {})})


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's rope permutation of q/k rows: [n_head*D, in] -> same shape."""
    rows = w.shape[0]
    return (
        w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _dequantize_torch(raw: np.ndarray, qtype: Any) -> torch.Tensor | None:
    """Q4_1 and Q8_0 in torch (the default model's types), with the same float32
    operations as gguf.quants so results are identical; None for other types."""
    import gguf

    t = torch.from_numpy(np.array(raw, dtype=np.uint8))  # [rows, row_bytes], a copy
    if qtype == gguf.GGMLQuantizationType.Q4_1:  # block: f16 d, f16 m, 16 bytes of nibbles
        b = t.reshape(-1, 20)
        d = b[:, 0:2].contiguous().view(torch.float16).float()  # [nb, 1]
        m = b[:, 2:4].contiguous().view(torch.float16).float()
        qs = b[:, 4:]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=1).float()  # [nb, 32]: low nibbles first
        return (d * q + m).reshape(raw.shape[0], -1)
    if qtype == gguf.GGMLQuantizationType.Q8_0:  # block: f16 d, 32 int8
        b = t.reshape(-1, 34)
        d = b[:, 0:2].contiguous().view(torch.float16).float()
        q = b[:, 2:].contiguous().view(torch.int8).float()
        return (d * q).reshape(raw.shape[0], -1)
    return None


def dequantize(tensor: Any) -> torch.Tensor:
    """A GGUFTensor -> float32 torch tensor in HF (row-major [out, in]) shape."""
    import gguf

    qtype = tensor.tensor_type
    shape = tuple(int(x) for x in reversed(tensor.shape))
    if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        arr = np.array(tensor.data, dtype=np.float32)  # a copy: the source is a read-only map
    else:
        fast = _dequantize_torch(tensor.data, qtype)
        if fast is not None:
            return fast.reshape(shape)
        arr = np.ascontiguousarray(gguf.quants.dequantize(tensor.data, qtype), dtype=np.float32)
    return torch.from_numpy(arr.reshape(shape))


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
