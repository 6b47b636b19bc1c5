"""The runner's piecewise-graph path (prefill, extend and mixed steps) against the plain
runner.

On the CPU the pieces run eagerly (`capture=False`) over the same padded [3, bucket]
input blocks, shared buffers and padding slot that a CUDA replay reads, with each
layer's attention run between them on the step's own context. Scripted runs (padded
prefills, decode steps, a row opened on a cached prefix, mixed decode + extend steps,
a step too large for any bucket) must give the logits of a runner that runs the model
whole, and write K/V only to the slots handed out and the padding slot. Float32;
tolerance 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from shunter.actors.executor.build import piecewise_max_tokens
from shunter.actors.executor.config import DEFAULT_PIECEWISE_MAX_TOKENS, ExecutorConfig
from shunter.actors.executor.kv_pool import KVPool
from shunter.actors.executor.loader import load_model
from shunter.actors.executor.piecewise_graph import capture_sizes
from shunter.actors.executor.runner import ModelRunner
from tests.actors.executor.test_graph_path import Script


def _runners(tiny_model_dir, name: str, page_size: int, **kw):
    model, config = load_model(str(tiny_model_dir(name)), progress=False)
    plain = ModelRunner(model, KVPool(config, 64, page_size=page_size))
    piecewise = ModelRunner(
        model, KVPool(config, 64, page_size=page_size, pad_page=True), attention_backend="torch",
        max_num_rows=8, max_context_len=128, slot_table=True, capture=False, **kw,
    )  # fmt: skip
    return plain, piecewise


@pytest.mark.parametrize(("name", "page_size"),
                         [("llama", 1), ("mistral_window", 4), ("qwen3_qknorm", 1)])  # fmt: skip
def test_piecewise_path_matches_the_plain_runner(tiny_model_dir, name, page_size):
    plain, pw = _runners(tiny_model_dir, name, page_size, piecewise_max_tokens=16,
                         piecewise_sizes=(4, 8))  # fmt: skip
    assert pw.piecewise is not None and pw.graphs is None
    assert pw.piecewise.sizes == [4, 8, 16]
    s = Script(page_size)
    steps = [[(3, 5), (0, 9)]]  # 14 tokens: bucket 16, two rows padded
    steps += [[(3, 1), (0, 1)]] * 2  # all decode, no decode graphs: bucket 4
    steps.append("share")  # row 5 opens on row 0's first page(s)
    steps.append([(3, 1), (0, 3), (5, 2)])  # mixed: decode + extends over a cached prefix
    steps.append([(1, 20)])  # 20 tokens: above every bucket, eager
    steps += [[(5, 1), (3, 1), (0, 1), (1, 1)]] * 2 + [[(0, 8)]]  # 8: a bucket exactly
    replays = 0
    for entries in steps:
        if entries == "share":
            s.share(5, 0, 4)
            continue
        inp = s.step(entries)
        torch.testing.assert_close(pw.forward(inp), plain.forward(inp), atol=1e-5, rtol=1e-5)
        replays += sum(n for _, n in entries) <= 16
    assert pw.piecewise.num_replays == replays == 7
    # the padding slot absorbed the padded rows' K/V; no handed-out slot was touched
    idx = torch.tensor(sorted({t for row in s.slots.values() for t in row}))
    for k_p, k_g in zip(plain.kv_pool.k_buffers, pw.kv_pool.k_buffers, strict=True):
        torch.testing.assert_close(k_g[idx], k_p[idx], atol=1e-5, rtol=1e-5)
    for v_p, v_g in zip(plain.kv_pool.v_buffers, pw.kv_pool.v_buffers, strict=True):
        torch.testing.assert_close(v_g[idx], v_p[idx], atol=1e-5, rtol=1e-5)


def test_decode_graphs_take_small_decode_steps_and_the_pieces_the_rest(tiny_model_dir):
    plain, pw = _runners(tiny_model_dir, "llama", 1, cuda_graph_max_bs=2,
                         piecewise_max_tokens=8)  # fmt: skip
    assert pw.graph_sets == [pw.graphs, pw.piecewise]
    s = Script(1)
    for entries in (
        [(0, 6)],
        [(0, 1)],
        [(0, 1), (1, 3)],
        [(0, 1), (1, 1)],
        [(0, 1), (1, 1), (2, 1)],
    ):
        inp = s.step(entries)
        torch.testing.assert_close(pw.forward(inp), plain.forward(inp), atol=1e-5, rtol=1e-5)
    assert pw.graphs.num_replays == 2  # the one- and two-entry decode steps
    assert pw.piecewise.num_replays == 3  # the prefill, the mixed step, three decodes


def test_logits_of_every_token_come_from_the_pieces_too(tiny_model_dir):
    """A step asking for every new token's logits (prompt logprobs) reads all n rows."""
    plain, pw = _runners(tiny_model_dir, "llama", 1, piecewise_max_tokens=16)
    inp = Script(1).step([(0, 7), (1, 3)])
    inp = type(inp)(**{**inp.__dict__, "logits_indices": torch.arange(10)})
    torch.testing.assert_close(pw.forward(inp), plain.forward(inp), atol=1e-5, rtol=1e-5)
    assert pw.piecewise.num_replays == 1


def test_piecewise_capture_sizes():
    assert capture_sizes(4) == [4]
    assert capture_sizes(30) == [4, 8, 12, 16, 20, 24, 28, 30]
    assert capture_sizes(512)[-3:] == [448, 480, 512]
    assert capture_sizes(16, [64, 2, 8]) == [2, 8, 16]
    for bad in ((0, None), (8, []), (8, [0, 4])):
        with pytest.raises(ValueError):
            capture_sizes(*bad)


def test_which_steps_are_captured_piecewise():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    on = ExecutorConfig(piecewise_cuda_graph=True)
    assert piecewise_max_tokens(on, cuda) == DEFAULT_PIECEWISE_MAX_TOKENS
    assert piecewise_max_tokens(ExecutorConfig(), cuda) is None  # off unless asked for
    assert piecewise_max_tokens(on, cpu) is None
    cfg = ExecutorConfig(piecewise_cuda_graph=True, disable_cuda_graph=True)
    assert piecewise_max_tokens(cfg, cuda) is None
    cfg = ExecutorConfig(piecewise_cuda_graph=True, piecewise_cuda_graph_max_tokens=2048)
    assert piecewise_max_tokens(cfg, cuda) == 2048
    cfg = ExecutorConfig(piecewise_cuda_graph=True, piecewise_cuda_graph_tokens=(16, 64))
    assert piecewise_max_tokens(cfg, cuda) == 64
    for bad in (dict(piecewise_cuda_graph_max_tokens=0), dict(piecewise_cuda_graph_tokens=())):
        with pytest.raises(ValueError, match="piecewise_cuda_graph"):
            ExecutorConfig(**bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_captured_pieces_match_the_eager_runner_on_cuda(tiny_model_dir, dtype, tol):
    """The same steps through captured pieces and through the eager model, on CUDA
    (Triton attention: the tiny model's 16-wide heads are below flashinfer's sizes)."""
    backend = "triton"
    model, config = load_model(str(tiny_model_dir("llama")), dtype=dtype, device="cuda",
                               progress=False)  # fmt: skip

    def runner(**kw) -> ModelRunner:
        pool = KVPool(config, 256, dtype=dtype, device="cuda", pad_page=True)
        return ModelRunner(model, pool, attention_backend=backend, max_num_rows=8,
                           max_context_len=256, **kw)  # fmt: skip

    eager, pw = runner(), runner(piecewise_max_tokens=64)
    assert pw.piecewise is not None and pw.piecewise.capture and pw.piecewise.captured
    s = Script(1)
    steps = [[(0, 40), (1, 9)], [(0, 1), (1, 1)], "share", [(2, 3), (0, 1), (1, 60)],
             [(2, 1), (0, 1), (1, 1)], [(3, 100)], [(3, 5)]]  # fmt: skip
    for entries in steps:
        if entries == "share":
            s.share(2, 0, 32)
            continue
        inp = s.step(entries)
        want = eager.forward(inp).float()
        got = pw.forward(inp).float()
        torch.testing.assert_close(got, want, atol=tol * want.abs().max().item(), rtol=tol)
    assert pw.piecewise.num_replays == 5  # every step but the 100-token one
