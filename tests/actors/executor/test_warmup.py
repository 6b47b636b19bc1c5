"""The warm-up script (warmup.py): each attention path once, on distinct pages, rows
closed at the end; nothing when the pool or the context is too small; on a CUDA
build, every flashinfer mode planned before the core is handed over (or none, with
skip_server_warmup). Running it on a real CPU core is in test_executor_core.py."""

from __future__ import annotations

import json

import pytest
import torch

from shunter.actors.executor.core_plan import Geometry
from shunter.actors.executor.warmup import EXTEND, LONG, PROMPT, warmup_batches
from shunter.bus.messages import LAST_SAMPLED


def _modes(batches) -> list[str]:
    """The runner's attention mode of each batch with entries (runner.py's rule)."""
    out = []
    for b in batches:
        if not b.rows:
            continue
        lens = [s + n for s, n in zip(b.start_pos, b.num_new_tokens, strict=True)]
        if all(n == 1 for n in b.num_new_tokens):
            out.append("decode")
        elif list(b.num_new_tokens) == lens:
            out.append("prefill")
        else:
            out.append("extend")
    return out


@pytest.mark.parametrize("page_size", [1, 16])
def test_steps_take_every_attention_path_on_distinct_pages(page_size):
    bs = warmup_batches(Geometry(page_size, 1000, 256, 4096, 8, ()))
    assert _modes(bs) == ["prefill", "extend", "extend", "decode"]
    # row 0's prompt past the split kernels' bounds: more than 64 new tokens, more
    # than 256 keys for its decodes and its extend
    assert bs[0].num_new_tokens == [LONG] and LONG > 256
    mixed = bs[1]  # a fresh prompt beside a decode: what a lightly loaded server runs
    assert mixed.rows == [1, 0] and mixed.num_new_tokens == [PROMPT, 1]
    assert mixed.start_pos == [0, LONG] and mixed.input_ids[-1] == LAST_SAMPLED
    # row 0's extend over its long prefix beside row 1's short decode
    assert bs[2].rows == [0, 1] and bs[2].num_new_tokens == [EXTEND, 1]
    assert bs[2].start_pos == [LONG + 1, PROMPT]
    pages = [p for b in bs for p in b.new_pages]
    assert len(pages) == len(set(pages)) and max(pages) < 1000
    assert [len(b.opens) for b in bs] == [1, 1, 0, 0, 0]
    assert bs[-1].closes == [0, 1] and not bs[-1].rows
    ids = [t for b in bs for t in b.input_ids if t != LAST_SAMPLED]
    assert min(ids) >= 1 and max(ids) < 256


def test_one_row_and_too_small_pools_or_contexts():
    one = warmup_batches(Geometry(16, 1000, 256, 4096, 1, ()))
    assert _modes(one) == ["prefill", "decode", "extend", "decode"]
    assert one[-1].closes == [0] and all(r == 0 for b in one for r in b.rows)
    # a pool or a context short of LONG: row 0's prompt takes what there is
    assert warmup_batches(Geometry(16, 8, 256, 4096, 8, ()))[0].num_new_tokens == [90]
    assert warmup_batches(Geometry(1, 1000, 256, 100, 8, ()))[0].num_new_tokens == [94]
    # fewer pages than its tokens; a context shorter than its prompt
    assert warmup_batches(Geometry(1, 10, 256, 4096, 8, ())) == []
    assert warmup_batches(Geometry(16, 1000, 256, 8, 8, ())) == []


@pytest.mark.gpu
@pytest.mark.parametrize("skip", [False, True], ids=["warm", "skip_server_warmup"])
def test_cuda_build_plans_every_flashinfer_mode(tmp_path, monkeypatch, skip):
    """build_core on CUDA with flashinfer runs the warm-up (so prefill, extend and
    decode wrappers are built before Ready) unless skip_server_warmup, and hands over a
    core with no row open and zeroed counters."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("flashinfer")
    from shunter.actors.executor.build import build_core
    from shunter.actors.executor.config import ExecutorConfig
    from shunter.kernels import attention_flashinfer as afi
    from shunter.ops.bench_gpu_model import TINY_LLAMA

    planned = []
    for name in ("plan_prefill", "plan_extend", "plan_decode"):
        orig = getattr(afi.FlashInferAttention, name)

        def spy(self, *a, _orig=orig, _name=name, **kw):
            planned.append(_name)
            return _orig(self, *a, **kw)

        monkeypatch.setattr(afi.FlashInferAttention, name, spy)
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    cfg = ExecutorConfig(model_path=str(tmp_path), load_format="dummy", device="cuda",
                         dtype="bfloat16", attention_backend="flashinfer",
                         decode_attention_backend="flashinfer", disable_cuda_graph=True,
                         max_total_tokens=512, max_num_rows=4, page_size=16,
                         load_progress=False, skip_server_warmup=skip)  # fmt: skip
    core = build_core(cfg)
    if skip:
        assert planned == []
    else:
        assert {"plan_prefill", "plan_extend", "plan_decode"} <= set(planned), planned
    assert core.open_rows() == {} and core.statistics().num_steps == 0
