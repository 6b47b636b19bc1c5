"""New weights into the live model (a flip's `UpdateWeights`): load a checkpoint the way
the serving one was loaded, then copy it tensor by tensor into the model's own tensors.

Theory of operation: the checkpoint is loaded on the CPU (in the serving dtype and
weight format, so packed projections are packed the same way), beside the live model
rather than in place of it, so a device holding the model and its KV pool needs no
room for a second copy. Its config must equal the live one in everything but its name
(the KV pool, the rope tables and the captured CUDA graphs all depend on the shapes),
and every tensor it loads must match a live one in name, shape and dtype (the live
model may hold more: caches it built from its config); only then is anything copied,
in place (`copy_`), so the CUDA graphs, which hold the tensors' addresses, stay valid.
A checkpoint that fails any check leaves the served weights as they were.

Invariants: called only while nothing runs (the flip is quiesced, no batch in flight);
the KV cache written with the old weights is dropped by the cache manager before, and
no open row's KV is read again. The tensors of a module are its parameters, its
buffers and any plain tensor attribute (the packed weights of models/quant.py); an
opaque one (oneDNN's prepacked CPU layout, which copy_ cannot write) is replaced.
"""

from __future__ import annotations

import torch
from torch import nn

from shunter.actors.executor.config import ExecutorConfig
from shunter.actors.executor.core import ExecutorCore
from shunter.actors.executor.loader import LoadError, load_model


def _slots(model: nn.Module) -> dict[str, tuple[nn.Module, str, torch.Tensor]]:
    """Every tensor the model computes with, by dotted name, with the module and
    attribute holding it (a tied tensor once)."""
    out: dict[str, tuple[nn.Module, str, torch.Tensor]] = {}
    seen: set[int] = set()
    for prefix, mod in model.named_modules():
        found = {**mod._parameters, **mod._buffers}
        found.update((k, v) for k, v in vars(mod).items() if isinstance(v, torch.Tensor))
        for name, t in found.items():
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                out[f"{prefix}.{name}" if prefix else name] = (mod, name, t)
    return out


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor the model computes with, by dotted name (a tied tensor once)."""
    return {name: t for name, (_, _, t) in _slots(model).items()}


def reload_weights(
    core: ExecutorCore, config: ExecutorConfig, model_path: str, load_format: str = "auto"
) -> str:
    """Load `model_path` and copy its weights into `core`'s model; returns a short
    description. LoadError (nothing changed) when it cannot be loaded or does not fit."""
    runner = core.runner
    try:
        new_model, new_cfg = load_model(
            model_path,
            dtype=runner.dtype,
            device="cpu",
            load_format=load_format,
            seed=config.seed,
            progress=False,
            config_overrides=dict(config.model_overrides) or None,
            weight_format=config.weight_format,
        )
    except (LoadError, OSError, ValueError) as e:
        raise LoadError(f"cannot load {model_path}: {e}") from None
    live_cfg = runner.config
    for field in live_cfg.__struct_fields__:
        if field != "name" and getattr(new_cfg, field) != getattr(live_cfg, field):
            raise LoadError(
                f"{model_path} is not the served model's shape: its {field} is "
                f"{getattr(new_cfg, field)!r}, the served one's {getattr(live_cfg, field)!r}"
            )
    slots, new = _slots(runner.model), model_tensors(new_model)
    live = {name: t for name, (_, _, t) in slots.items()}
    extra = sorted(new.keys() - live.keys())
    if extra:
        raise LoadError(f"{model_path}: {extra[0]} is not in the served model")
    for name, n in new.items():
        t = live[name]
        if n.shape != t.shape or n.dtype != t.dtype:
            raise LoadError(f"{model_path}: {name} is {n.dtype} {tuple(n.shape)}, the served "
                            f"one {t.dtype} {tuple(t.shape)}")  # fmt: skip
    with torch.no_grad():
        for name in new:  # the live model's own caches (rope tables) follow its config
            mod, attr, t = slots[name]
            if t.layout == torch.strided:
                t.copy_(new[name])
            else:  # an opaque prepacked weight (oneDNN's layout, CPU only): replaced
                setattr(mod, attr, new[name])
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return f"{len(new)} tensors of {new_cfg.name or model_path}"
