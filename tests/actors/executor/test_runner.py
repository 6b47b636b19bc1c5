"""The runner on the default model: greedy parity with the reference ids over paged
KV (page sizes 1 and 16), and bad input rejected before the pool is touched."""

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
    ]
    for change in bad:
        with pytest.raises(ValueError):
            runner16.forward(ForwardInput(**{**good, **change}))
    assert torch.equal(pool.k_all, before)
    assert runner16.forward(ForwardInput(**good)).shape == (1, 49152)
    stats = runner16.statistics()
    assert stats.num_forwards >= 1 and stats.num_logits >= 1
