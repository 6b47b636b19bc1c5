"""New weights into a live executor (actors/executor/reload.py): a checkpoint of the same
shape is copied into the model's own tensors; anything else is refused and changes
nothing."""

from __future__ import annotations

import msgspec
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


@pytest.mark.gpu
def test_reloaded_weights_serve_through_the_captured_graphs(tiny_model_dir, tmp_path):
    """On CUDA the decode graphs, captured with the old weights' addresses, compute with
    the new weights after a reload: the same tokens as a core built from them."""
    from tests.actors.executor.test_executor_pipeline import GREEDY, LS, Builder

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    src = tiny_model_dir("llama")
    new = _perturbed_copy(src, tmp_path / "new")

    def tokens(core) -> list[list[int]]:
        b, opens = Builder(core.page_size), [(r, f"r{r}", GREEDY, r) for r in range(2)]
        out = [core.step(b.batch([(r, [5 + r, 6, 7]) for r in range(2)], opens=opens))]
        out += [core.step(b.batch([(0, [LS]), (1, [LS])])) for _ in range(6)]
        assert [r.error for r in out] == [None] * 7
        return [r.token_ids for r in out]

    config = ExecutorConfig(model_path=str(src), device="cuda", dtype="float32",
                            max_total_tokens=256)  # fmt: skip
    core = build_core(config)
    assert core.runner.graphs is not None
    reload_weights(core, config, str(new))
    fresh = build_core(msgspec.structs.replace(config, model_path=str(new)))
    assert tokens(core) == tokens(fresh)


def test_weights_by_hf_name_are_the_checkpoints_own(tiny_model_dir, family):
    """weight_by_hf_name (/get_weights_by_name) gives, for every tensor HF holds, the
    same values: q/k/v and gate/up as views of the fused projections, a tied lm_head as
    the embedding."""
    import transformers

    d = tiny_model_dir(family)
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    model, _ = load_model(str(d), progress=False)
    names = [n for n in hf.state_dict() if "rotary_emb" not in n]
    assert any("q_proj" in n for n in names) and any("up_proj" in n for n in names)
    state = hf.state_dict()
    for name in [*names, "lm_head.weight"]:
        want = state.get(name, hf.lm_head.weight)
        assert torch.equal(model.weight_by_hf_name(name), want), name
    with pytest.raises(KeyError):
        model.weight_by_hf_name("model.layers.0.mlp.nowhere.weight")
