"""Structural tags (actors/grammar/structural_tag.py): free text in which no trigger
occurs, and wherever a trigger does, a structure's begin, a JSON value of its schema
and its end; checked with the constraint's own NFA (its `(?A:...)` free-text group is
checked against brute force over short texts)."""

from __future__ import annotations

import itertools
import re

import pytest

from shunter.actors.grammar.structural_tag import structural_tag_regex
from shunter.actors.grammar.token_fsm import constraint_nfa

WEATHER = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}
SPEC = {"type": "structural_tag", "triggers": ["<function="],
        "structures": [{"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"},
                       {"begin": "<function=now>", "schema": {"type": "null"}, "end": "</function>"}]}  # fmt: skip


def test_free_text_and_calls_held_to_their_schema():
    accepts = constraint_nfa(structural_tag_regex(SPEC)).fullmatch
    for text in ("", "Just prose, no call.", 'Sure. <function=get_weather>{"city": "Paris"}</function>',
                 '<function=now>null</function> then <function=get_weather>{"city":"Rome"}</function>!',
                 "a < b, function= and <function but never the trigger"):  # fmt: skip
        assert accepts(text), text
    for text in ("<function=", "<function=get_weather>{}</function>", "<function=lookup>{}</function>",
                 '<function=get_weather>{"city": "Paris"}', '<function=now>1</function>'):  # fmt: skip
        assert not accepts(text), text


@pytest.mark.parametrize(
    "words", [["ab"], ["aa"], ["abc", "bcd", "c"], ["he", "she", "his", "hers"]]
)
def test_the_free_text_group_takes_exactly_the_texts_without_a_word(words):
    nfa = constraint_nfa("(?A:" + "|".join(re.escape(w) for w in words) + ")")
    alphabet = sorted(set("".join(words)) | {"x"})
    for n in range(7):
        for chars in itertools.product(alphabet, repeat=n):
            text = "".join(chars)
            assert nfa.fullmatch(text) == (not any(w in text for w in words)), text


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ({"structures": SPEC["structures"]}, "triggers"),
        ({"triggers": ["<f"], "structures": []}, "structures"),
        ({"triggers": ["<f"], "structures": [{"begin": "[x]", "schema": {}, "end": ""}]}, "none of the triggers"),
        ({"triggers": ["<f"], "structures": [{"begin": "<f>", "schema": {"type": "date"}}]}, "unknown type"),
        ("{nope", "structural_tag is not valid JSON"),
    ],
)  # fmt: skip
def test_malformed_specs_are_refused_with_the_reason(spec, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        structural_tag_regex(spec)


def test_the_avoid_group_takes_literal_words_only():
    for bad, words in (
        ("(?A:a.b)", "literal words"),
        ("(?A:a||b)", "empty"),
        ("(?A:ab", "missing"),
    ):
        with pytest.raises(ValueError, match=words):
            constraint_nfa(bad)
