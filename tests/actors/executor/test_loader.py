"""Loaders: HF directories (single file and sharded), GGUF (default model and a tiny
file written here the way llama.cpp writes one, q/k permuted), dummy weights, and a
clear LoadError for every way loading can fail."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from shunter.actors.executor.kv_pool import KVPool
from shunter.actors.executor.loader import LoadError, load_model
from shunter.actors.executor.runner import ForwardInput, ModelRunner


def _hf_logits(model_dir, ids):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def _our_logits(model, config, ids):
    runner = ModelRunner(model, KVPool(config, 64))
    return runner.forward(ForwardInput.build([ids], [0], [torch.arange(len(ids))], logits="all"))


IDS = [1, 9, 44, 200, 3, 17, 250, 60, 5]


def test_sharded_hf_dir_loads_every_shard(tiny_model_dir):
    d = tiny_model_dir("llama3_tied_sharded")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model, config = load_model(str(d), progress=False)
    assert config.tie_word_embeddings and model.lm_head is None
    torch.testing.assert_close(
        _our_logits(model, config, IDS), _hf_logits(d, IDS), atol=1e-4, rtol=0
    )


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation of q/k rows (interleaved rope)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _llama_cpp_rope_factors(cfg):
    """convert_hf_to_gguf's rope_freqs for llama3 scaling, written out independently."""
    import math

    rp = cfg["rope_parameters"]
    dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (rp["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    old, lo, hi, factor = (rp["original_max_position_embeddings"], rp["low_freq_factor"],
                           rp["high_freq_factor"], rp["factor"])  # fmt: skip
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _write_gguf(hf_dir, path, qtype_name="F32"):
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    sd = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        sd.update(load_file(f))
    arch = cfg["model_type"] if cfg["model_type"] in ("qwen2", "qwen3") else "llama"
    w = gguf.GGUFWriter(str(path), arch)
    if "head_dim" in cfg:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}  # fmt: skip
    block = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm"}  # fmt: skip
    qtype = gguf.GGMLQuantizationType[qtype_name]
    if cfg["rope_parameters"].get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _llama_cpp_rope_factors(cfg))
    for name, t in sd.items():
        arr = t.float().numpy()
        if name in names:
            gname = names[name]
        else:
            _, _, i, rest = name.split(".", 3)
            mod, kind = rest.rsplit(".", 1)
            gname = f"blk.{i}.{block[mod]}.{kind}"
            if arch != "llama" or kind != "weight":
                pass  # llama.cpp permutes only llama's q/k weights
            elif mod == "self_attn.q_proj":
                arr = _permute(arr, cfg["num_attention_heads"])
            elif mod == "self_attn.k_proj":
                arr = _permute(arr, cfg["num_key_value_heads"])
        if arr.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(
                gname, gguf.quants.quantize(arr, qtype), raw_shape=arr.shape, raw_dtype=qtype
            )
        else:
            w.add_tensor(gname, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(("qtype", "atol"), [("F32", 1e-4), ("F16", 2e-2)])
def test_gguf_unpermutes_qk_and_matches_hf(tiny_model_dir, tmp_path, qtype, atol):
    d = tiny_model_dir("llama")
    path = _write_gguf(d, tmp_path / f"tiny-{qtype}.gguf", qtype)
    model, config = load_model(str(path), progress=False)
    assert (config.family, config.num_kv_heads, config.tie_word_embeddings) == ("llama", 2, False)
    torch.testing.assert_close(
        _our_logits(model, config, IDS), _hf_logits(d, IDS), atol=atol, rtol=0
    )


@pytest.mark.parametrize("qwen", ["qwen2_bias_tied", "qwen3_qknorm"])
def test_gguf_qwen_families_match_hf(qwen, tiny_model_dir, tmp_path):
    d = tiny_model_dir(qwen)
    model, config = load_model(str(_write_gguf(d, tmp_path / f"{qwen}.gguf")), progress=False)
    assert config.family == qwen[:5]
    torch.testing.assert_close(
        _our_logits(model, config, IDS), _hf_logits(d, IDS), atol=1e-4, rtol=0
    )


def test_gguf_llama31_rope_freqs_and_tied_embeddings(tiny_model_dir, tmp_path):
    d = tiny_model_dir("llama3_tied_sharded")
    model, config = load_model(str(_write_gguf(d, tmp_path / "l31.gguf")), progress=False)
    assert config.tie_word_embeddings and config.rope_freq_factors is not None
    assert config.rope_freq_factors[-1] == 8.0 and min(config.rope_freq_factors) < 8.0
    ids = [*IDS, *IDS, *IDS]  # positions past original_max_position_embeddings (16)
    torch.testing.assert_close(
        _our_logits(model, config, ids), _hf_logits(d, ids), atol=1e-4, rtol=0
    )


def test_default_gguf_config_and_tied_embeddings(default_model):
    model, config = default_model
    assert (config.family, config.num_layers, config.hidden_size, config.intermediate_size) == (
        "llama", 30, 576, 1536)  # fmt: skip
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size) == (
        9,
        3,
        64,
        49152,
    )
    assert config.rope_theta == 100000.0 and config.tie_word_embeddings and model.lm_head is None
    assert config.eos_token_ids == [2]
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)


def test_torch_dequantization_equals_gguf_quants():
    import gguf

    from shunter.actors.executor import loader_gguf
    from shunter.actors.model_files import resolve_model

    reader = loader_gguf.open_reader(resolve_model(None).path)
    seen = set()
    for t in reader.tensors:
        if t.tensor_type.name in ("Q4_1", "Q8_0") and t.tensor_type.name not in seen:
            seen.add(t.tensor_type.name)
            ours = loader_gguf.dequantize(t)
            want = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type))
            assert torch.equal(ours, want.reshape(ours.shape)), t.name
    assert seen == {"Q4_1", "Q8_0"}


def test_dummy_weights_are_seeded(tiny_model_dir):
    d = str(tiny_model_dir("qwen3_qknorm"))
    a, cfg = load_model(d, load_format="dummy", seed=3, progress=False)
    b, _ = load_model(d, load_format="dummy", seed=3, progress=False)
    c, _ = load_model(d, load_format="dummy", seed=4, progress=False)
    w = "model.layers.1.self_attn.qkv_proj.weight"
    pa, pb, pc = (dict(m.named_parameters())[w] for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)
    logits = _our_logits(a, cfg, IDS)
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_dummy_from_config_overrides_only(tiny_model_dir):
    model, cfg = load_model(str(tiny_model_dir("llama")), load_format="dummy", progress=False,
                            config_overrides={"num_hidden_layers": 1}, dtype=torch.bfloat16)  # fmt: skip
    assert cfg.num_layers == 1 and len(model.model.layers) == 1
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16


def test_config_overrides_take_hf_keys_or_field_names(tiny_model_dir):
    _, cfg = load_model(None, load_format="dummy", progress=False,
                        config_overrides={"num_hidden_layers": 2, "vocab_size": 512})  # fmt: skip
    assert (cfg.num_layers, cfg.vocab_size, cfg.hidden_size) == (2, 512, 576)
    _, cfg = load_model(
        None, load_format="dummy", progress=False, config_overrides={"num_layers": 1}
    )
    assert cfg.num_layers == 1
    d = str(tiny_model_dir("llama"))
    _, cfg = load_model(d, load_format="dummy", progress=False,
                        config_overrides={"num_layers": 1, "rope_theta": 5.0})  # fmt: skip
    assert (cfg.num_layers, cfg.rope_theta) == (1, 5.0)
    for bad in ({"num_layerz": 1}, {"num_kv_heads": 5}):
        for path in (None, d):
            with pytest.raises(LoadError):
                load_model(path, load_format="dummy", progress=False, config_overrides=bad)


# ---- errors -----------------------------------------------------------------------


def _copy_dir(tiny_model_dir, tmp_path, name="llama"):
    return shutil.copytree(tiny_model_dir(name), tmp_path / name)


def test_error_missing_path(tmp_path):
    with pytest.raises(LoadError, match="does not exist"):
        load_model(str(tmp_path / "nope"), progress=False)
    with pytest.raises(LoadError, match=r"without config.json"):
        load_model(str(tmp_path), progress=False)


def test_error_unsupported_architecture(tiny_model_dir, tmp_path):
    d = _copy_dir(tiny_model_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoadError, match=r"unsupported architecture.*GPT2LMHeadModel"):
        load_model(str(d), progress=False)


def test_error_truncated_safetensors_header_and_data(tiny_model_dir, tmp_path):
    d = _copy_dir(tiny_model_dir, tmp_path)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:6])
    with pytest.raises(LoadError, match=r"model.safetensors is corrupt or truncated"):
        load_model(str(d), progress=False)
    f.write_bytes(data[:-100])
    with pytest.raises(LoadError, match=r"model.safetensors is corrupt or truncated"):
        load_model(str(d), progress=False)


def test_error_checkpoint_missing_a_tensor(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    d = _copy_dir(tiny_model_dir, tmp_path)
    sd = load_file(d / "model.safetensors")
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, d / "model.safetensors")
    with pytest.raises(LoadError, match=r"lacks 1 model tensors: model.layers.1.mlp.gate_up_proj"):
        load_model(str(d), progress=False)


def test_error_missing_shard(tiny_model_dir, tmp_path):
    d = _copy_dir(tiny_model_dir, tmp_path, "llama3_tied_sharded")
    next(d.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(LoadError, match="missing shard"):
        load_model(str(d), progress=False)


def test_error_truncated_gguf(tiny_model_dir, tmp_path):
    path = _write_gguf(tiny_model_dir("llama"), tmp_path / "t.gguf")
    data = path.read_bytes()
    cuts = {len(data) - 1000, 100, 10, 3, *range(24, len(data) - 1, max(1, len(data) // 40))}
    for cut in sorted(cuts):
        path.write_bytes(data[:cut])
        with pytest.raises(LoadError, match=r"t\.gguf"):
            load_model(str(path), progress=False)


def test_error_dtype_or_device_that_cannot_run(tiny_model_dir):
    d = str(tiny_model_dir("llama"))
    with pytest.raises(LoadError, match="float8_e4m3fn cannot run on device cpu"):
        load_model(d, dtype=torch.float8_e4m3fn, progress=False)
    with pytest.raises(LoadError, match="not a floating-point dtype"):
        load_model(d, dtype=torch.int8, progress=False)
    if not torch.cuda.is_available():
        with pytest.raises(LoadError, match="CUDA is not available"):
            load_model(d, device="cuda", progress=False)


def test_error_format_mismatch(tiny_model_dir):
    d = str(tiny_model_dir("llama"))
    with pytest.raises(LoadError, match="unknown load format"):
        load_model(d, load_format="pickle", progress=False)
    with pytest.raises(LoadError, match=r"not a .gguf file"):
        load_model(d, load_format="gguf", progress=False)
