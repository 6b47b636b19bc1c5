"""EBNF grammars as regular expressions (actors/grammar/ebnf.py): what a grammar derives
matches whole (checked with the constraint's own NFA and with Python's re, whose
syntax the pattern keeps to), nothing else does; recursion unrolls a bounded number of
levels, fewer where the automaton would be too large; malformed grammars are
ValueErrors that say where."""

from __future__ import annotations

import json
import re

import pytest

from shunter.actors.grammar.ebnf import MAX_RECURSION, ebnf_regex
from shunter.actors.grammar.token_fsm import constraint_nfa

CAPITALS = """
root ::= city | description
city ::= "London" | "Paris" | "Berlin" | "Rome"
description ::= city " is " status
status ::= "the capital of " country
country ::= "England" | "France" | "Germany" | "Italy"
"""


def _accepts(grammar: str):
    pattern = ebnf_regex(grammar)
    nfa = constraint_nfa(pattern)
    return lambda text: nfa.fullmatch(text) and bool(re.fullmatch(pattern, text))


def test_the_capitals_grammar_derives_its_sentences_and_nothing_else():
    accepts = _accepts(CAPITALS)
    for text in ("Paris", "Rome is the capital of Italy", "Berlin is the capital of England"):
        assert accepts(text), text
    for text in ("Madrid", "Paris is", "Paris is the capital of France.", ""):
        assert not accepts(text), text


def test_classes_repeats_escapes_comments_and_rules_over_several_lines():
    grammar = r"""
# a list of lowercase words, then a code
root ::= word ( ", " word ){0,3} ws code  # the list
word ::= [a-z]+
ws   ::= [ \t]
code ::= 'id-' [0-9]{2,3} ( "\x21" | "\u00e9" )?
     | "\"q\"" [^\n"]*
"""
    accepts = _accepts(grammar)
    for text in ("a, bc id-12", "x\tid-123!", "x id-99é", 'a, b, c, d "q" anything'):
        assert accepts(text), text
    for text in ("A id-12", "a, b, c, d, e id-12", "a id-1", "a id-1234", 'a "q" x"y', "a"):
        assert not accepts(text), text


def test_recursion_unrolls_max_recursion_levels_and_keeps_the_branches_that_end():
    accepts = _accepts('root ::= "(" root ")" | "x"')
    depth = [k for k in range(8) if accepts("(" * k + "x" + ")" * k)]
    assert depth == list(range(MAX_RECURSION + 1))
    accepts = _accepts('root ::= item ("," item)*\nitem ::= [0-9] | "[" root? "]"')
    assert accepts("1,[2,[]],3") and not accepts("1,,2") and not accepts("[1")


def test_a_grammar_too_large_to_unroll_fully_is_unrolled_less():
    value = ("root ::= value\nvalue ::= object | array | [0-9]+ | \"null\"\n"
             "object ::= \"{\" ( string \":\" value (\",\" string \":\" value)* )? \"}\"\n"
             "array ::= \"[\" ( value (\",\" value)* )? \"]\"\n"
             "string ::= \"\\\"\" [a-z]* \"\\\"\"\n")  # fmt: skip
    accepts = _accepts(value)
    assert accepts(json.dumps({"a": [1, {"b": None}]}, separators=(",", ":")).replace(" ", ""))


@pytest.mark.parametrize(
    ("grammar", "words"),
    [
        ('root ::= "a" other', "'other', which is not defined"),
        ('start ::= "a"', "no 'root' rule"),
        ('root ::= "a"\nroot ::= "b"', "defined twice"),
        ('root ::= "a\\q"', "unknown escape"),
        ('root ::= "abc', "unterminated"),
        ("root ::= [b-a]", "bad range"),
        ('root ::= "a"{3,1}', "below the minimum"),
        ('root ::= "a" root', "no way to end"),
        ('root ::= ""', "only the empty text"),
        ('root ::= "a" ) "b"', "unexpected ')'"),
        ('garbage\nroot ::= "a"', "rules of the form"),
        ("", "non-empty"),
    ],
)
def test_malformed_grammars_are_refused_with_where_and_why(grammar, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        ebnf_regex(grammar)


def test_a_grammar_that_doubles_at_every_rule_is_refused_quickly():
    import time

    bomb = "root ::= a1\n" + "".join(f"a{i} ::= a{i + 1} a{i + 1}\n" for i in range(1, 40))
    start = time.monotonic()
    with pytest.raises(ValueError, match="passes"):
        ebnf_regex(bomb + 'a40 ::= "x"\n')
    assert time.monotonic() - start < 10  # 2**39 copies were never written


def test_deep_nesting_is_a_clear_error_not_a_recursion_error():
    from shunter.actors.grammar.regex import Nfa

    with pytest.raises(ValueError, match="nested more than"):
        constraint_nfa("(" * 3000 + "a" + ")" * 3000)
    with pytest.raises(ValueError, match="nested more than"):
        Nfa("(" * 450 + "a" + ")" * 450, param="stop_regex", max_states=500)
    chain = "".join(f"b{i} ::= b{i + 1}\n" for i in range(1, 1300))
    with pytest.raises(ValueError, match="refer to each other more than"):
        ebnf_regex("root ::= b1\n" + chain + 'b1300 ::= "x"\n')
