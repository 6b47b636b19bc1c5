"""Load a model: HF safetensors directory, GGUF file (dequantized) or dummy weights.

Theory of operation: `load_model` resolves the path (None / "smollm2" is the default
GGUF), parses a ModelConfig, checks that the dtype can run matmuls on the device (by
trying one), builds the model with uninitialised storage on the device and streams
tensors into it under a progress bar. Every failure a user can cause (missing file,
unsupported architecture, truncated or corrupt weights, unusable dtype/device) is a
LoadError whose message names the file and the reason.

Invariants: every model parameter is written exactly once (or, for fused q/k/v and
gate/up, each part once); a checkpoint tensor with no place in the model is an error.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator
from typing import Any

import structlog
import torch
from tqdm import tqdm

from shunter.actors.executor import loader_gguf
from shunter.actors.executor.models.config import ModelConfig, from_hf_dict
from shunter.actors.executor.models.llama import LlamaForCausalLM
from shunter.actors.executor.models.quant import WEIGHT_FORMATS, convert_linears
from shunter.actors.model_files import ModelNotFound, resolve_model

log = structlog.get_logger("shunter.loader")
LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")


class LoadError(ValueError):
    """A model could not be loaded; the message says which file and why."""


def check_dtype_device(dtype: torch.dtype, device: str | torch.device) -> torch.device:
    """Raise LoadError unless a small matmul in `dtype` runs on `device`."""
    if not dtype.is_floating_point:
        raise LoadError(f"dtype {dtype} is not a floating-point dtype")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise LoadError(f"bad device {device!r}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise LoadError(f"device {device!r} requested but CUDA is not available")
    try:
        a = torch.ones(4, 8, dtype=dtype, device=dev)
        out = torch.nn.functional.linear(a, torch.ones(3, 8, dtype=dtype, device=dev))
        torch.nn.functional.scaled_dot_product_attention(
            a[None, None], a[None, None], a[None, None]
        )
        ok = bool(torch.isfinite(out.float()).all()) and float(out[0, 0]) == 8.0
    except (RuntimeError, NotImplementedError, TypeError) as e:
        raise LoadError(f"dtype {dtype} cannot run on device {dev}: {e}") from None
    if not ok:
        raise LoadError(f"dtype {dtype} gives wrong matmul results on device {dev}")
    return dev


def _hf_config(model_dir: pathlib.Path, overrides: dict | None) -> ModelConfig:
    path = model_dir / "config.json"
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise LoadError(f"{path} not found") from None
    except (OSError, json.JSONDecodeError) as e:
        raise LoadError(f"{path} is unreadable or not JSON: {e}") from None
    try:
        return from_hf_dict(d, overrides=overrides)
    except (KeyError, TypeError, ValueError) as e:
        raise LoadError(
            f"{path}: {e!s}" if not isinstance(e, KeyError) else f"{path}: missing key {e}"
        ) from None


def _safetensors_files(model_dir: pathlib.Path) -> list[pathlib.Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise LoadError(f"{index} is not a valid safetensors index: {e}") from None
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise LoadError(f"{index} names missing shard(s): {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise LoadError(f"{model_dir} holds no *.safetensors weight file")
    return files


def _iter_safetensors(files: list[pathlib.Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    yield name, st.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise LoadError(f"{f} is corrupt or truncated: {e}") from None


def _count_safetensors(files: list[pathlib.Path]) -> int:
    from safetensors import SafetensorError, safe_open

    n = 0
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                n += len(list(st.keys()))
        except (SafetensorError, OSError, RuntimeError) as e:
            raise LoadError(f"{f} is corrupt or truncated: {e}") from None
    return n


def build_empty_model(
    config: ModelConfig, dtype: torch.dtype, device: torch.device
) -> LlamaForCausalLM:
    """The model with uninitialised parameters of `dtype` on `device`."""
    prev = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype)
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(prev)
    return model.to_empty(device=device).eval().requires_grad_(False)


@torch.no_grad()
def init_dummy_weights(model: LlamaForCausalLM, seed: int) -> None:
    """Seeded random weights: N(0, 0.02) for matrices and biases, 1 + N(0, 0.02) for norms.
    Drawn on the model's device (an 8B model's draw takes a minute on a CPU), so a seed
    gives the same weights on every machine of one device type, not across types."""
    dev = next(model.parameters()).device
    gen = torch.Generator(device=dev).manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        w = torch.randn(p.shape, generator=gen, dtype=torch.float32, device=dev) * 0.02
        if "norm" in name:
            w += 1.0
        p.copy_(w)


def _load_into(
    model: LlamaForCausalLM, weights: Iterator[tuple[str, torch.Tensor]], source: str
) -> None:
    try:
        model.load_weights(weights)
    except LoadError:
        raise
    except ValueError as e:
        raise LoadError(f"{source}: {e}") from None


def load_model(
    model_path: str | None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    load_format: str = "auto",
    seed: int = 0,
    progress: bool = True,
    config_overrides: dict[str, Any] | None = None,
    weight_format: str = "none",
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Load weights and config; see the module docstring. `load_format="dummy"` takes the
    config from model_path (HF dir or GGUF; default model when None) and random weights.
    weight_format "bf16"/"int8"/"int4" repacks the projection weights (models/quant.py);
    "int4" suits Q4 GGUF files best (their groups are kept nearly exactly)."""
    if load_format not in LOAD_FORMATS:
        raise LoadError(f"unknown load format {load_format!r} (one of {LOAD_FORMATS})")
    if weight_format not in WEIGHT_FORMATS:
        raise LoadError(f"unknown weight format {weight_format!r} (one of {WEIGHT_FORMATS})")
    try:
        src = resolve_model(model_path)
    except ModelNotFound as e:
        raise LoadError(str(e)) from None
    dev = check_dtype_device(dtype, device)
    if load_format == "gguf" and src.kind != "gguf":
        raise LoadError(f"load format gguf, but {src.path} is not a .gguf file")
    if load_format == "safetensors" and src.kind != "hf_dir":
        raise LoadError(f"load format safetensors, but {src.path} is not an HF model directory")

    reader = None
    if src.kind == "gguf":
        try:
            reader = loader_gguf.open_reader(src.path)
        except Exception as e:  # gguf raises ValueError/IndexError/struct errors on bad files
            raise LoadError(
                f"{src.path} is not a readable GGUF file (truncated or corrupt?): {e!r}"
            ) from None
        try:
            config = loader_gguf.config_from_reader(reader, config_overrides)
        except (KeyError, TypeError, ValueError) as e:
            raise LoadError(f"{src.path}: {e}") from None
    else:
        config = _hf_config(pathlib.Path(src.path), config_overrides)

    log.info("loading model", path=src.path, format=load_format, family=config.family,
             num_layers=config.num_layers, dtype=str(dtype), device=str(dev))  # fmt: skip
    model = build_empty_model(config, dtype, dev)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    elif src.kind == "gguf":
        bar = tqdm(
            total=len(reader.tensors), desc="loading gguf", unit="tensor", disable=not progress
        )
        _load_into(model, _progress(_guard_gguf(reader, config, src.path), bar), src.path)
    else:
        files = _safetensors_files(pathlib.Path(src.path))
        bar = tqdm(total=_count_safetensors(files), desc="loading safetensors", unit="tensor",
                   disable=not progress)  # fmt: skip
        _load_into(model, _progress(_iter_safetensors(files), bar), src.path)
    try:
        convert_linears(model, weight_format)
    except ValueError as e:
        raise LoadError(str(e)) from None
    return model, config


def _guard_gguf(reader: Any, config: ModelConfig, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        yield from loader_gguf.iter_weights(reader, config)
    except (ValueError, IndexError, TypeError, NotImplementedError) as e:
        raise LoadError(f"{path}: bad tensor data: {e}") from None


def _progress(
    it: Iterator[tuple[str, torch.Tensor]], bar: tqdm
) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        for item in it:
            yield item
            bar.update(1)
    finally:
        bar.close()
