"""New weights into a live executor (actors/executor/reload.py): a checkpoint of the same
shape is copied into the model's own tensors; anything else is refused and changes
nothing."""

from __future__ import annotations

import pytest
import torch

from shunter.actors.executor.build import build_core
from shunter.actors.executor.config import ExecutorConfig
from shunter.actors.executor.loader import LoadError, load_model
from shunter.actors.executor.reload import model_tensors, reload_weights


def _perturbed_copy(src, dst):
    """The checkpoint at src with every weight changed a little, saved at dst."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(src)
    torch.manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(dst, safe_serialization=True)
    return dst


def _snapshot(core) -> dict[str, torch.Tensor]:
    return {k: _dense(v).clone() for k, v in model_tensors(core.runner.model).items()}


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.layout == torch.strided else t.to_dense()


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(_dense(a), _dense(b))


@pytest.mark.parametrize("weight_format", ["none", "int4"])
def test_same_shape_weights_are_copied_in_place(tiny_model_dir, tmp_path, weight_format):
    src = tiny_model_dir("llama")
    new = _perturbed_copy(src, tmp_path / "new")
    config = ExecutorConfig(model_path=str(src), device="cpu", dtype="float32",
                            max_total_tokens=256, weight_format=weight_format)  # fmt: skip
    core = build_core(config)
    before = model_tensors(core.runner.model)
    ptrs = {k: v.data_ptr() for k, v in before.items() if v.layout == torch.strided}
    old = _snapshot(core)
    assert "weight_int4" in "".join(before) or weight_format == "none"
    reload_weights(core, config, str(new))
    after = model_tensors(core.runner.model)
    assert {k: after[k].data_ptr() for k in ptrs} == ptrs  # the same tensors
    want = model_tensors(load_model(str(new), progress=False, weight_format=weight_format)[0])
    assert all(_equal(after[k], want[k]) for k in after)
    assert any(not _equal(after[k], old[k]) for k in after)
    reload_weights(core, config, str(src))  # and back
    assert all(_equal(model_tensors(core.runner.model)[k], old[k]) for k in old)


def test_a_checkpoint_that_does_not_fit_changes_nothing(tiny_model_dir, tmp_path):
    config = ExecutorConfig(model_path=str(tiny_model_dir("llama")), device="cpu",
                            dtype="float32", max_total_tokens=256)  # fmt: skip
    core = build_core(config)
    old = _snapshot(core)
    with pytest.raises(LoadError, match="num_layers is 3"):
        reload_weights(core, config, str(tiny_model_dir("llama_mha_bias")))
    with pytest.raises(LoadError, match="cannot load"):
        reload_weights(core, config, str(tmp_path / "nowhere"))
    with pytest.raises(LoadError, match="not the served model's shape: its rope_theta"):
        reload_weights(core, config, str(tiny_model_dir("llama3_tied_sharded")))
    now = model_tensors(core.runner.model)
    assert all(_equal(now[k], old[k]) for k in old)
