"""The executor's device memory given up and taken back (actors/executor/memory.py):
after a release and a resume the model decodes as before; the KV cache and (on a GPU)
the weights really leave the device; misuse is refused and changes nothing."""

from __future__ import annotations

import pytest
import torch

from shunter.actors.executor.build import build_core
from shunter.actors.executor.config import ExecutorConfig
from shunter.actors.executor.memory import DeviceMemory
from shunter.actors.executor.reload import model_tensors


def _tokens(core, builder, first_row: int) -> list[list[int]]:
    """Greedy tokens of two fixed prompts on two fresh rows, 6 decode steps."""
    from tests.actors.executor.test_executor_pipeline import GREEDY, LS

    rows = [first_row, first_row + 1]
    opens = [(r, f"r{r}", GREEDY, r) for r in rows]
    out = [core.step(builder.batch([(r, [5 + i, 6, 7]) for i, r in enumerate(rows)], opens=opens))]
    out += [core.step(builder.batch([(r, [LS]) for r in rows])) for _ in range(6)]
    assert [r.error for r in out] == [None] * 7
    return [r.token_ids for r in out]


def _core(tiny_model_dir, device: str):
    config = ExecutorConfig(model_path=str(tiny_model_dir("llama")), device=device,
                            dtype="float32", max_total_tokens=256)  # fmt: skip
    return build_core(config)


def test_release_and_resume_decode_as_before(tiny_model_dir):
    from tests.actors.executor.test_executor_pipeline import Builder

    core = _core(tiny_model_dir, "cpu")
    b = Builder(core.page_size)
    want = _tokens(core, b, 0)
    weights = {k: v.clone() for k, v in model_tensors(core.runner.model).items()}
    mem = DeviceMemory(core)
    assert "released" in mem.release(["kv_cache"])
    assert core.runner.kv_pool.released and mem.released == {"kv_cache"}
    assert all(k.numel() == 0 for k in core.runner.kv_pool.k_buffers)
    mem.release(["weights", "cuda_graph"])
    live = model_tensors(core.runner.model)
    assert all(t.numel() == 0 for t in live.values())  # every tensor object kept, empty
    mem.resume(["weights"])  # the weights back first, as a trainer syncing them does
    assert all(torch.equal(live[k], weights[k]) for k in weights)
    mem.resume(["kv_cache", "cuda_graph"])
    assert not mem.released and not core.runner.kv_pool.released
    assert all(k.abs().sum() == 0 for k in core.runner.kv_pool.k_buffers)  # a new, empty cache
    assert _tokens(core, b, 2) == want


def test_misuse_is_refused_and_changes_nothing(tiny_model_dir):
    core = _core(tiny_model_dir, "cpu")
    mem = DeviceMemory(core)
    for tags, why in [(["disk"], "tags must be"), ([], "tags must be")]:
        with pytest.raises(ValueError, match=why):
            mem.release(tags)
    with pytest.raises(ValueError, match="not released"):
        mem.resume(["weights"])
    mem.release(["kv_cache"])
    with pytest.raises(ValueError, match=r"\['kv_cache'\] released already"):
        mem.release(["weights", "kv_cache"])
    assert mem.released == {"kv_cache"} and all(t.numel() for t in model_tensors(
        core.runner.model).values())  # fmt: skip
    mem.resume(["kv_cache"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_memory_leaves_and_the_graphs_come_back(tiny_model_dir):
    from tests.actors.executor.test_executor_pipeline import Builder

    core = _core(tiny_model_dir, "cuda")
    b = Builder(core.page_size)
    assert core.runner.graphs is not None and core.runner.graphs.captured
    want = _tokens(core, b, 0)
    before = torch.cuda.memory_allocated()
    weight_bytes = sum(t.nbytes for t in model_tensors(core.runner.model).values())
    kv_bytes = core.runner.kv_pool.k_all.nbytes * 2
    mem = DeviceMemory(core)
    for cycle in range(2):  # the second reuses the first's pinned host buffers
        mem.release(["weights", "kv_cache", "cuda_graph"])
        assert before - torch.cuda.memory_allocated() >= weight_bytes + kv_bytes
        assert not core.runner.graphs.captured
        assert "captured again" in mem.resume(["weights", "kv_cache", "cuda_graph"])
        replays = core.runner.graphs.num_replays
        assert _tokens(core, b, 2 + 2 * cycle) == want
        assert core.runner.graphs.num_replays > replays  # decoded through the new graphs
        # nothing stays behind from a cycle (a capture stream's cuBLAS workspace did)
        assert torch.cuda.memory_allocated() <= before + (1 << 20)
