"""The device benchmark's parts on a CPU: counting, the HF weight mapping, the driver and
the offline batcher on a tiny dummy Llama, and the whole run at toy sizes."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from shunter.actors.executor.build import build_core
from shunter.actors.executor.config import ExecutorConfig
from shunter.actors.executor.loader import load_model
from shunter.actors.executor.models.config import from_hf_dict
from shunter.actors.executor.models.llama import LlamaForCausalLM
from shunter.ops import bench_gpu as bg
from shunter.ops import bench_gpu_model as bm
from shunter.ops.bench_gpu_driver import Driver, offline_run, random_prompts
from shunter.ops.bench_gpu_hf import build_hf, hf_generate, hf_state_dict, leading_agreement
from shunter.ops.cli import build_parser

TINY = bm.TINY_LLAMA


def _meta_model(config: dict) -> LlamaForCausalLM:
    with torch.device("meta"):
        return LlamaForCausalLM(from_hf_dict(config))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> pathlib.Path:
    return bm.write_model_dir(tmp_path_factory.mktemp("m") / "tiny", TINY)


def _core(model_dir: pathlib.Path, **kw):
    kw = {"max_total_tokens": 2048, "context_length": 512, "max_num_rows": 8, **kw}
    return build_core(ExecutorConfig(model_path=str(model_dir), load_format="dummy",
                                     device="cpu", dtype="float32", load_progress=False, **kw))  # fmt: skip


@pytest.mark.parametrize("config", [bm.LLAMA31_8B, TINY, {**TINY, "tie_word_embeddings": True}])
def test_param_count_and_decode_bytes_match_the_model(config):
    c = from_hf_dict(config)
    model = _meta_model(config)
    assert bm.model_params(c) == sum(p.numel() for p in model.parameters())
    embed = c.vocab_size * c.hidden_size
    read = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    if c.tie_word_embeddings:
        read += embed  # the head reads the embedding matrix
    # bs=2 at contexts 10 and 30: weights once, one embedding row and its KV per entry
    kv = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 2 * 40
    assert bm.decode_step_bytes(c, [10, 30], 2) == (read + 2 * c.hidden_size) * 2 + kv


def test_llama31_8b_is_the_real_shape():
    assert bm.model_params(from_hf_dict(bm.LLAMA31_8B)) == 8_030_261_248


def test_prefill_flops_agree_with_torch_flop_counter(model_dir):
    """torch's counter on HF's eager forward sees every matmul, the head for the one
    kept row, and attention over the full square (`prefill_flops` counts the causal half)."""
    from torch.utils.flop_counter import FlopCounterMode

    model, c = load_model(str(model_dir), load_format="dummy", progress=False)
    hf = build_hf(TINY, model)
    hf.config._attn_implementation = "eager"  # matmuls the counter sees (CPU SDPA it does not)
    t = 64
    with FlopCounterMode(display=False) as fc:
        hf(torch.randint(0, c.vocab_size, (1, t)), logits_to_keep=1)
    attention_causal = 2 * c.num_layers * c.num_heads * c.head_dim * t * t
    norms = 2 * c.num_layers * 2 * c.hidden_size * t  # counted by us, not by torch
    # some transformers versions build the rope angles with a matmul: not model FLOPs
    counts = fc.get_flop_counts()
    rope = sum(sum(v.values()) for k, v in counts.items() if k.endswith("rotary_emb"))
    assert fc.get_total_flops() - rope == bm.prefill_flops(c, t) - norms + attention_causal


def test_hf_state_dict_is_the_inverse_of_load_weights(model_dir):
    model, c = load_model(str(model_dir), load_format="dummy", progress=False, seed=3)
    sd = hf_state_dict(model)
    import transformers

    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_dict(TINY))
    assert set(sd) == set(hf.state_dict())
    assert sd["model.layers.1.self_attn.k_proj.weight"].shape == (c.kv_size, c.hidden_size)
    again, _ = load_model(str(model_dir), load_format="dummy", progress=False, seed=4)
    again.load_weights(sd.items())
    for (n, p), (n2, q) in zip(model.named_parameters(), again.named_parameters(), strict=True):
        assert n == n2 and torch.equal(p, q), n


def test_hf_greedy_matches_ours_on_the_same_weights(model_dir):
    core = _core(model_dir)
    driver = Driver(core)
    prompts = random_prompts(3, 12, core.vocab_size, seed=1)
    rows, first = driver.prefill(prompts, token_budget=16)  # the second prompt is chunked
    ours = [[t] for t in first]
    for _ in range(7):
        for s, t in zip(ours, driver.decode(rows), strict=True):
            s.append(t)
    hf = build_hf(TINY, core.runner.model)
    theirs = hf_generate(hf, prompts, 8)
    assert ours == theirs
    assert leading_agreement(ours[0], theirs[0]) == 8
    assert leading_agreement([1, 2, 3], [1, 5, 3]) == 1


def _alone(core, prompt: list[int], n: int) -> list[int]:
    driver = Driver(core)
    rows, first = driver.prefill([prompt], token_budget=1 << 20)
    out = first + [driver.decode(rows)[0] for _ in range(n - 1)]
    driver.close_all()
    driver.step([])  # deliver the closes
    return out


def test_offline_batcher_queues_chunks_and_matches_single_runs(model_dir):
    # a pool of 96 tokens fits two of these requests at a time, so the rest queue
    core = _core(model_dir, max_total_tokens=96)
    driver = Driver(core)
    prompts = [random_prompts(1, n, core.vocab_size, seed=n)[0] for n in (20, 33, 7, 40, 12)]
    res = offline_run(driver, prompts, output_len=6, token_budget=16, max_running=4)
    assert [len(o) for o in res.outputs] == [6] * 5
    assert not driver.row_len and len(driver.free_pages) == core.num_pages
    assert len(driver.free_rows) == core.max_num_rows
    driver.step([])  # the last closes reach the core
    assert core.statistics().num_rows == 0
    assert res.outputs == [_alone(core, p, 6) for p in prompts]


def test_offline_batcher_refuses_a_request_larger_than_the_pool(model_dir):
    core = _core(model_dir, max_total_tokens=32)
    with pytest.raises(RuntimeError, match="more pages"):
        offline_run(Driver(core), [[5] * 30], output_len=8, token_budget=16, max_running=2)


def _args(argv: list[str]):
    full = ["bench", "executor", *argv]
    return build_parser(full).parse_args(full)


def test_whole_run_on_a_cpu_at_toy_sizes(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = _args(["--device", "cpu", "--model", "tiny-llama", "--dtype", "float32",
                  "--batch-sizes", "1,2", "--decode-steps", "4", "--prefill-len", "64",
                  "--decode-prompt-len", "16", "--bs1-prompt-len", "8", "--repeats", "2",
                  "--hf-new-tokens", "4", "--offline-requests", "3", "--offline-input-len",
                  "16", "--offline-output-len", "4", "--kernel-profile", "2",
                  "--kernel-profile-bs", "1,2,prefill", "--prefill-pause", "0.01",
                  "--prefill-clocks", "--prefill-host-profile", "500", "--out", str(out)])  # fmt: skip
    assert bg.run(args) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    summary = json.loads(last)
    assert summary == json.loads(out.read_text())
    for key in ("decode_tok_s_bs1", "decode_tok_s_bs2", "prefill_tok_s", "hf_decode_tok_s_bs1",
                "decode_bs2_vs_hf", "offline_output_tok_s"):  # fmt: skip
        assert summary[key] > 0, key
    assert summary["bs1_greedy_agree_tokens"] == 4
    assert 0 < summary["prefill_host_ms"] < 1e3 * 64 / summary["prefill_tok_s"]
    assert summary["config"]["attention_backend"] == "auto"
    assert summary["config"]["attention_backend_used"] == "torch"
    assert summary["offline_steps"] == 4  # one prefill of all three, then three decodes
    prof = summary["bs1_kernel_profile"]  # on a CPU: host ops by their own time
    assert prof and abs(sum(r["share"] for r in prof) - 1.0) < 1e-9  # the tail is one row
    assert [r["share"] for r in prof[:-1]] == sorted((r["share"] for r in prof[:-1]), reverse=True)
    assert any("mm" in r["name"] or "linear" in r["name"] for r in prof)
    assert summary["bs2_kernel_profile"]
    assert summary["prefill_kernel_profile"]
    assert summary["prefill_idle"] == {}  # no device kernels on a CPU
    assert summary["prefill_pause_s"] == 0.01
    host = summary["prefill_host_profile"]  # the step's host functions before the model
    assert 20 < len(host) <= 500
    assert [r["cum_ms"] for r in host] == sorted((r["cum_ms"] for r in host), reverse=True)
    assert any("plan_batch" in r["fn"] for r in host), host[:10]
    assert not any("llama.py" in r["fn"] for r in host)  # stopped where the model starts
    runs = summary["prefill_runs"]  # every timed run in order; no GPU clocks on a CPU
    assert [set(r) for r in runs] == [{"ms"}, {"ms"}] and all(r["ms"] > 0 for r in runs)
    assert min(r["ms"] for r in runs) == pytest.approx(64e3 / summary["prefill_tok_s"], rel=1e-3)


def test_extend_run_times_steps_over_a_cached_prefix(capsys):
    args = _args(["--device", "cpu", "--model", "tiny-llama", "--dtype", "float32",
                  "--batch-sizes", "1", "--decode-steps", "2", "--prefill-len", "16",
                  "--bs1-prompt-len", "8", "--repeats", "3", "--skip-hf",
                  "--offline-requests", "0", "--extend", "40+8, 0+8", "--kernel-profile", "1",
                  "--kernel-profile-bs", "extend", "--prefill-host-profile", "300"])  # fmt: skip
    assert bg.run(args) == 0
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    assert "offline_output_tok_s" not in summary  # --offline-requests 0 skips it
    for key in ("extend_40+8", "extend_0+8"):
        fig = summary[key]
        assert len(fig["runs_ms"]) == 3
        assert min(fig["runs_ms"]) == pytest.approx(fig["best_ms"], abs=1e-3)
        assert 0 < fig["host_ms"] < fig["best_ms"] <= fig["median_ms"]
        assert "floor_ms" not in fig  # no ceilings measured on a CPU
        assert fig["kernel_profile"] and fig["idle"] == {}
        assert any("plan_batch" in r["fn"] for r in fig["host_profile"])
        assert summary[f"{key}_ms"] == pytest.approx(fig["median_ms"], abs=1e-3)  # for bench ab
    assert "extend 8 tokens over 40 cached: median" in out


def test_an_extend_step_samples_what_a_prefill_of_the_whole_prompt_does(model_dir):
    from shunter.ops.bench_profile import prepare_step

    driver = Driver(_core(model_dir))
    prefix, new = random_prompts(2, 24, driver.core.vocab_size, seed=5)
    _, (whole,) = prepare_step(driver, prefix + new[:9])()  # a prefill: (rows, first tokens)
    assert list(prepare_step(driver, new[:9], prefix)().values()) == [whole]  # {row: token}
    assert len(driver.row_len) == 1 and next(iter(driver.row_len.values())) == 33


def test_bad_extend_shapes_are_refused(capsys):
    for bad in ("2048", "12+0", "a+3", "1+-2"):
        assert bg.run(_args(["--device", "cpu", "--model", "tiny-llama", "--extend", bad])) == 2
        assert "--extend wants PREFIX+NEW" in capsys.readouterr().err


def test_sampled_run_reports_no_greedy_agreement(capsys):
    """--temperature/--top-p sample every row (top-p through its sorted path): the run
    completes, and greedy agreement with HF is not claimed for sampled tokens."""
    args = _args(["--device", "cpu", "--model", "tiny-llama", "--dtype", "float32",
                  "--batch-sizes", "1,3", "--decode-steps", "4", "--prefill-len", "32",
                  "--decode-prompt-len", "8", "--bs1-prompt-len", "8", "--repeats", "1",
                  "--hf-new-tokens", "4", "--offline-requests", "2", "--offline-input-len",
                  "8", "--offline-output-len", "3", "--temperature", "0.8", "--top-p", "0.9"])  # fmt: skip
    assert bg.run(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["decode_tok_s_bs3"] > 0 and summary["offline_output_tok_s"] > 0
    assert "bs1_greedy_agree_tokens" not in summary


def test_cpu_defaults_stay_and_cuda_without_a_gpu_is_refused(capsys):
    args = _args(["--device", "cuda", "--skip-hf"])
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    from shunter.ops import bench_executor

    assert bench_executor.run(args) == 2
    assert "CUDA is not available" in capsys.readouterr().err
    args = _args([])
    assert args.device == "cpu" and args.batch_sizes is None  # filled by the CPU run


@pytest.mark.gpu
def test_quick_run_on_cuda_with_the_tiny_model(capsys):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for backend in ("triton", "flashinfer"):
        args = _args(["--device", "cuda", "--model", "tiny-llama", "--quick",
                      "--attention-backend", backend])  # fmt: skip
        assert bg.run(args) == 0
        summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert summary["copy_gbs"] > 100 and "bs1_greedy_agree_tokens" in summary
        assert summary["config"]["attention_backend_used"] == backend


def test_synthetic_tokenizer_loads_in_the_tokenizer_actor_and_covers_the_vocabulary(tmp_path):
    from shunter.actors.tokenizer.config import TokenizerConfig
    from shunter.actors.tokenizer.loading import load_codec

    path = bm.write_model_dir(tmp_path / "m", TINY, tokenizer=True)
    codec = load_codec(TokenizerConfig(model_path=str(path)))
    assert codec.vocab_size == TINY["vocab_size"]
    last = TINY["vocab_size"] - 1
    assert codec.decode([5, last, 17]) == f"t5 t{last} t17"
    assert codec.encode("t5 t6", add_special_tokens=False) == [5, 6]


def test_profile_fold_keeps_top_rows_and_sums_the_tail():
    from types import SimpleNamespace

    from shunter.ops.bench_profile import fold

    ops = [SimpleNamespace(key=f"op{i}", count=2, self_cpu_time_total=float(t),
                           device_type=torch.autograd.DeviceType.CPU)
           for i, t in enumerate([50, 0, 30, 10, 6, 4])]  # fmt: skip
    rows = fold(ops, device_time=False, top=3)
    assert [r["name"] for r in rows] == ["op0", "op2", "(3 more)"]
    assert rows[2]["total_us"] == 20 and rows[2]["calls"] == 6 and rows[2]["mean_us"] == 20 / 6
    assert [r["share"] for r in rows] == [0.5, 0.3, 0.2]
    assert [r["name"] for r in fold(ops, device_time=False, top=5)][-1] == "op5"
