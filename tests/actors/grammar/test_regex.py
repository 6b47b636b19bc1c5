"""The regex compiler's separated lists (actors/grammar/regex.py): `X(?:SEP X)*` folded
into one copy of X with a loop back through SEP, and `X+` into one looped copy. The
oracle is Python's `re` (the same syntax and language for these patterns), over every
string of the patterns' alphabet up to a length; and the size they save, on the
any-JSON-object pattern that json_object writes."""

from __future__ import annotations

import itertools
import re

import pytest

from shunter.actors.grammar import json_schema
from shunter.actors.grammar.regex import Nfa
from shunter.actors.grammar.regex_parser import Parser

PATTERNS = [
    "a(?:,a)*",
    "(?:ab|c)(?:-(?:ab|c))*",
    "xa(?:,xa)*",  # X is two items
    "x(?:b|)(?:,x(?:b|))*",  # X may be short
    r"\[(?:a(?:, ?a)*)?\]",
    r"\[(?:(?:a|\[(?:a(?:,a)*)?\])(?:,(?:a|\[(?:a(?:,a)*)?\]))*)?\]",  # nested
    "ba(?:,a)*",  # only the group's tail repeats the item before it
    "a(?:,b)*",  # no repeat of the item: not folded
    "(?:ab)+",
    "a{2,}b",
    "(?:a|)+b",  # a loop whose body matches empty
    "(?:a,)*a",
]
ALPHABET = "ab,-x[] "


def _strings(max_len: int):
    for n in range(max_len + 1):
        for chars in itertools.product(ALPHABET, repeat=n):
            yield "".join(chars)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_folded_lists_match_what_re_matches(pattern):
    nfa = Nfa(pattern, param="regex", max_states=10_000)
    for s in _strings(5):
        assert nfa.fullmatch(s) == bool(re.fullmatch(pattern, s)), (pattern, s)


def test_folding_needs_the_same_text():
    """A separated list of the same item is folded; a different item is not."""
    parse = lambda p: Parser(p, "regex", False, False).parse()[1]  # noqa: E731
    assert parse("xa(?:,xa)*")[0] == "list"
    assert parse("a(?:,b)*")[0] == "cat"
    assert parse("ya(?:,xa)*")[1][-1][0] == "list"  # "a" folds; "y" and "x" differ


def test_any_json_object_grows_twofold_a_level():
    sizes = [Nfa(json_schema.json_object(d), param="regex", max_states=100_000,
                 max_chars=10**6, extensions=True).num_states for d in (1, 2, 3)]  # fmt: skip
    assert sizes[1] < 1000 and sizes[2] < 2.5 * sizes[1], sizes  # 5,130 and 20,714 unfolded
    accepts = Nfa(json_schema.json_object(3), param="regex", max_states=100_000,
                  max_chars=10**6, extensions=True).fullmatch  # fmt: skip
    assert accepts('{"a": [1, {"b": [true, null]}], "c": "d"}')
    assert not accepts('{"a": [1, {"b": [true, null]}, "c": "d"}')
    assert not accepts('{"a": [1, {"b": [true, [null]]}]}')  # four levels deep
