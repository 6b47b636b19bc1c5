"""The runner on the default model: greedy parity with the reference ids over paged
KV (page sizes 1 and 16), and bad input rejected before the pool is touched. On CUDA
(`gpu` tests): every tiny family through the runner on the GPU (the Triton kernels)
against the same weights on the CPU (the torch path), in float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from shunter.actors.executor.kv_pool import KVPool
from shunter.actors.executor.runner import ForwardInput, ModelRunner


@pytest.fixture(scope="module")
def runner16(default_model):
    model, config = default_model
    return ModelRunner(model, KVPool(config, 64, page_size=16))


def _check(runner, reference, names, greedy, batched=False):
    prompts = [p for p in reference["prompts"] if p["name"] in names]
    ins = [p["input_ids"] for p in prompts]
    limits = [len(p["output_ids"]) for p in prompts]
    eos = reference["eos_token_id"]
    if batched:
        got = greedy(runner, ins, limits, eos_token_id=eos).tokens
    else:
        got = [greedy(runner, [i], [m], eos_token_id=eos).tokens[0] for i, m in zip(ins, limits)]
    for p, tokens in zip(prompts, got):
        assert tokens == p["output_ids"], p["name"]


def test_reference_prompt_page_size_16(runner16, reference, greedy):
    _check(runner16, reference, ["capital"], greedy)


def test_reference_prompt_page_size_1(default_model, reference, greedy):
    model, config = default_model
    _check(ModelRunner(model, KVPool(config, 200, page_size=1)), reference, ["capital"], greedy)


@pytest.mark.heavy
@pytest.mark.parametrize("page_size", [1, 16])
def test_all_reference_prompts(default_model, reference, greedy, page_size):
    model, config = default_model
    runner = ModelRunner(model, KVPool(config, 4096 // page_size, page_size=page_size))
    names = [p["name"] for p in reference["prompts"]]
    _check(runner, reference, names, greedy)
    _check(runner, reference, names, greedy, batched=True)


def test_bad_input_is_rejected_before_writing(runner16):
    pool = runner16.kv_pool
    before = pool.k_all.clone()
    good = dict(input_ids=torch.tensor([5, 6]), positions=torch.tensor([0, 1]), num_new_tokens=[2],
                seq_lens=[2], slot_tables=[torch.tensor([3, 4])], logits_indices=torch.tensor([1]))  # fmt: skip
    bad = [
        dict(num_new_tokens=[3], seq_lens=[3], slot_tables=[torch.tensor([3, 4, 5])]),
        dict(slot_tables=[torch.tensor([3])]),
        dict(slot_tables=[torch.tensor([3, pool.num_slots])]),
        dict(input_ids=torch.tensor([5, 49152])),
        dict(logits_indices=torch.tensor([2])),
        dict(num_new_tokens=[], seq_lens=[], slot_tables=[]),
        dict(seq_lens=[1]),
        dict(positions=torch.tensor([1, 2])),
        dict(positions=torch.tensor([-1, 1])),
        dict(positions=torch.tensor([5, 1])),
    ]
    for change in bad:
        with pytest.raises(ValueError):
            runner16.forward(ForwardInput(**{**good, **change}))
    assert torch.equal(pool.k_all, before)
    assert runner16.forward(ForwardInput(**good)).shape == (1, 49152)
    stats = runner16.statistics()
    assert stats.num_forwards >= 1 and stats.num_logits >= 1


def _load_tiny(path, dtype: torch.dtype, device: str):
    """Our model from a saved tiny HF checkpoint, without the loader (the GPU machine
    lacks its logging dependency): config.json + every safetensors shard."""
    import json

    from safetensors.torch import load_file

    from shunter.actors.executor.models.config import from_hf_dict
    from shunter.actors.executor.models.llama import LlamaForCausalLM

    config = from_hf_dict(json.loads((path / "config.json").read_text()))
    prev = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype)
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(prev)
    model = model.to_empty(device=device).eval().requires_grad_(False)
    shards = sorted(path.glob("*.safetensors"))
    model.load_weights((n, t) for shard in shards for n, t in load_file(shard).items())
    return model, config


# prompt lengths: 2 (its two prefill chunks are single tokens, so they ride the decode
# path next to the extends), 9 and 23 (beyond mistral's window of 7, in two chunks)
_PROMPT_LENS = (2, 9, 23)
# bfloat16 on the GPU against float32 on the CPU: max |d logprob| (measured 0.07 to 0.09
# on the CPU's own bfloat16 path of these models)
_BF16_LOGPROB_TOL = 0.3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_runner_matches_cpu(family, tiny_model_dir, greedy, dtype):
    path = tiny_model_dir(family)
    cpu_model, config = _load_tiny(path, torch.float32, "cpu")
    gpu_model, _ = _load_tiny(path, dtype, "cuda")
    gen = torch.Generator().manual_seed(7)
    prompts = [
        torch.randint(3, config.vocab_size, (n,), generator=gen).tolist() for n in _PROMPT_LENS
    ]
    runs = []
    for model, dev, dt in ((cpu_model, "cpu", torch.float32), (gpu_model, "cuda", dtype)):
        pool = KVPool(config, 24, page_size=4, dtype=dt, device=dev)
        runs.append(greedy(ModelRunner(model, pool), prompts, 12, prefill_chunks=2))
    want, got = runs
    diff, flips = _compare(want, got)
    if dtype == torch.float32:
        assert got.tokens == want.tokens
        assert diff < 5e-4, diff
    else:
        assert diff < _BF16_LOGPROB_TOL, diff
        # a flip only where the CPU's own top two were within the bfloat16 noise
        assert all(margin <= 2 * _BF16_LOGPROB_TOL for margin in flips), flips


def _compare(want, got) -> tuple[float, list[float]]:
    """(max |d logprob| over the steps where both saw the same context, the CPU's
    top-2 logprob margin at each step whose argmax differs)."""
    diff, flips = 0.0, []
    for wt, gt, wl, gl in zip(want.tokens, got.tokens, want.logprobs, got.logprobs, strict=True):
        for i, (w, g) in enumerate(zip(wl, gl, strict=True)):
            if wt[:i] != gt[:i]:
                break  # contexts differ from here on
            diff = max(diff, float((g.cpu() - w).abs().max()))
            if wt[i] != gt[i]:
                top2 = w.topk(2).values
                flips.append(float(top2[0] - top2[1]))
    return diff, flips
