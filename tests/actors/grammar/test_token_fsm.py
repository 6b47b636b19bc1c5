"""Token-level automata (actors/grammar/token_fsm.py) against the `regex` package's
partial matching: a token is allowed after an output prefix iff the prefix and the
token's text can still grow into a whole match; end-of-sequence iff the prefix
matches whole. Random patterns over a small vocabulary, and the real SmolLM2
vocabulary with a JSON-like pattern."""

from __future__ import annotations

import random

import numpy as np
import pytest
import regex

from shunter.actors.grammar.token_fsm import DEAD, TokenFsm, TokenVocab

TEXTS = ["a", "b", "c", "ab", "ba", "abc", " ", "1", "12", "x", None, "\n", "a b"]
EOS = 10  # the None above stands for an end-of-sequence id


def _oracle(pattern: str, prefix: str, vocab: TokenVocab) -> np.ndarray:
    want = np.zeros(len(vocab.texts), dtype=bool)
    for i, t in enumerate(vocab.texts):
        if t:
            want[i] = regex.fullmatch(pattern, prefix + t, partial=True) is not None
    want[vocab.eos_ids] = regex.fullmatch(pattern, prefix) is not None
    if not want.any():
        want[vocab.eos_ids] = True
    return want


def _walk(fsm: TokenFsm, pattern: str, vocab: TokenVocab, rng, steps: int) -> None:
    """Random allowed tokens from the start; every mask on the way equals the oracle's."""
    state, prefix = fsm.initial, ""
    for _ in range(steps):
        mask = fsm.allowed(state)
        assert np.array_equal(mask, _oracle(pattern, prefix, vocab)), (pattern, prefix)
        choices = [i for i in np.nonzero(mask)[0] if i != EOS]
        if not choices:
            break
        tok = rng.choice(choices)
        state, prefix = fsm.advance(state, tok), prefix + TEXTS[tok]
        assert state != DEAD


@pytest.mark.parametrize(
    "pattern", ["(ab)+c", "a|b|c", "[ab]*c?", "\\d{1,3}", "a.b", "(a b|x)+\\n"]
)
def test_masks_follow_partial_matches_along_random_outputs(pattern):
    vocab = TokenVocab(TEXTS, [EOS])
    fsm = TokenFsm(pattern, vocab)
    rng = random.Random(3)
    for _ in range(20):
        _walk(fsm, pattern, vocab, rng, 6)


def test_random_patterns_agree_with_partial_matching():
    rng = random.Random(11)
    atoms = ["a", "b", "c", "[ab]", "[^a]", "(ab|c)", "\\d", " ", "."]
    quants = ["", "", "*", "+", "?", "{2}", "{1,2}"]
    vocab = TokenVocab(TEXTS, [EOS])
    for _ in range(60):
        pattern = "".join(rng.choice(atoms) + rng.choice(quants) for _ in range(rng.randint(1, 4)))
        _walk(TokenFsm(pattern, vocab), pattern, vocab, rng, 4)


def test_a_token_the_state_did_not_allow_leads_to_dead_and_eos_changes_nothing():
    fsm = TokenFsm("ab", TokenVocab(TEXTS, [EOS]))
    s = fsm.advance(fsm.initial, TEXTS.index("a"))
    assert fsm.advance(s, TEXTS.index("c")) == DEAD
    assert fsm.advance(s, EOS) == s and not fsm.accepting(s)
    assert fsm.accepting(fsm.advance(s, TEXTS.index("b")))


def test_the_real_vocabulary_spells_a_json_answer(codec):
    """SmolLM2's 49,152 tokens: texts by prefix decoding, then a JSON-shaped pattern."""
    tk = codec.tk
    vocab = TokenVocab.from_decoder(
        lambda batch: tk.decode_batch(batch, skip_special_tokens=True), codec.vocab_size,
        codec.eos_token_ids, prefix_id=codec.encode("a", add_special_tokens=False)[0],
    )  # fmt: skip
    assert vocab.texts[codec.encode(" the", add_special_tokens=False)[0]] == " the"
    pattern = r'\{"answer": "(yes|no)", "score": \d{1,2}\}'
    fsm = TokenFsm(pattern, vocab)
    state = fsm.initial
    for tok in codec.encode('{"answer": "yes", "score": 42}', add_special_tokens=False):
        assert fsm.allowed(state)[tok], codec.decode([tok])
        state = fsm.advance(state, tok)
    assert fsm.accepting(state) and fsm.allowed(state)[codec.eos_token_ids].all()
    allowed = np.nonzero(fsm.allowed(fsm.initial))[0]
    assert all(vocab.texts[i] and '{"answer": "'.startswith(vocab.texts[i][:12]) for i in allowed)
