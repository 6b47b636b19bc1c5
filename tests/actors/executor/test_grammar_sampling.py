"""Constrained decoding in the executor core: a row whose sampling params carry a regex
samples only tokens its token automaton allows (actors/grammar/token_fsm.py), ends
with an end-of-sequence id once the pattern is matched whole, and does so through the
overlapped submit/flush order (each step's mask sees the previous step's token)."""

from __future__ import annotations

import msgspec
import pytest
import regex
import torch

from shunter.actors.executor.build import build_core
from shunter.actors.executor.config import ExecutorConfig
from shunter.actors.grammar.token_fsm import GrammarCache, TokenVocab
from tests.actors.executor.test_executor_pipeline import GREEDY, LS, TINY_LLAMA, Builder


def tiny_config(d, device: str = "cpu") -> ExecutorConfig:
    import json

    (d / "config.json").write_text(json.dumps(TINY_LLAMA))
    return ExecutorConfig(model_path=str(d), load_progress=False, device=device,
                          load_format="dummy", seed=5, max_total_tokens=256, page_size=4)  # fmt: skip


EOS = 2
# The tiny model's 512 ids: 3..28 spell a..z, 29..38 the digits, 39 a space, 40 "ab",
# 41 "yes", 42 "no"; the rest add no text (never allowed while a constraint holds).
TEXTS = [None] * 512
for _i, _c in enumerate("abcdefghijklmnopqrstuvwxyz0123456789 "):
    TEXTS[3 + _i] = _c
TEXTS[40], TEXTS[41], TEXTS[42] = "ab", "yes", "no"


def _decode(core, builder, pattern: str, seed: int, steps: int, *, sampling=GREEDY,
            overlap: bool = True) -> list[int]:  # fmt: skip
    params = msgspec.structs.replace(sampling, regex=pattern)
    row = seed % 8
    first = builder.batch([(row, [5, 6, 7])], opens=[(row, f"r{seed}", params, seed)])
    batches = [builder.batch([(row, [LS])]) for _ in range(steps)]
    if overlap:
        results = core.submit(first)
        for b in batches:
            results += core.submit(b)
        results += core.flush()
    else:
        results = [core.step(first)] + [core.step(b) for b in batches]
    assert [r.error for r in results] == [None] * len(results)
    tokens = [r.token_ids[0] for r in results]
    core.step(builder.batch([], closes=[row]))
    return tokens


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def core(request, tmp_path_factory):
    """The tiny model's core on the CPU and, on a GPU, on CUDA: there the mask is applied
    to device logits as the sampler's last stage while the next step is launched."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    c = build_core(tiny_config(tmp_path_factory.mktemp("tiny"), request.param))
    c.grammars = GrammarCache(lambda: TokenVocab(TEXTS, [EOS]))
    return c


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("pattern", ["(yes|no)", "[a-c]{2}[0-9]{1,3} ?x", "(ab){1,4}c"])
def test_every_sampled_token_keeps_the_output_matchable_and_it_ends_when_whole(core, pattern,
                                                                              overlap):  # fmt: skip
    builder = Builder()
    for seed, sampling in ((1, GREEDY), (2, msgspec.structs.replace(GREEDY, temperature=1.0))):
        tokens = _decode(core, builder, pattern, seed, 12, sampling=sampling, overlap=overlap)
        text = ""
        for t in tokens:
            if t == EOS:
                assert regex.fullmatch(pattern, text), (pattern, text)
                break
            assert TEXTS[t] is not None
            text += TEXTS[t]
            assert regex.fullmatch(pattern, text, partial=True), (pattern, text)
        else:
            pytest.fail(f"{pattern!r}: no end in 13 tokens: {text!r}")


def test_a_regex_without_token_texts_fails_the_step_that_opens_it(tmp_path):
    core = build_core(tiny_config(tmp_path))
    core.grammars = None
    b = Builder()
    params = msgspec.structs.replace(GREEDY, regex="a+")
    res = core.step(b.batch([(0, [5, 6])], opens=[(0, "r", params, 1)]))
    assert res.error is not None and "regex" in res.error


def test_a_structural_tag_lets_text_run_free_and_holds_each_call_to_its_shape(core):
    """Trigger "x": free text has no "x"; after one, "y", a digit (the schema: an
    integer 0..9) and "z" must follow. Sampled at temperature 1, the output is always
    a prefix of such a text."""
    from shunter.actors.grammar.structural_tag import structural_tag_regex

    spec = {"triggers": ["x"], "structures": [
        {"begin": "xy", "schema": {"type": "integer", "minimum": 0, "maximum": 9}, "end": "z"}]}  # fmt: skip
    pattern = structural_tag_regex(spec)
    shape = "[^x]*(?:xy[0-9]z[^x]*)*"
    builder = Builder()
    x = TEXTS.index("x")
    sampling = msgspec.structs.replace(GREEDY, temperature=1.0, logit_bias={x: 6.0})
    texts = []
    for seed in range(4):
        tokens = _decode(core, builder, pattern, seed, 16, sampling=sampling)
        text = ""
        for t in tokens:
            if t == EOS:
                assert regex.fullmatch(shape, text), text
                break
            text += TEXTS[t]
            assert regex.fullmatch(shape, text, partial=True), text
        texts.append(text)
    assert any("xy" in t for t in texts), texts  # the bias on "x" opened calls
