"""Every family, loaded from a tiny random HF checkpoint, decodes exactly as HF
transformers does (greedy tokens equal, log-probabilities within 1e-4 in float32),
alone and batched with entries of other lengths and cached prefixes."""

from __future__ import annotations

import torch

from shunter.actors.executor.kv_pool import KVPool
from shunter.actors.executor.loader import load_model
from shunter.actors.executor.runner import ForwardInput, ModelRunner

PROMPTS = [
    [1, 17, 200, 45, 99, 3, 88, 41, 7, 250, 13],  # 11 tokens
    [1, 5, 60],  # 3
    [1, 77, 12, 140, 33, 9, 181, 64, 22, 5, 119, 230, 17, 46, 98, 2, 71],  # 17 (holds eos id)
]
MAX_NEW = 10
LOGPROB_ATOL = 1e-4


def _hf_greedy(model_dir, prompts):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    return [_hf_generate(hf, p) for p in prompts]


def _hf_generate(hf, prompt):
    out = hf.generate(
        torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, min_new_tokens=MAX_NEW,
        output_logits=True, return_dict_in_generate=True, pad_token_id=0,
    )  # fmt: skip
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1) for step in out.logits]
    return tokens, logprobs


def _runner(model_dir, page_size=1, num_pages=256):
    model, config = load_model(str(model_dir), progress=False)
    pool = KVPool(config, num_pages, page_size=page_size)
    return ModelRunner(model, pool), config


def test_family_matches_hf_alone_and_batched(family, tiny_model_dir, greedy):
    d = tiny_model_dir(family)
    runner, _ = _runner(d, page_size=4)
    refs = _hf_greedy(d, PROMPTS)
    # alone, one prompt at a time (eos ignored, as in the HF call above)
    for prompt, (ref_tokens, ref_lps) in zip(PROMPTS, refs):
        got = greedy(runner, [prompt], MAX_NEW)
        assert got.tokens[0] == ref_tokens, family
        for a, b in zip(got.logprobs[0], ref_lps):
            torch.testing.assert_close(a, b, atol=LOGPROB_ATOL, rtol=0)
    # batched: three lengths in one forward per step, one of them prefilled in chunks
    got = greedy(runner, PROMPTS, MAX_NEW, first_page=100)
    chunked = greedy(runner, PROMPTS, MAX_NEW, first_page=150, prefill_chunks=3)
    for r, (ref_tokens, ref_lps) in enumerate(refs):
        assert got.tokens[r] == ref_tokens, (family, r)
        assert chunked.tokens[r] == ref_tokens, (family, r)
        for a, b, c in zip(got.logprobs[r], chunked.logprobs[r], ref_lps):
            torch.testing.assert_close(a, c, atol=LOGPROB_ATOL, rtol=0)
            torch.testing.assert_close(b, c, atol=LOGPROB_ATOL, rtol=0)


def test_config_switches_follow_the_family(tiny_model_dir):
    from shunter.actors.executor.loader import _hf_config

    c = _hf_config(tiny_model_dir("qwen3_qknorm"), None)
    assert (c.family, c.qk_norm, c.head_dim, c.q_size, c.qkv_bias) == (
        "qwen3",
        True,
        32,
        128,
        False,
    )
    c = _hf_config(tiny_model_dir("qwen2_bias_tied"), None)
    assert (c.qkv_bias, c.o_bias, c.tie_word_embeddings, c.num_kv_heads) == (True, False, True, 1)
    c = _hf_config(tiny_model_dir("llama3_tied_sharded"), None)
    assert c.rope_scaling is not None and c.rope_scaling.rope_type == "llama3"
    assert c.rope_theta == 500000.0 and c.rope_scaling.factor == 8.0
    c = _hf_config(tiny_model_dir("mistral_window"), None)
    assert (c.family, c.sliding_window) == ("mistral", 7)
    c = _hf_config(tiny_model_dir("llama_mha_bias"), None)
    assert (c.qkv_bias, c.o_bias, c.mlp_bias, c.num_kv_heads) == (True, True, True, 4)


def test_extend_over_cached_prefix_equals_full_prefill(tiny_model_dir):
    """All-token logits of a prompt computed in one prefill equal those computed as a
    cached prefix plus an extend (and in a batch with a decode entry)."""
    runner, _ = _runner(tiny_model_dir("qwen3_qknorm"), page_size=1)
    prompt = PROMPTS[2]
    slots_a = torch.arange(0, 40)
    slots_b = torch.arange(100, 140).flip(0)  # scattered the other way round
    full = runner.forward(ForwardInput.build([prompt], [0], [slots_a], logits="all"))
    runner.forward(ForwardInput.build([prompt[:6]], [0], [slots_b]))
    other = torch.arange(200, 220)
    runner.forward(ForwardInput.build([PROMPTS[1]], [0], [other]))
    # extend of the rest, batched with a decode step of another row
    inp = ForwardInput.build(
        [prompt[6:], [42]], [6, len(PROMPTS[1])], [slots_b, other], logits="all"
    )
    ext = runner.forward(inp)
    torch.testing.assert_close(ext[: len(prompt) - 6], full[6:], atol=1e-4, rtol=0)


def test_batch_invariance_of_greedy_tokens(tiny_model_dir, greedy):
    """A request's greedy tokens in a batch of eight equal those computed alone."""
    runner, _ = _runner(tiny_model_dir("llama"), page_size=2)
    g = torch.Generator().manual_seed(7)
    prompts = [
        torch.randint(3, 256, (int(n),), generator=g).tolist()
        for n in torch.randint(2, 30, (8,), generator=g)
    ]
    alone = [greedy(runner, [p], 12).tokens[0] for p in prompts]
    batched = greedy(runner, prompts, 12, first_page=20)
    assert batched.tokens == alone


def test_swiglu_in_gate_up_path_gives_the_same_tokens(tiny_model_dir, greedy, monkeypatch):
    """With FUSE_GATE_UP_SWIGLU on, a layer runs its MLP through gate_up_swiglu (the
    epilogue GEMV on CUDA at one row, silu_mul after the projection elsewhere): the
    same greedy tokens and logprobs as the default path."""
    from shunter.kernels import linear as linear_mod

    runner, _ = _runner(tiny_model_dir("llama"))
    want = greedy(runner, PROMPTS, 6)
    monkeypatch.setattr(linear_mod, "FUSE_GATE_UP_SWIGLU", True)
    assert runner.model.model.layers[0].mlp.swiglu_in_gate_up()
    got = greedy(runner, PROMPTS, 6, first_page=100)
    assert got.tokens == want.tokens
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, atol=1e-6, rtol=0)
