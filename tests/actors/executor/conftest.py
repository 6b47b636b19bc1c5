"""Fixtures for the model stack: tiny random HF checkpoints of every family, the
default model, the greedy reference, and a paged greedy loop over the runner."""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

import pytest
import torch

# The machine running the tests is small and shared: one intra-op thread avoids
# parallel regions whose barriers stall on a descheduled sibling thread.
torch.set_num_threads(1)

REFERENCE = pathlib.Path(__file__).resolve().parents[2] / "data" / "smollm2_greedy_reference.json"

_SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              initializer_range=0.15, bos_token_id=1, eos_token_id=2)  # fmt: skip

# name -> (transformers config class name, config kwargs, save kwargs)
TINY_FAMILIES = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False), {}),
    "llama3_tied_sharded": (
        "LlamaConfig",
        dict(
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
        dict(max_shard_size="40KB"),
    ),
    "llama_mha_bias": (
        "LlamaConfig",
        dict(num_key_value_heads=4, attention_bias=True, mlp_bias=True, num_hidden_layers=3),
        {},
    ),
    "mistral_window": ("MistralConfig", dict(sliding_window=7, tie_word_embeddings=False), {}),
    "qwen2_bias_tied": ("Qwen2Config", dict(tie_word_embeddings=True, num_key_value_heads=1), {}),
    "qwen3_qknorm": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=False), {}),
}


def pytest_generate_tests(metafunc):
    """A test taking `family` runs once per tiny family."""
    if "family" in metafunc.fixturenames:
        metafunc.parametrize("family", sorted(TINY_FAMILIES))


def _build_tiny(name: str, root: pathlib.Path) -> pathlib.Path:
    import transformers

    cls_name, kwargs, save = TINY_FAMILIES[name]
    cfg = getattr(transformers, cls_name)(**{**_SIZES, **kwargs})
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    with torch.no_grad():  # norms away from 1 and non-zero biases, so they are exercised
        for pname, p in model.named_parameters():
            if "norm" in pname or pname.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "norm" in pname else 0.0))
    out = root / name
    model.save_pretrained(out, safe_serialization=True, **save)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """name -> directory of a saved tiny random HF checkpoint (built once per session)."""
    root = tmp_path_factory.mktemp("tiny_models")
    cache: dict[str, pathlib.Path] = {}

    def get(name: str) -> pathlib.Path:
        if name not in cache:
            cache[name] = _build_tiny(name, root)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def reference():
    return json.loads(REFERENCE.read_text())


@pytest.fixture(scope="session")
def default_model():
    from shunter.actors.executor.loader import load_model

    return load_model(None, progress=False)


@dataclass
class GreedyResult:
    tokens: list[list[int]]  # per entry, the generated ids
    logprobs: list[list[torch.Tensor]]  # per entry, per step [vocab] float32 log-softmax


def paged_greedy(
    runner,
    prompts: list[list[int]],
    max_new_tokens: int | list[int],
    *,
    eos_token_id: int | None = None,
    first_page: int = 0,
    prefill_chunks: int = 1,
) -> GreedyResult:
    """Greedy decoding of all prompts in lockstep through `runner` (one forward per
    step with every unfinished entry). Pages are handed out in a scattered order so
    rows are not contiguous in the pool. prefill_chunks > 1 splits each prompt's
    prefill into that many extend steps (cached-prefix path)."""
    pool = runner.kv_pool
    n = len(prompts)
    limits = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * n
    pages_per_row = [-(-(len(p) + m) // pool.page_size) for p, m in zip(prompts, limits)]
    total = sum(pages_per_row)
    if first_page + total > pool.num_pages:
        raise ValueError("pool too small for this test")
    # interleave: row r takes pages first_page + r, + r + n, ... (scattered, disjoint)
    order = list(range(first_page, first_page + total))
    order = order[::2] + order[1::2]
    tables, k = [], 0
    for need in pages_per_row:
        pages = order[k : k + need]
        k += need
        tables.append(pool.slots_of_pages(pages, need * pool.page_size))
    from shunter.actors.executor.runner import ForwardInput

    out = GreedyResult([[] for _ in prompts], [[] for _ in prompts])
    lens = [0] * n
    pending = [list(p) for p in prompts]  # tokens each row must feed next
    chunked = [
        [
            p[i * len(p) // prefill_chunks : (i + 1) * len(p) // prefill_chunks]
            for i in range(prefill_chunks)
        ]
        for p in prompts
    ]
    step = 0
    while True:
        live = [r for r in range(n) if len(out.tokens[r]) < limits[r]
                and not (out.tokens[r] and out.tokens[r][-1] == eos_token_id)]  # fmt: skip
        if not live:
            return out
        feeds = []
        for r in live:
            if step < prefill_chunks:
                feeds.append([t for t in chunked[r][step]] or [])
            else:
                feeds.append(pending[r])
        use = [(r, f) for r, f in zip(live, feeds) if f]
        inp = ForwardInput.build([f for _, f in use], [lens[r] for r, _ in use],
                                 [tables[r] for r, _ in use])  # fmt: skip
        logits = runner.forward(inp)
        for i, (r, f) in enumerate(use):
            lens[r] += len(f)
            if step < prefill_chunks - 1:
                continue
            lp = torch.log_softmax(logits[i], -1)
            tok = int(logits[i].argmax())
            out.tokens[r].append(tok)
            out.logprobs[r].append(lp)
            pending[r] = [tok]
        step += 1


@pytest.fixture(scope="session")
def greedy():
    return paged_greedy
