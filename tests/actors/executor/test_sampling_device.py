"""sample_on_device / sample_results: the split of `sample` into the device launch and
the host read, and (on a GPU) the same tokens from CUDA logits as from CPU logits."""

from __future__ import annotations

import math

import pytest
import torch

from shunter.actors.executor.sampling import (
    RowSampling,
    sample,
    sample_on_device,
    sample_results,
)
from shunter.bus.messages import SamplingParams

V = 300

# Every path: greedy, vocabulary order with top-k / min-p, both top-p ways, penalties,
# bias, min_new_tokens, logprobs and top logprobs.
MIXED = [
    dict(temperature=0.0),
    dict(temperature=0.0, return_logprob=True, top_logprobs_num=3, repetition_penalty=1.3),
    dict(temperature=0.8, top_k=20),
    dict(temperature=0.9, min_p=0.05, frequency_penalty=0.4, presence_penalty=0.2),
    dict(temperature=1.0, top_p=0.9, return_logprob=True),
    dict(temperature=1.1, top_p=0.5, top_k=40, top_logprobs_num=5, token_ids_logprob=[4, 1]),
    dict(temperature=0.7, logit_bias={3: 2.0, 7: -math.inf}, min_new_tokens=4,
         stop_token_ids=[5]),
]  # fmt: skip


def _rows(seed_base: int = 100) -> list[RowSampling]:
    rows = [RowSampling(SamplingParams(**p), seed_base + i, (2,)) for i, p in enumerate(MIXED)]
    for r in rows:
        r.observe_prompt([1, 4, 9, 16])
        r.observe_output(9)
    return rows


def _logits(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randn(len(MIXED), V, generator=g) * 3.0


def _run(device: str, num_steps: int = 6):
    rows, out = _rows(), []
    for step in range(num_steps):
        ds = sample_on_device(_logits(step).to(device), rows)
        assert ds.tokens.device.type == torch.device(device).type
        host = ds.to_host(non_blocking=device != "cpu")
        if device != "cpu":
            torch.cuda.synchronize()  # the pinned copies are valid from here
        res = sample_results(host, rows)
        for r, t in zip(rows, res.token_ids):
            r.observe_output(t)
        out.append(res)
    return out


def test_split_equals_sample_on_the_cpu():
    a_rows, b_rows = _rows(), _rows()
    for step in range(6):
        x = _logits(step)
        whole = sample(x, a_rows)
        split = sample_results(sample_on_device(x, b_rows).to_host(non_blocking=False), b_rows)
        assert whole.token_ids == split.token_ids
        assert whole.top_logprobs == split.top_logprobs
        assert [round(v, 6) for v in whole.logprobs if not math.isnan(v)] == [
            round(v, 6) for v in split.logprobs if not math.isnan(v)
        ]
        for ra, rb, t in zip(a_rows, b_rows, whole.token_ids):
            ra.observe_output(t)
            rb.observe_output(t)


def test_greedy_only_has_no_logprob_tensors():
    rows = [RowSampling(SamplingParams(temperature=0.0), 0) for _ in range(3)]
    ds = sample_on_device(_logits(0)[:3], rows)
    assert ds.chosen is None and ds.top_vals is None and ds.asked == []
    assert sample_results(ds, rows).token_ids == _logits(0)[:3].argmax(-1).tolist()


@pytest.mark.gpu
def test_cuda_logits_sample_the_same_tokens_as_cpu_logits():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cpu, gpu = _run("cpu"), _run("cuda")
    assert [r.token_ids for r in gpu] == [r.token_ids for r in cpu]
    for a, b in zip(cpu, gpu):
        assert [[t for t, _ in top] for top in a.top_logprobs] == [
            [t for t, _ in top] for top in b.top_logprobs
        ]
        for x, y in zip(a.logprobs, b.logprobs):
            assert (math.isnan(x) and math.isnan(y)) or abs(x - y) < 1e-4


@pytest.mark.gpu
def test_cuda_sampling_never_waits_for_the_device():
    """Every path of MIXED launches without a device sync (torch's sync debug mode
    raises on one), so a step's sample never stalls the next step's launch."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    rows = _rows()
    x = _logits(0).cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ds = sample_on_device(x, rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert ds.tokens.shape == (len(MIXED),)
