"""The gpt-fast peer benchmark: its options and our config's mapping to gpt-fast's
ModelArgs always; with SHUNTER_GPT_FAST naming a gpt-fast checkout, the mapping against
gpt-fast's own named config and a whole eager run on a CPU."""

from __future__ import annotations

import json
import os
import sys
import types

import pytest

from shunter.actors.executor.models.config import from_hf_dict
from shunter.ops import bench_gpu_model as bm
from shunter.ops import bench_gpu_peer as bp

GPT_FAST = os.environ.get("SHUNTER_GPT_FAST")
needs_gpt_fast = pytest.mark.skipif(not GPT_FAST, reason="SHUNTER_GPT_FAST names no checkout")


def test_defaults_and_flags():
    a = bp.build_parser().parse_args(["--gpt-fast", "/x"])
    assert (a.gpt_fast, a.model, a.prompt_len, a.decode_steps, a.batch_size) == (
        "/x", "llama-3.1-8b", 128, 128, 1)  # fmt: skip
    assert (a.compile, a.device, a.seed, a.out, a.temperature, a.top_k) == (
        True, "cuda", 0, None, 0.8, 200)  # fmt: skip
    a = bp.build_parser().parse_args(["--gpt-fast", "/x", "--no-compile", "--model", "tiny-llama",
                                      "--batch-size", "4", "--device", "cpu"])  # fmt: skip
    assert (a.compile, a.model, a.batch_size, a.device) == (False, "tiny-llama", 4, "cpu")
    with pytest.raises(SystemExit):
        bp.build_parser().parse_args([])  # --gpt-fast is required


def test_llama31_8b_maps_to_gpt_fast_s_config():
    # gpt-fast's transformer_configs["llama-3.1-8b"] after ModelArgs.__post_init__
    # (head_dim = dim // n_head; norm_eps is its default)
    assert bp.peer_args(from_hf_dict(bm.LLAMA31_8B)) == dict(
        block_size=131072, vocab_size=128256, n_layer=32, n_head=32, dim=4096,
        intermediate_size=14336, n_local_heads=8, head_dim=128, rope_base=500000,
        norm_eps=1e-5, rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                         original_max_position_embeddings=8192),
    )  # fmt: skip


def test_tiny_llama_maps_without_rope_scaling_when_it_has_none():
    cfg = {**bm.TINY_LLAMA, "rope_scaling": None}
    a = bp.peer_args(from_hf_dict(cfg))
    assert a["rope_scaling"] is None
    assert (a["n_layer"], a["dim"], a["n_head"], a["n_local_heads"], a["head_dim"]) == (
        2, 128, 2, 1, 64)  # fmt: skip


@pytest.mark.parametrize(
    ("override", "what"),
    [({"tie_word_embeddings": True}, "tied embeddings"),
     ({"attention_bias": True}, "bias"),
     ({"head_dim": 32}, "head_dim"),
     ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "linear rope scaling")],
)  # fmt: skip
def test_switches_gpt_fast_lacks_are_refused(override, what):
    with pytest.raises(ValueError, match=what):
        bp.peer_args(from_hf_dict({**bm.TINY_LLAMA, **override}))


@pytest.fixture
def peer():
    """gpt-fast's `model` module from SHUNTER_GPT_FAST; afterwards sys.path, the
    imported top-level modules and the Inductor flags generate.py sets are put back."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    path, modules = list(sys.path), set(sys.modules)
    saved = inductor_config.save_config(), functorch_config.save_config()
    try:
        yield bp.import_peer(GPT_FAST, "model")
    finally:
        sys.path[:] = path
        for name in set(sys.modules) - modules:
            del sys.modules[name]
        inductor_config.load_config(saved[0])
        functorch_config.load_config(saved[1])


@needs_gpt_fast
def test_gpt_fast_s_named_config_equals_ours(peer):
    args, name = bp.model_args(peer, "llama-3.1-8b", from_hf_dict(bm.LLAMA31_8B))
    assert name == "llama-3.1-8b" and args.head_dim == 128
    args, name = bp.model_args(peer, "tiny-llama", from_hf_dict(bm.TINY_LLAMA))
    assert name is None and (args.n_layer, args.dim, args.head_dim) == (2, 128, 64)


@needs_gpt_fast
@pytest.mark.parametrize("top_k", ["200", "0"])  # 0: no top-k
def test_eager_run_on_cpu(peer, tmp_path, capsys, top_k):
    try:
        bp.import_peer(GPT_FAST, "generate")
    except ImportError as e:  # its tokenizer.py needs sentencepiece and tiktoken
        pytest.skip(f"gpt-fast's generate.py does not import here: {e}")
    out = tmp_path / "peer.json"
    rc = bp.main(["--gpt-fast", GPT_FAST, "--model", "tiny-llama", "--device", "cpu",
                  "--no-compile", "--prompt-len", "16", "--decode-steps", "8",
                  "--batch-size", "2", "--top-k", top_k, "--out", str(out)])  # fmt: skip
    assert rc == 0
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert s == json.loads(out.read_text())
    assert s["decode_tok_s_bs2"] > 0 and s["decode_ms_bs2"] > 0
    assert s["decode_bs2_roofline_frac"] is None and s["compile_s"] is None  # no CUDA, eager
    assert s["config"]["gpt_fast_config"] is None and s["config"]["batch_size"] == 2


def test_a_missing_checkout_is_an_error(tmp_path, capsys):
    rc = bp.main(["--gpt-fast", str(tmp_path), "--model", "tiny-llama", "--device", "cpu"])
    assert rc == 2 and "no model.py" in capsys.readouterr().err


def test_decode_one_token_is_swapped_for_the_run_only():
    def decode_one_token(model, x, input_pos):
        return x

    gen = types.SimpleNamespace(decode_one_token=decode_one_token)
    with bp.decode_compiled(gen, compile=True):  # torch.compile is lazy: nothing compiles
        assert gen.decode_one_token is not decode_one_token
    assert gen.decode_one_token is decode_one_token
    with bp.decode_compiled(gen, compile=False):
        assert gen.decode_one_token is decode_one_token
