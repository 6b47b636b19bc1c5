"""`shunter bench serve` without a server: datasets, the arrival schedule, request bodies,
summary arithmetic, and (heavy tier) the HF baseline and text prompts from the real
tokenizer on the default model.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from shunter.ops import bench_datasets as ds
from shunter.ops.bench_client import ClientConfig, arrival_offsets, payload
from shunter.ops.bench_metrics import RequestResult, summarize


def _requests(num: int):  # the scripted-server tests' prompts: [2 + 7k, 3, 4]
    return [ds.BenchRequest([2 + 7 * k, 3, 4], 5) for k in range(num)]


# -- datasets ------------------------------------------------------------------------------


def test_random_dataset_lengths_ids_and_seed():
    pool = ds.token_pool(1000, special_ids=[0, 1, 2])
    spec = ds.RandomSpec(num_prompts=300, input_len=40, output_len=20, range_ratio=0.5)
    reqs = ds.random_requests(spec, pool, seed=5)
    in_lens = [r.prompt_len for r in reqs]
    out_lens = [r.output_len for r in reqs]
    assert min(in_lens) >= 20 and max(in_lens) <= 40 and len(set(in_lens)) > 10
    assert min(out_lens) >= 10 and max(out_lens) <= 20
    ids = {i for r in reqs for i in r.prompt_ids}
    assert not ids & {0, 1, 2} and max(ids) < 1000
    assert ds.random_requests(spec, pool, seed=5) == reqs
    assert ds.random_requests(spec, pool, seed=6) != reqs
    fixed = ds.random_requests(msgspec_replace(spec, range_ratio=1.0), pool, seed=5)
    assert {(r.prompt_len, r.output_len) for r in fixed} == {(40, 20)}
    wide = ds.random_requests(msgspec_replace(spec, range_ratio=0.0), pool, seed=5)
    assert min(r.prompt_len for r in wide) >= 1 and min(r.output_len for r in wide) >= 1


def msgspec_replace(spec, **kw):
    import msgspec

    return msgspec.structs.replace(spec, **kw)


def test_shared_prefix_dataset_shares_exactly_the_system_prompt():
    spec = ds.SharedPrefixSpec(num_groups=3, prompts_per_group=4, system_prompt_len=50,
                               question_len=10, output_len=7)  # fmt: skip
    reqs = ds.shared_prefix_requests(spec, ds.token_pool(5000), seed=3)
    assert len(reqs) == 12 and all(r.prompt_len == 60 and r.output_len == 7 for r in reqs)
    assert [r.group_idx for r in reqs] == [0] * 4 + [1] * 4 + [2] * 4
    prefixes = [tuple(r.prompt_ids[:50]) for r in reqs]
    assert len(set(prefixes[:4])) == len(set(prefixes[4:8])) == 1
    assert len(set(prefixes)) == 3
    questions = {tuple(r.prompt_ids[50:]) for r in reqs}
    assert len(questions) == 12
    assert ds.shared_prefix_requests(spec, ds.token_pool(5000), seed=3) == reqs
    # round-robin: the same requests, one of each group in turn
    rr = ds.shared_prefix_requests(msgspec_replace(spec, order="round-robin"),
                                   ds.token_pool(5000), seed=3)  # fmt: skip
    assert [r.group_idx for r in rr] == [0, 1, 2] * 4
    assert sorted(rr, key=lambda r: r.group_idx) == reqs
    with pytest.raises(ValueError, match="order must be one of grouped"):
        msgspec_replace(spec, order="shuffled")


def test_dataset_arguments_are_checked():
    with pytest.raises(ValueError, match="range ratio"):
        ds.RandomSpec(10, 10, 10, range_ratio=1.5)
    with pytest.raises(ValueError, match="input_len"):
        ds.RandomSpec(10, 0, 10)
    with pytest.raises(ValueError, match="every token"):
        ds.token_pool(3, special_ids=[0, 1, 2])
    with pytest.raises(ValueError, match="max_tokens"):
        ds.with_output_len(_requests(2), 0)
    texts = ds.with_text(_requests(2), lambda ids: ",".join(map(str, ids)))
    assert texts[0].prompt_text == "2,3,4" and texts[0].prompt_ids == [2, 3, 4]
    warm = ds.warmup_request(ds.BenchRequest([1, 2, 3, 4, 5], 40, prompt_text="abcdef"))
    assert warm == ds.BenchRequest([3, 4, 5, 1, 2], 16, prompt_text="defabc")


def test_arrival_offsets_are_poisson_and_seeded():
    assert arrival_offsets(4, math.inf, 0) == [0.0] * 4
    a = arrival_offsets(4000, 50.0, seed=9)
    assert a == arrival_offsets(4000, 50.0, seed=9) and a != arrival_offsets(4000, 50.0, seed=8)
    gaps = np.diff(a)
    assert a[0] == 0.0 and (gaps >= 0).all()
    assert abs(gaps.mean() - 0.02) < 0.002  # mean gap 1 / rate
    assert abs(np.median(gaps) - 0.02 * math.log(2)) < 0.002  # exponential, not uniform


def test_payloads_carry_the_length_controls():
    req = ds.BenchRequest([5, 6], 9)
    cfg = ClientConfig("http://x", model="m", ignore_eos=True, extra_body={"top_k": 3})
    body = payload(cfg, req)
    assert body["prompt"] == [5, 6] and body["max_tokens"] == 9 and body["min_tokens"] == 9
    assert body["ignore_eos"] is True and body["stream_options"] == {"include_usage": True}
    assert body["model"] == "m" and body["top_k"] == 3
    sg = payload(ClientConfig("http://x", backend="sglang", ignore_eos=True), req)
    assert sg["input_ids"] == [5, 6] and sg["sampling_params"]["min_new_tokens"] == 9
    chat = ClientConfig("http://x", backend="openai-chat")
    with pytest.raises(ValueError, match="text"):
        payload(chat, req)
    text = ds.BenchRequest([5, 6], 9, prompt_text="hi")
    assert payload(chat, text)["messages"] == [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="request-rate"):
        ClientConfig("http://x", request_rate=0.0)


# -- metrics -------------------------------------------------------------------------------


def test_summary_arithmetic():
    rs = [
        RequestResult(True, "", 10, 5, 0.1, [0.02, 0.02, 0.03, 0.03], 0.2, 0.0, cached_len=6),
        RequestResult(True, "", 20, 1, 0.3, [], 0.3, 0.5, cached_len=9),
        RequestResult(False, "HTTP 400: bad", 0, 0),
    ]
    s = summarize(rs, duration_s=2.0)
    assert (s["completed"], s["failed"]) == (2, 1) and s["errors"] == {"HTTP 400: bad": 1}
    assert s["total_input_tokens"] == 30 and s["output_token_throughput"] == 3.0
    assert s["total_cached_tokens"] == 15 and s["cache_hit_rate"] == 0.5
    assert s["request_throughput"] == 1.0 and s["concurrency"] == pytest.approx(0.25)
    assert s["mean_ttft_ms"] == pytest.approx(200.0) and s["median_e2e_ms"] == pytest.approx(250)
    assert s["mean_tpot_ms"] == pytest.approx(25.0)  # (0.2 - 0.1) / 4, the 1-token request has none
    assert s["median_itl_ms"] == pytest.approx(25.0) and s["max_itl_ms"] == pytest.approx(30.0)
    empty = summarize([RequestResult(False, "x")], 1.0)
    assert empty["completed"] == 0 and empty["mean_ttft_ms"] is None


# -- heavy tier: HF transformers and the real tokenizer on the default model ---------------


@pytest.mark.heavy
def test_hf_baseline_times_each_request_at_its_own_length():
    from shunter.ops.bench_hf import run_hf

    reqs = [ds.BenchRequest([504, 3012, 44], 3), ds.BenchRequest([1280, 19, 7, 7, 301], 5)]
    run = run_hf(reqs, batch_size=2, progress=False)
    a, b = run.results
    assert (a.output_len, b.output_len) == (3, 5) and (len(a.itl_s), len(b.itl_s)) == (2, 4)
    assert run.num_generated_tokens == 10  # the batch runs to its longest request
    assert a.ttft_s == b.ttft_s and a.e2e_s < b.e2e_s <= run.duration_s
    assert a.itl_s == b.itl_s[:2]  # one batch, one clock


@pytest.mark.heavy
def test_text_prompts_from_the_real_tokenizer():
    import argparse

    from shunter.ops.bench_hf import load_tokenizer
    from shunter.ops.bench_serve import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--backend", "openai-chat", "--dataset-name", "generated-shared-prefix",
                              "--gsp-num-groups", "2", "--gsp-prompts-per-group", "3",
                              "--gsp-system-prompt-len", "40", "--gsp-question-len", "8"])  # fmt: skip
    tokenizer = load_tokenizer(None)
    reqs = ds.from_args(args, lambda path: tokenizer)
    assert len(reqs) == 6 and all(r.prompt_text for r in reqs)
    assert not {i for r in reqs for i in r.prompt_ids} & set(tokenizer.all_special_ids)
    shared = tokenizer.decode(reqs[0].prompt_ids[:40])
    assert all(r.prompt_text.startswith(shared) for r in reqs[:3])
    assert not reqs[3].prompt_text.startswith(shared)
