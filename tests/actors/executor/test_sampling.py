"""Sampling: seeded reproducibility, truncation masks against a plain reference,
penalties on hand-built logits, raw logprobs, parameter validation."""

from __future__ import annotations

import math

import pytest
import torch

from shunter.actors.executor import sampling
from shunter.actors.executor.penalties import apply_penalties
from shunter.actors.executor.sampling import (
    RowSampling,
    sample,
    truncate_probs,
    validate_params,
)
from shunter.bus.messages import SamplingParams

V = 64


def _row(seed=0, eos=(), **kw) -> RowSampling:
    return RowSampling(SamplingParams(**kw), seed, eos)


def _run(rows, logits_per_step):
    """Sample len(logits_per_step) steps for rows; returns per-row token lists."""
    out = [[] for _ in rows]
    for logits in logits_per_step:
        res = sample(logits, rows)
        for i, (row, t) in enumerate(zip(rows, res.token_ids)):
            row.observe_output(t)
            out[i].append(t)
    return out


def test_greedy_is_argmax_and_draws_nothing():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, V, generator=g)
    rows = [_row(temperature=0.0) for _ in range(5)]
    res = sample(logits, rows)
    assert res.token_ids == logits.argmax(-1).tolist()
    assert all(r.generator is None for r in rows)
    assert res.logprobs == [] and res.top_logprobs == []


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1.0),
        dict(temperature=0.8, top_k=10),
        dict(temperature=1.3, top_p=0.7),
        dict(temperature=0.9, top_p=0.9, top_k=20, min_p=0.02, repetition_penalty=1.2),
        dict(temperature=1.0, frequency_penalty=0.5, presence_penalty=0.3, logit_bias={3: 2.0}),
    ],
)
def test_seeded_rows_reproduce_regardless_of_batch(params):
    g = torch.Generator().manual_seed(7)
    num_steps = 12
    target_logits = [torch.randn(1, V, generator=g) for _ in range(num_steps)]

    alone = _run([_row(seed=1234, **params)], target_logits)[0]
    again = _run([_row(seed=1234, **params)], target_logits)[0]
    assert alone == again

    # Same row in a batch with differently configured neighbours, at another position.
    neighbours = [
        dict(temperature=0.0),
        dict(temperature=0.5, top_p=0.5),
        dict(temperature=2.0, top_k=3, min_p=0.1),
    ]
    rows = [_row(seed=99 + i, **p) for i, p in enumerate(neighbours)]
    rows.insert(2, _row(seed=1234, **params))
    batched_logits = []
    for t in target_logits:
        other = torch.randn(len(rows), V, generator=g)
        other[2] = t[0]
        batched_logits.append(other)
    batched = _run(rows, batched_logits)[2]
    assert batched == alone

    other_seed = _run([_row(seed=4321, **params)], target_logits)[0]
    assert other_seed != alone  # 12 draws from broad distributions: a collision is ~impossible


def _reference_keep(probs: list[float], top_k: int, top_p: float, min_p: float) -> set[int]:
    """Tokens kept by top-k, top-p and min-p, all judged on the same probabilities."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    keep = set(range(len(probs)))
    if top_k > 0:
        kth = probs[order[min(top_k, len(probs)) - 1]]
        keep &= {i for i in range(len(probs)) if probs[i] >= kth}
    mass, in_p = 0.0, set()
    for i in order:
        if mass > top_p:
            break
        in_p.add(i)
        mass += probs[i]
    keep &= in_p
    top = max(probs)
    keep &= {i for i in range(len(probs)) if probs[i] >= top * min_p}
    return keep


@pytest.mark.parametrize("sorted_path", [False, True])
def test_truncation_masks_match_reference(sorted_path):
    g = torch.Generator().manual_seed(3)
    num_rows = 40
    probs = torch.softmax(torch.randn(num_rows, V, dtype=torch.float64, generator=g) * 2, -1)
    top_k = torch.randint(-1, 20, (num_rows,), generator=g)
    top_p = torch.rand(num_rows, generator=g, dtype=torch.float64) * 0.9 + 0.1
    if not sorted_path:
        top_p = torch.ones(num_rows, dtype=torch.float64)
    min_p = torch.where(
        torch.rand(num_rows, generator=g) < 0.5,
        torch.zeros(num_rows, dtype=torch.float64),
        torch.rand(num_rows, generator=g, dtype=torch.float64) * 0.3,
    )
    k_arg = torch.where(top_k > 0, top_k, torch.full_like(top_k, V))
    if sorted_path:
        sp, order = probs.sort(-1, descending=True)
        kept_sorted = truncate_probs(sp, k_arg, top_p, min_p)
        kept = torch.zeros_like(probs).scatter(1, order, kept_sorted)
    else:
        kept = truncate_probs(probs, k_arg, None, min_p)
    for i in range(num_rows):
        want = _reference_keep(probs[i].tolist(), int(top_k[i]), float(top_p[i]), float(min_p[i]))
        got = set(kept[i].nonzero().squeeze(1).tolist())
        assert got == want, (i, int(top_k[i]), float(top_p[i]), float(min_p[i]))
        # Kept tokens keep their probability untouched.
        idx = torch.tensor(sorted(want))
        assert torch.equal(kept[i, idx], probs[i, idx])


def test_sampled_frequencies_follow_truncated_distribution():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -3.0])
    params = dict(temperature=0.7, top_k=4, top_p=0.9, min_p=0.05)
    num_rows = 4000
    rows = [_row(seed=s, **params) for s in range(num_rows)]
    res = sample(logits.expand(num_rows, -1).contiguous(), rows)
    counts = torch.bincount(torch.tensor(res.token_ids), minlength=6).double() / num_rows
    probs = torch.softmax(logits.double() / 0.7, -1).tolist()
    keep = _reference_keep(probs, 4, 0.9, 0.05)
    assert keep == {0, 1, 2}
    expected = torch.tensor([probs[i] if i in keep else 0.0 for i in range(6)], dtype=torch.float64)
    expected /= expected.sum()
    assert counts[3:].sum() == 0  # masked tokens never appear
    assert torch.allclose(counts, expected, atol=0.03), (counts, expected)


def test_repetition_penalty_hf_semantics():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    row = _row(temperature=0.0, repetition_penalty=2.0)
    row.observe_prompt([0, 1, 1])
    row.observe_output(3)
    x = apply_penalties(logits.clone(), [row])
    assert x.tolist() == [[1.0, -2.0, 0.5, 1.5, -2.0]]
    assert sample(logits, [row]).token_ids == [3]
    row2 = _row(temperature=0.0, repetition_penalty=3.0)
    row2.observe_output(3)
    assert sample(logits, [row2]).token_ids == [0]  # 3 -> 1.0 < 2.0


def test_frequency_and_presence_penalties_over_output_only():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    row = _row(temperature=0.0, frequency_penalty=0.5, presence_penalty=1.0)
    row.observe_prompt([0])  # prompt tokens are not penalized by these
    for t in (3, 3, 2):
        row.observe_output(t)
    x = apply_penalties(logits.clone(), [row])
    # 3: 3 - (0.5*2 + 1) = 1; 2: 0.5 - (0.5 + 1) = -1
    assert x.tolist() == [[2.0, -1.0, -1.0, 1.0, -2.0]]
    assert sample(logits, [row]).token_ids == [0]


def test_logit_bias_and_min_new_tokens():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    biased = _row(temperature=0.0, logit_bias={4: 10.0, 3: -0.5})
    assert apply_penalties(logits.clone(), [biased]).tolist() == [[2.0, -1.0, 0.5, 2.5, 8.0]]
    assert sample(logits, [biased]).token_ids == [4]

    row = _row(eos=(3,), temperature=0.0, min_new_tokens=2, stop_token_ids=[0])
    assert sample(logits, [row]).token_ids == [2]  # eos 3 and stop id 0 masked
    row.observe_output(2)
    assert sample(logits, [row]).token_ids == [2]
    row.observe_output(2)
    assert sample(logits, [row]).token_ids == [3]  # two tokens exist: eos allowed


def test_penalties_batched_match_alone():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, V, generator=g)

    def rows():
        a = _row(temperature=0.0, repetition_penalty=1.5)
        a.observe_prompt([1, 2, 3])
        b = _row(temperature=0.0)
        c = _row(temperature=0.0, frequency_penalty=1.0, logit_bias={7: 1.0})
        c.observe_output(5)
        return [a, b, c]

    batched = apply_penalties(logits.clone(), rows())
    for i, r in enumerate(rows()):
        alone = apply_penalties(logits[i : i + 1].clone(), [r])
        assert torch.equal(batched[i : i + 1], alone)


def test_logprobs_are_raw_model_logprobs():
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(3, V, generator=g)
    rows = [
        _row(seed=1, temperature=1.5, return_logprob=True, repetition_penalty=1.3),
        _row(temperature=0.0),
        _row(seed=2, temperature=0.0, top_logprobs_num=4, logit_bias={0: 50.0}),
    ]
    rows[0].observe_prompt(range(10))
    res = sample(logits, rows)
    lp = torch.log_softmax(logits, -1)
    assert res.token_ids[2] == 0  # the bias decides the token, not the logprob
    assert res.logprobs[0] == pytest.approx(lp[0, res.token_ids[0]].item(), abs=1e-6)
    assert math.isnan(res.logprobs[1])
    assert res.logprobs[2] == pytest.approx(lp[2, 0].item(), abs=1e-6)
    assert res.top_logprobs[0] == [] and res.top_logprobs[1] == []
    top = res.top_logprobs[2]
    want = lp[2].topk(4)
    assert [t for t, _ in top] == want.indices.tolist()
    assert [v for _, v in top] == pytest.approx(want.values.tolist(), abs=1e-6)


def test_token_ids_logprob_follow_the_top_tokens_in_the_order_asked():
    g = torch.Generator().manual_seed(12)
    logits = torch.randn(4, V, generator=g)
    rows = [
        _row(temperature=0.0, top_logprobs_num=2, token_ids_logprob=[9, 3, 9]),
        _row(temperature=0.0, return_logprob=True),
        _row(seed=3, temperature=0.9, token_ids_logprob=[0]),  # ids alone ask for logprobs
        _row(temperature=0.0),
    ]
    res = sample(logits, rows)
    lp = torch.log_softmax(logits, -1)
    top0 = lp[0].topk(2).indices.tolist()
    assert [t for t, _ in res.top_logprobs[0]] == [*top0, 9, 3, 9]
    assert [v for _, v in res.top_logprobs[0][2:]] == pytest.approx(
        [lp[0, 9].item(), lp[0, 3].item(), lp[0, 9].item()], abs=1e-6
    )
    assert res.top_logprobs[1] == [] and res.top_logprobs[3] == []
    assert res.top_logprobs[2] == [(0, pytest.approx(lp[2, 0].item(), abs=1e-6))]
    assert not math.isnan(res.logprobs[2]) and math.isnan(res.logprobs[3])


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=math.nan), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(frequency_penalty=math.inf), "frequency_penalty"),
        (dict(token_ids_logprob=[V]), "token_ids_logprob"),
        (dict(min_new_tokens=-1), "min_new_tokens"),
        (dict(logit_bias={V: 1.0}), "logit_bias"),
        (dict(stop_token_ids=[-3]), "stop_token_ids"),
    ],
)
def test_validate_params_rejects_bad_values(kw, needle):
    err = validate_params(SamplingParams(**kw), V)
    assert err is not None and needle in err
    assert validate_params(SamplingParams(), V) is None


def test_resume_continues_the_random_stream_and_counts():
    g = torch.Generator().manual_seed(9)
    steps = [torch.randn(1, V, generator=g) for _ in range(6)]
    params = dict(temperature=1.0, frequency_penalty=0.7, min_new_tokens=5)
    first = _run([_row(seed=77, eos=(1,), **params)], steps)[0]
    resumed = _row(seed=77, eos=(1,), **params)
    resumed.resume(first[:3])
    assert resumed.num_output_tokens == 3
    assert sum(resumed.output_counts.values()) == 3
    assert _run([resumed], steps[3:])[0] == first[3:]
    fresh = _row(seed=77, eos=(1,), **params)  # same seed, no resume: the stream restarts
    assert _run([fresh], steps[:3])[0] == first[:3]


@pytest.mark.parametrize("narrow_devices", [("cpu",), ()], ids=["candidates", "sort-all"])
def test_sampled_tokens_match_a_plain_reference_sampler(monkeypatch, narrow_devices):
    """Every non-greedy path (vocabulary order, top-p inside the candidate set, top-p
    over the whole sorted vocabulary) against a per-row reference: softmax, the kept
    set of _reference_keep, then inverse CDF with the row's own first uniform. Both
    ways to top-p give the same tokens: the CPU's (candidates first, reading a flag)
    and a GPU's (one sort of every row, nothing read back)."""
    monkeypatch.setattr(sampling, "NARROW_NUCLEUS_DEVICES", narrow_devices)
    num_vocab = 4096  # > NUCLEUS_CANDIDATES, so flat rows take the full sort
    g = torch.Generator().manual_seed(21)
    params, logits = [], []
    for i in range(48):
        kind = i % 4
        if kind == 0:
            p = dict(temperature=0.9)
        elif kind == 1:
            p = dict(temperature=0.7, top_k=int(torch.randint(1, 300, (1,), generator=g)))
        elif kind == 2:
            p = dict(temperature=1.0, top_p=0.8, min_p=0.01)
        else:
            p = dict(temperature=1.2, top_p=0.95, top_k=2000)
        scale = 6.0 if i % 8 < 4 else 0.3  # peaked rows and nearly flat rows
        params.append(p)
        logits.append(torch.randn(num_vocab, generator=g) * scale)
    x = torch.stack(logits)
    rows = [_row(seed=1000 + i, **p) for i, p in enumerate(params)]
    got = sample(x, rows).token_ids
    for i, p in enumerate(params):
        u = float(torch.rand(1, generator=torch.Generator().manual_seed(1000 + i)))
        probs = torch.softmax(x[i].double() / p["temperature"], -1)
        keep = _reference_keep(probs.tolist(), p.get("top_k", -1), p.get("top_p", 1.0),
                               p.get("min_p", 0.0))  # fmt: skip
        if p.get("top_p", 1.0) < 1.0:
            order = probs.argsort(descending=True).tolist()
        else:
            order = list(range(num_vocab))
        kept = [(t, float(probs[t])) for t in order if t in keep]
        total = sum(q for _, q in kept)
        acc, want = 0.0, kept[-1][0]
        for t, q in kept:
            acc += q
            if acc > u * total:
                want = t
                break
        assert got[i] == want, (i, p)


def test_both_top_p_ways_draw_the_same_tokens_on_tied_probabilities(monkeypatch):
    """bf16 logits tie often. Candidates-first (the CPU) and sort-everything (a GPU)
    order ties alike (token id ascending), so a row's draw does not depend on the way."""
    num_vocab = 8192  # > NUCLEUS_CANDIDATES: peaked rows go narrow, flat ones sort all
    g = torch.Generator().manual_seed(5)
    scale = torch.where(torch.arange(200) % 2 == 0, 8.0, 0.5)[:, None]
    x = (torch.randn(200, num_vocab, generator=g) * scale).bfloat16().float()
    params = [dict(temperature=1.0, top_p=0.9), dict(temperature=0.8, top_p=0.7, top_k=50),
              dict(temperature=1.3, top_p=0.95, min_p=0.001)]  # fmt: skip
    got = {}
    for way in (("cpu",), ()):
        monkeypatch.setattr(sampling, "NARROW_NUCLEUS_DEVICES", way)
        rows = [_row(seed=50 + i, **params[i % 3]) for i in range(200)]
        got[way] = sample(x, rows).token_ids
    assert got[("cpu",)] == got[()]
    # and ties were there to be ordered: many rows hold equal probabilities
    assert sum(int(r.unique().numel() < r.numel()) for r in x) > 100
