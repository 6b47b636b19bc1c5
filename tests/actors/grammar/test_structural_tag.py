"""Structural tags (actors/grammar/structural_tag.py): free text in which no trigger
occurs, and wherever a trigger does, a structure's begin, a JSON value of its schema
and its end; checked with the constraint's own NFA (its `(?A:...)` free-text group is
checked against brute force over short texts). The format-object form
(structural_format.py): each format type's texts and not others, nested formats, the
flags of triggered_tags and tags_with_separator, free text stopping at its tag's end,
and refusals that name the offending node's path; checked with the NFA and, where the
pattern keeps to its syntax, Python's re as well."""

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


# ---- the format-object form (actors/grammar/structural_format.py) --------------------


def _const(value):
    return {"type": "const_string", "value": value}


def _tag(begin, content, end):
    return {"type": "tag", "begin": begin, "content": content, "end": end}


CALL = _tag(
    "<function=get_weather>", {"type": "json_schema", "json_schema": WEATHER}, "</function>"
)
NOW = _tag(
    "<function=now>", {"type": "json_schema", "json_schema": {"type": "null"}}, "</function>"
)
PARIS, ROME = '<function=get_weather>{"city": "Paris"}</function>', "<function=now>null</function>"


def _accepts(fmt):
    """Whether a text matches the format whole, by the constraint's own automaton, and
    by Python's re as well where the pattern keeps to its syntax (no `(?A:...)` group)."""
    pattern = structural_tag_regex({"type": "structural_tag", "format": fmt})
    nfa = constraint_nfa(pattern)
    plain = re.compile(pattern) if "(?A:" not in pattern and "(?J:" not in pattern else None

    def accepts(text: str) -> bool:
        verdict = nfa.fullmatch(text)
        if plain is not None:
            assert bool(plain.fullmatch(text)) == verdict, text
        return verdict

    return accepts


def _assert_takes(fmt, good, bad):
    accepts = _accepts(fmt)
    for text in good:
        assert accepts(text), text
    for text in bad:
        assert not accepts(text), text


@pytest.mark.parametrize(
    ("fmt", "good", "bad"),
    [
        (_const("Answer: "), ["Answer: "], ["Answer:", "answer: ", "Answer: x", ""]),
        (_const(""), [""], ["x"]),
        ({"type": "json_schema", "json_schema": WEATHER}, ['{"city": "Paris"}', '{"city":"Rome"}'],
         ["{}", '{"city": 1}', ' {"city": "Paris"}']),
        ({"type": "json_schema", "json_schema": True}, ["1", '{"a": [true]}'], ["nope"]),
        ({"type": "grammar", "grammar": 'root ::= ("yes" | "no") "!"?'}, ["yes", "no!"],
         ["maybe", "yes!!"]),
        ({"type": "regex", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, ["ABC-1234"], ["AB-1234", "ABC-1234$"]),
        ({"type": "regex", "pattern": "a|b"}, ["a", "b"], ["ab", ""]),
        ({"type": "any_text"}, ["", "anything\n<at all>", "</function>"], []),
        ({"type": "any_text", "excludes": ["<f", "STOP"]}, ["", "a < f", "STO P"],
         ["a<fb", "STOP", "xSTOPy"]),
        ({"type": "or", "elements": [_const("yes"), {"type": "regex", "pattern": "[0-9]+"}]},
         ["yes", "42"], ["yes42", ""]),
        ({"type": "optional", "content": _const("x")}, ["", "x"], ["xx"]),
        ({"type": "plus", "content": _const("ab")}, ["ab", "abab"], ["", "aba"]),
        ({"type": "star", "content": _const("ab")}, ["", "ab", "ababab"], ["a"]),
        ({"type": "repeat", "min": 2, "max": 3, "content": _const("a")}, ["aa", "aaa"], ["a", "aaaa"]),
        ({"type": "repeat", "min": 2, "max": -1, "content": _const("a")}, ["aa", "a" * 9], ["a"]),
        (_tag("<think>", {"type": "any_text"}, "</think>"), ["<think></think>", "<think>a < b</think>"],
         ["<think>x</think>y</think>", "<think>x", "x<think></think>"]),
        (_tag("<t>", {"type": "any_text"}, ["</a>", "</b>"]), ["<t>x</a>", "<t>x</b>"],
         ["<t>x</a>y</b>", "<t>x</c>"]),
        (_tag("<r>", {"type": "json_schema", "json_schema": {"type": "integer"}}, ""), ["<r>12"],
         ["<r>", "<r>1.5"]),
    ],
)  # fmt: skip
def test_each_format_type_takes_its_texts_and_no_others(fmt, good, bad):
    _assert_takes(fmt, good, bad)


def test_sequence_of_a_const_string_and_an_or():
    fmt = {"type": "sequence", "elements": [
        _const("Answer: "), {"type": "or", "elements": [_const("yes"), _const("no")]}]}  # fmt: skip
    _assert_takes(fmt, ["Answer: yes", "Answer: no"], ["Answer: maybe", "yes", "Answer: yesno"])


def _triggered(**flags):
    return {"type": "triggered_tags", "triggers": ["<function="], "tags": [CALL, NOW], **flags}


@pytest.mark.parametrize(
    ("flags", "good", "bad"),
    [
        ({}, ["", "Just prose.", f"Sure. {PARIS} and {ROME}!", PARIS + ROME, "a < b, function="],
         ["<function=", "<function=lookup>{}</function>", '<function=get_weather>{"city": 1}</function>']),
        ({"at_least_one": True}, [PARIS, f"{PARIS} then prose {ROME}", f"{ROME}{PARIS} end"],
         ["", "prose first " + PARIS, "prose"]),
        ({"stop_after_first": True}, ["", "prose", "prose " + PARIS, PARIS],
         [PARIS + " after", PARIS + ROME]),
        ({"at_least_one": True, "stop_after_first": True}, [PARIS, ROME],
         ["", "x" + PARIS, PARIS + "x", PARIS + ROME]),
        ({"excludes": ["<|end|>"]}, ["a" + PARIS + "b"], ["a<|end|>", PARIS + "<|end|>"]),
    ],
)  # fmt: skip
def test_triggered_tags_hold_each_call_to_its_schema_and_keep_to_their_flags(flags, good, bad):
    _assert_takes(_triggered(**flags), good, bad)


def test_the_old_form_is_triggered_tags_of_json_schema_contents():
    old = constraint_nfa(structural_tag_regex(SPEC)).fullmatch
    new = _accepts(_triggered())
    for text in (
        "",
        "prose",
        PARIS,
        f"x{ROME}y{PARIS}",
        "<function=",
        "<function=now>1</function>",
    ):
        assert old(text) == new(text), text


@pytest.mark.parametrize(
    ("flags", "good", "bad"),
    [
        ({}, ["", "<a>1</a>", "<a>1</a>,<b>x</b>", "<b>x</b>,<b>y</b>,<a>22</a>"],
         ["<a>1</a><b>x</b>", " <a>1</a>", "<a>1</a>,", "<a>x</a>"]),
        ({"at_least_one": True}, ["<a>1</a>", "<a>1</a>,<b>x</b>"], ["", ","]),
        ({"stop_after_first": True}, ["", "<a>1</a>", "<b>x</b>"], ["<a>1</a>,<b>x</b>"]),
        ({"at_least_one": True, "stop_after_first": True}, ["<a>1</a>", "<b></b>"],
         ["", "<a>1</a>,<a>2</a>"]),
    ],
)  # fmt: skip
def test_tags_with_separator_keep_to_their_flags(flags, good, bad):
    fmt = {"type": "tags_with_separator", "separator": ",", **flags, "tags": [
        _tag("<a>", {"type": "regex", "pattern": "[0-9]+"}, "</a>"),
        {"begin": "<b>", "content": {"type": "any_text"}, "end": "</b>"}]}  # fmt: skip
    _assert_takes(fmt, good, bad)


def test_free_text_inside_a_tag_stops_at_its_end_and_nested_tags_keep_their_own():
    reasoning = _tag("<think>", {"type": "any_text"}, "</think>")
    _assert_takes({"type": "sequence", "elements": [reasoning, _triggered()]},
                  ["<think>hmm</think>", f"<think>a</think>prose {PARIS}", f"<think></think>{ROME}!"],
                  ["prose", f"<think>a</think>{PARIS[:-3]}", "x<think>a</think>", "<think>a"])  # fmt: skip
    wrapped = _tag("<r>", _triggered(), "</r>")  # the free text stops at </r>
    _assert_takes(wrapped, ["<r></r>", f"<r>hi {PARIS} bye</r>"], ["<r>a</r>b</r>", "<r>a"])
    inner = _tag("<r>", {"type": "sequence", "elements": [
        _tag("<i>", {"type": "any_text"}, "</i>"), {"type": "any_text"}]}, "</r>")  # fmt: skip
    _assert_takes(inner, ["<r><i>a</r></i>b</r>", "<r><i>a</i></i>b</r>"],
                  ["<r><i>a</i>b</r>c</r>", "<r><i>a</r>"])  # fmt: skip


@pytest.mark.parametrize(
    ("loop", "good", "bad"),
    [(True, ["", "x", "x<f=a>1 y <f=b>ok!z"], ["<f=a>x"]), (False, ["", "x<f=a>12"], ["x<f=a>1y"])],
)  # fmt: skip
def test_dispatch_holds_what_follows_each_pattern(loop, good, bad):
    fmt = {"type": "dispatch", "loop": loop, "rules": [
        ["<f=a>", {"type": "regex", "pattern": "[0-9]+"}], ["<f=b>", _const("ok!")]]}  # fmt: skip
    _assert_takes(fmt, good, bad)


def _seq(*elements):
    return {"type": "sequence", "elements": list(elements)}


@pytest.mark.parametrize(
    ("fmt", "words"),
    [
        ("a string", "format must be a format object"),
        ({"type": "sequence", "elements": []}, "format.elements must be a non-empty list"),
        (_seq(_const("a"), {"type": "sparkle"}), "format.elements[1].type 'sparkle' is not a format type"),
        (_seq(_const("a"), _const("b"), _triggered(tags=[{"begin": 5, "content": _const("x"), "end": ""}])),
         "format.elements[2].tags[0].begin must be a string"),
        (_triggered(tags=[_tag("<call>", _const("x"), "")]),
         "format.tags[0].begin '<call>' starts with none of the triggers"),
        ({**_triggered(), "triggers": ["<f", "<function="]}, "format.tags[0].begin '<function=get_weather>' "
         "starts with more than one"),
        ({"type": "token", "token": "<|tool|>"}, "format.type 'token' is a token-level format"),
        (_tag({"type": "token", "token": 7}, _const("x"), "</t>"), "format.begin is a token format"),
        ({"type": "any_text", "max_tokens": 64}, "format.max_tokens is not supported"),
        (_tag("<t>", {"type": "json_schema", "json_schema": {"type": "date"}}, "</t>"),
         "format.content.json_schema: json_schema: unknown type 'date'"),
        ({"type": "json_schema", "json_schema": WEATHER, "style": "qwen_xml"}, "format.style 'qwen_xml'"),
        ({"type": "json_schema", "json_schema": WEATHER, "any_order": True}, "format.any_order"),
        ({"type": "regex", "pattern": "a(?=b)"}, "format.pattern 'a(?=b)': lookaround"),
        ({"type": "regex", "pattern": "(?A:x)"}, "format.pattern"),
        ({"type": "grammar", "grammar": "root ::= a"}, "format.grammar: ebnf: rule 'root' refers to 'a'"),
        ({"type": "repeat", "min": 3, "max": 2, "content": _const("a")}, "format.max must be -1"),
        ({"type": "repeat", "min": True, "max": 2, "content": _const("a")}, "format.min must be an integer"),
        ({"type": "optional"}, "format.content is required"),
        (_tag("<t>", _const("x"), []), "format.end must be a string or a non-empty list"),
        ({"type": "tags_with_separator", "separator": ",", "tags": [{**CALL, "type": "or"}]},
         "format.tags[0].type must be 'tag'"),
        ({"type": "dispatch", "rules": [["", _const("x")]]}, "format.rules[0][0] must be a non-empty"),
        ({"type": "triggered_tags", "triggers": [], "tags": [CALL]}, "format.triggers must be a non-empty"),
        ({"type": "plus", "content": {"type": "repeat", "min": 2000, "max": -1, "content": _const("a")}},
         "format.content repeat counts are limited"),
        ({"type": "repeat", "min": 900, "max": 900, "content": {"type": "json_schema", "json_schema": WEATHER}},
         "format: regex: the pattern is too large"),
    ],
)  # fmt: skip
def test_malformed_formats_are_refused_naming_the_path(fmt, words):
    with pytest.raises(ValueError, match=re.escape("structural_tag: " + words)):
        structural_tag_regex({"type": "structural_tag", "format": fmt})


def test_nesting_is_bounded():
    fmt = _const("x")
    for _ in range(40):
        fmt = {"type": "optional", "content": fmt}
    with pytest.raises(ValueError, match="more than 32 deep"):
        structural_tag_regex({"format": fmt})
