"""Stop regexes (actors/tokenizer/stop_regex.py) against Python's `re`: the first
character where some match of the pattern ends, and the earliest start of a match
ending there, for every pattern and text here and for random ones; fed whole or in
pieces. Refused syntax is refused with its reason; hostile patterns stay linear."""

from __future__ import annotations

import random
import re

import pytest

from shunter.actors.tokenizer.stop_regex import MAX_STATES, RegexScanner, StopRegex


def _first_match(pattern: str, text: str) -> tuple[int, int] | None:
    """The reference: the smallest end e with some text[s:e] matching the pattern
    whole, and the smallest such s (s = 0 for a pattern anchored with ^)."""
    rx = re.compile(pattern.removeprefix("^"))
    starts = [0] if pattern.startswith("^") else None
    for e in range(1, len(text) + 1):
        for s in starts if starts is not None else range(e):
            if rx.fullmatch(text, s, e):
                return s, e
    return None


def _scan(pattern: str, pieces: list[str]) -> tuple[int, int] | None:
    scanner = RegexScanner(StopRegex(pattern))
    for piece in pieces:
        hit = scanner.feed(piece)
        if hit is not None:
            return hit
    return None


CASES = [
    ("abc", "xxabcabc"),
    ("a|bc", "zzbcza"),
    ("ab*c", "xacxabbbc"),
    ("(ab)+c", "abababc"),
    ("a.c", "a\ncabc"),
    ("[0-9]{3}", "ab12x345"),
    ("[^a-z ]+", "hello World"),
    ("\\d+\\.\\d", "v 12.5"),
    ("\\w+@\\w+", "mail me: bob@example"),
    ("\\s\\s", "a b  c"),
    ("x{2,3}y", "xyxxxxy"),
    ("x{2,}y", "xyxxxxxy"),
    ("(?:foo|bar)baz", "foobarbaz"),
    ("(?P<tag>END)", "the END."),
    ("^The", "The end"),
    ("^end", "The end"),
    ("a+?b", "caaab"),
    ("[\\]\\-]x", "a-x"),
    ("\\x41\\u00e9", "zAé"),
    ("[a\\-z]", "--"),
    ("\\.\\*", "a.*b"),
    ("Observation:", "Thought: x\nObservation: y"),
    ("(a|ab)(c|bcd)", "abcd"),
    ("a{0,2}b", "aaab"),
    ("[\\b]", "x\by"),
]


@pytest.mark.parametrize(("pattern", "text"), CASES)
def test_the_first_match_to_end_is_what_re_finds(pattern, text):
    want = _first_match(pattern, text)
    assert _scan(pattern, [text]) == want
    assert _scan(pattern, list(text)) == want  # one character at a time


def test_random_patterns_and_texts_agree_with_re():
    rng = random.Random(7)
    atoms = ["a", "b", "c", ".", "[ab]", "[^a]", "(a|bc)", "(?:ab)", "\\w", "\\s", "\\d"]
    quants = ["", "", "*", "+", "?", "{2}", "{1,3}", "{2,}"]
    checked = 0
    for _ in range(400):
        pattern = "".join(rng.choice(atoms) + rng.choice(quants) for _ in range(rng.randint(1, 4)))
        if rng.random() < 0.2:
            pattern = pattern + "|" + rng.choice(atoms)
        try:
            StopRegex(pattern)
        except ValueError as e:
            assert "empty string" in str(e) and re.fullmatch(pattern, "")
            continue
        text = "".join(rng.choice("abc 1\n") for _ in range(rng.randint(0, 14)))
        cut = rng.randint(0, len(text))
        assert _scan(pattern, [text[:cut], text[cut:]]) == _first_match(pattern, text), pattern
        checked += 1
    assert checked > 250


def test_live_threads_say_what_must_be_held_back():
    scanner = RegexScanner(StopRegex("ab+c"))
    assert scanner.feed("xxab") is None
    assert scanner.earliest_live_start() == 2  # "ab" may still become a match
    assert scanner.feed("bb") is None and scanner.earliest_live_start() == 2
    assert scanner.feed("x") is None and scanner.earliest_live_start() is None
    assert scanner.feed("abc") == (7, 10)


@pytest.mark.parametrize(
    ("pattern", "why"),
    [
        ("", "empty"),
        ("a*", "matches the empty string"),
        ("(a|)", "matches the empty string"),
        ("end$", "'$' is not supported"),
        ("\\bword", "word boundary"),
        ("(a)\\1", "backreferences"),
        ("a(?=b)", "lookaround"),
        ("(?i)abc", "inline flags"),
        ("a**", "quantifier cannot follow another"),
        ("a++", "possessive"),
        ("*a", "nothing to repeat"),
        ("(ab", "missing ')'"),
        ("ab)", "unbalanced"),
        ("[ab", "unterminated character class"),
        ("[z-a]", "bad character range"),
        ("a{3,1}", "below the minimum"),
        ("a{5000}", "limited to 1000"),
        ("x^y", "only supported at the start"),
        ("\\q", "unknown escape"),
        ("\\x4", "hex digits"),
        ("abc\\", "end with a backslash"),
        ("a" * 1001, "limited to 1000 characters"),
        ("(a{1000}){1000}", f"over {MAX_STATES} states"),
    ],
)
def test_unsupported_or_bad_patterns_are_refused_with_their_reason(pattern, why):
    with pytest.raises(ValueError, match=re.escape(why)):
        StopRegex(pattern)


def test_a_pattern_that_would_backtrack_exponentially_in_re_scans_in_linear_time():
    """(a+)+b over a run of a's: Python's re backtracks 2^n ways on each failing
    position; the NFA keeps a handful of states per character."""
    scanner = RegexScanner(StopRegex("(a+)+b"))
    assert scanner.feed("a" * 20000) is None
    assert scanner.feed("b") == (0, 20001)
    rx = StopRegex("(x|x)*y|(x+x+)+z")
    assert rx.num_states < 30  # linear in the pattern, not in anything it reads
    # optional copies whose closures overlap (each reaches the rest): still one visit
    # per state and character
    scanner = RegexScanner(StopRegex("a{0,200}b"))
    assert scanner.feed("a" * 5000) is None and scanner.feed("b") == (4800, 5001)
