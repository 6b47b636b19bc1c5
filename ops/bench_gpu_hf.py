"""HF transformers beside our executor in `shunter bench executor --device cuda`.

Theory of operation: our model fuses q/k/v into `qkv_proj` (rows: q, then k, then v)
and gate/up into `gate_up_proj` (rows: gate, then up); `hf_state_dict` splits them
back into HF checkpoint names, so a transformers LlamaForCausalLM built from the same
config.json carries exactly our weights (dummy or real). HF then runs `generate`
(greedy, sdpa): its decode rate is taken as the difference between a run of N new
tokens and a run of 1 (the prefill), over N - 1 steps, so its prefill is not counted
against it (ours is not either).

Invariants: `hf_state_dict` is the inverse of `LlamaForCausalLM.load_weights`: loading
its output into a fresh model of the same config reproduces every parameter; it
returns views of our parameters (no copy), so the caller copies them where it wants.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import torch

from shunter.actors.executor.models.llama import LlamaForCausalLM

# our fused parameter -> (HF names of its parts in row order, which size each has)
_SPLITS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def hf_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """Our parameters under HF checkpoint names (views, not copies). Raises ValueError
    for a model whose projections were repacked (weight_format other than "none")."""
    c = model.config
    sizes = {
        "self_attn.qkv_proj": [c.q_size, c.kv_size, c.kv_size],
        "mlp.gate_up_proj": [c.intermediate_size, c.intermediate_size],
    }
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        t = p.detach()
        fused = next((f for f in _SPLITS if f".{f}." in name), None)
        if fused is None:
            out[name] = t
            continue
        if t.shape[0] != sum(sizes[fused]):
            raise ValueError(f"{name} has {t.shape[0]} rows, expected {sum(sizes[fused])}")
        for hf_part, piece in zip(_SPLITS[fused], t.split(sizes[fused], 0), strict=True):
            out[name.replace(fused, hf_part)] = piece
    if model.lm_head is None:  # tied: HF's state dict still names the head
        out["lm_head.weight"] = model.model.embed_tokens.weight.detach()
    if not any(".qkv_proj." in n or ".q_proj." in n for n in out):
        raise ValueError("model projections are repacked; use weight_format 'none'")
    return out


def build_hf(config_dict: dict[str, Any], ours: LlamaForCausalLM) -> torch.nn.Module:
    """A transformers LlamaForCausalLM (sdpa) from config.json's dict, holding a copy of
    `ours`'s weights, on ours's device and in ours's dtype."""
    import transformers

    w = ours.model.embed_tokens.weight
    cfg = transformers.LlamaConfig.from_dict(config_dict)
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM._from_config(
            cfg, attn_implementation="sdpa", dtype=w.dtype
        )
    # allocate on the device (no init pass over 8B random numbers), then copy ours in
    hf = hf.to_empty(device=w.device).to(w.dtype)
    missing, unexpected = hf.load_state_dict(hf_state_dict(ours), strict=False)
    missing = [m for m in missing if "rotary_emb" not in m]
    if missing or unexpected:
        raise ValueError(f"HF model: missing {missing[:4]}, unexpected {unexpected[:4]}")
    _reset_rotary(hf, cfg, w.device)
    hf.generation_config = transformers.GenerationConfig(
        do_sample=False, eos_token_id=None, pad_token_id=0, bos_token_id=None
    )
    return hf.eval().requires_grad_(False)


def _reset_rotary(hf: torch.nn.Module, cfg: Any, device: torch.device) -> None:
    """to_empty left the rotary inv_freq buffers uninitialised: rebuild each rotary module."""
    for parent in list(hf.modules()):
        for child_name, child in list(parent.named_children()):
            if type(child).__name__.endswith("RotaryEmbedding"):
                setattr(parent, child_name, type(child)(cfg).to(device))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def hf_generate(hf: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy `generate` of `new_tokens` tokens for equal-length prompts (no padding)."""
    dev = next(hf.parameters()).device
    ids = torch.tensor(prompts, device=dev)  # [B, L] int64
    out = hf.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
        min_new_tokens=new_tokens, do_sample=False,
    )  # fmt: skip
    return out[:, ids.shape[1] :].tolist()


def hf_decode_rate(
    hf: torch.nn.Module, prompts: list[list[int]], new_tokens: int
) -> tuple[float, list[list[int]]]:
    """(decode tok/s, greedy tokens): B * (N - 1) / (time of N new tokens - time of 1);
    where noise makes the difference vanish (toy sizes), B * N / time of N."""
    dev = next(hf.parameters()).device
    hf_generate(hf, prompts, 2)  # warm-up
    _sync(dev)
    t0 = time.perf_counter()
    hf_generate(hf, prompts, 1)
    _sync(dev)
    t_one = time.perf_counter() - t0
    t0 = time.perf_counter()
    toks = hf_generate(hf, prompts, new_tokens)
    _sync(dev)
    t_all = time.perf_counter() - t0
    if t_all > 1.5 * t_one:
        return len(prompts) * (new_tokens - 1) / (t_all - t_one), toks
    return len(prompts) * new_tokens / t_all, toks


def leading_agreement(a: list[int], b: list[int]) -> int:
    """How many tokens two greedy sequences share before they first differ."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def compare_hf(
    config_dict: dict[str, Any], ours: LlamaForCausalLM, figures: dict,
    prompts_by_bs: dict[int, list[list[int]]], batch_sizes: list[int], new_tokens: int,
    say: Callable[[str], None],
) -> dict:  # fmt: skip
    """HF's decode tok/s at each batch size on the prompts ours ran, our ratio (from
    figures["decode_tok_s_bs{B}"]) and, at bs=1, how many greedy tokens agree."""
    t0 = time.perf_counter()
    hf = build_hf(config_dict, ours)
    say(f"hf: built with our weights in {time.perf_counter() - t0:.1f} s")
    out: dict = {}
    try:
        for bs in batch_sizes:
            rate, toks = hf_decode_rate(hf, prompts_by_bs[bs], new_tokens)
            ratio = figures[f"decode_tok_s_bs{bs}"] / rate
            out[f"hf_decode_tok_s_bs{bs}"], out[f"decode_bs{bs}_vs_hf"] = rate, ratio
            line = f"hf generate bs={bs} ({new_tokens} new tokens): {rate:.1f} tok/s, ours x{ratio:.2f}"
            if bs == 1 and "bs1_tokens" in figures:
                agree = leading_agreement(figures["bs1_tokens"], toks[0])
                out["bs1_greedy_agree_tokens"] = agree
                line += f" (greedy tokens agree for the first {agree})"
            say(line)
    finally:
        del hf
        gc.collect()
    return out
