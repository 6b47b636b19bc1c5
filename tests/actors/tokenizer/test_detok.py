"""Incremental detokenization and stop strings, on the real SmolLM2 tokenizer."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shunter.actors.tokenizer.detok import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    StopStringMatcher,
)

MIXED = "héllo 😀 wörld — 日本語のテキスト 🎉🎉 ok"


def _stream(codec, ids, chunk_sizes):
    d = IncrementalDetokenizer(codec)
    out, i = [], 0
    for n in chunk_sizes:
        out.append(d.push(ids[i : i + n]))
        i += n
    out.append(d.push(ids[i:]))
    out.append(d.flush())
    return out


def test_emoji_split_across_tokens_is_held_until_complete(codec):
    ids = codec.encode("a 😀 b")
    # The emoji is more than one token: its first piece alone is not a whole character.
    pieces = [codec.decode([i]) for i in ids]
    assert any(REPLACEMENT_CHAR in p for p in pieces), pieces
    chunks = _stream(codec, ids, [1] * len(ids))
    assert all(REPLACEMENT_CHAR not in c for c in chunks), chunks
    assert "".join(chunks) == "a 😀 b"
    # Some step released nothing: the bytes were held back, not emitted broken.
    assert "" in chunks[:-2]


def test_one_token_at_a_time_reassembles_exactly(codec):
    ids = codec.encode(MIXED)
    chunks = _stream(codec, ids, [1] * len(ids))
    assert "".join(chunks) == codec.decode(ids) == MIXED
    assert all(REPLACEMENT_CHAR not in c for c in chunks)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(min_size=1, max_size=40), sizes=st.lists(st.integers(1, 4), max_size=30))
def test_any_chunking_reassembles_the_full_decode(codec, text, sizes):
    ids = codec.encode(text)
    chunks = _stream(codec, ids, sizes)
    assert "".join(chunks) == codec.decode(ids)
    full = codec.decode(ids)
    if REPLACEMENT_CHAR not in full:
        assert all(REPLACEMENT_CHAR not in c for c in chunks)


def test_invalid_bytes_before_a_character_keep_it_whole(codec):
    """Lone continuation bytes (text the tokenizer cannot encode) held past
    MAX_HELD_IDS, then a two-byte character whose first byte is already held: the
    released U+FFFDs must not swallow it (a case hypothesis found)."""
    text = "000000000\x80\U00040000\U00040000Ä"
    ids = codec.encode(text)
    chunks = _stream(codec, ids, [1, 1, 1, 1, 2, 4, 4, 4])
    assert "".join(chunks) == codec.decode(ids)
    assert codec.decode(ids).endswith("Ä")


def test_truncated_character_is_released_at_flush(codec):
    ids = codec.encode("x😀")
    d = IncrementalDetokenizer(codec)
    text = d.push(ids[:-1])
    assert REPLACEMENT_CHAR not in text
    assert d.num_held_ids >= 1
    tail = d.flush()
    assert REPLACEMENT_CHAR in tail  # the request ended mid-character: show what is there


def test_prompt_context_is_not_emitted(codec):
    prompt = codec.encode("The answer is")
    out = codec.encode(" forty two")
    d = IncrementalDetokenizer(codec, prompt[-3:])
    assert d.push(out) + d.flush() == " forty two"


def test_spaces_between_special_tokens(codec):
    ids = [*codec.encode("hi"), 2, *codec.encode("there")]
    joined = codec.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=True)
    tight = codec.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=False)
    assert joined == "hi <|im_end|> there"
    assert tight == "hi<|im_end|>there"
    assert codec.decode(ids, skip_special_tokens=True) == "hithere"


def test_stop_matcher_holds_back_a_possible_start():
    m = StopStringMatcher(["STOP"])
    assert m.push("abc ST") == ("abc ", None)
    assert m.pending == "ST"
    assert m.push("OX") == ("STOX", None)  # not a stop after all: released
    assert m.push("xxSTO") == ("xx", None)
    assert m.push("Pyy") == ("", "STOP")


def test_stop_matcher_earliest_match_and_no_trim():
    m = StopStringMatcher(["b", "ab"], no_stop_trim=True)
    assert m.push("xxabyy") == ("xxab", "ab")
    m = StopStringMatcher(["b", "ab"])
    assert m.push("xxabyy") == ("xx", "ab")


def test_stop_matcher_final_releases_held_text():
    m = StopStringMatcher(["END"])
    assert m.push("the EN") == ("the ", None)
    assert m.push("", final=True) == ("EN", None)


def _rx(*patterns):
    from shunter.actors.tokenizer.stop_regex import StopRegex

    return [StopRegex(p) for p in patterns]


def test_stop_regex_holds_back_from_where_a_match_may_still_start():
    m = StopStringMatcher([], regexes=_rx(r"Answer: \d+\."))
    assert m.push("so. Answer") == ("so. ", None)  # "Answer" may begin a match
    assert m.push(": 4") == ("", None)
    assert m.push("2, no") == ("Answer: 42, no", None)  # it did not
    assert m.push(" Answer: 7.") == (" ", r"Answer: \d+\.")  # cut at the match's start


def test_stop_regex_and_stop_strings_the_match_starting_first_wins():
    m = StopStringMatcher(["zz"], regexes=_rx("b+c"), no_stop_trim=True)
    assert m.push("abbbczz") == ("abbbc", "b+c")
    m = StopStringMatcher(["ab"], regexes=_rx("b+c"))
    assert m.push("abbbc") == ("", "ab")
    m = StopStringMatcher([], regexes=_rx("x+y", "[0-9]"))
    assert m.push("xx 1 y") == ("xx ", "[0-9]")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    text=st.text(alphabet="ab c\n9", max_size=24),
    cuts=st.lists(st.integers(0, 24), max_size=6),
    trim=st.booleans(),
)
def test_stop_regex_any_chunking_releases_the_output_cut_at_the_first_match(text, cuts, trim):
    """Released chunks plus the final one equal the text cut where the first match to
    complete starts (or ends, with no_stop_trim), however the text was split."""
    import re

    pattern = "a[b ]*c|99"
    ends = [e for e in range(1, len(text) + 1) if re.search(f"(?:{pattern})$", text[:e])]
    want, matched = text, None
    if ends:
        e = ends[0]
        s = min(s for s in range(e) if re.fullmatch(pattern, text[s:e]))
        want, matched = (text[:e] if not trim else text[:s]), pattern
    m = StopStringMatcher([], regexes=_rx(pattern), no_stop_trim=not trim)
    out, got, prev = [], None, 0
    for cut in [*sorted(c for c in cuts if c <= len(text)), len(text)]:
        released, got = m.push(text[prev:cut], final=cut == len(text))
        out.append(released)
        prev = cut
        if got is not None:
            break
    assert "".join(out) == want and got == matched


def test_invalid_bytes_are_not_held_forever(codec):
    # Lone UTF-8 lead bytes never complete; the detokenizer releases them after a bound.
    lead = [i for i in range(256, 49152) if codec.decode([i]) == REPLACEMENT_CHAR][:1]
    assert lead, "no single-byte partial token found"
    d = IncrementalDetokenizer(codec)
    out = [d.push(lead) for _ in range(20)]
    assert d.num_held_ids <= 7
    assert REPLACEMENT_CHAR in "".join(out)


def test_text_before_a_partial_character_is_released_early(codec):
    # Found by hypothesis: several ids arriving at once end inside a 4-byte character
    # while an earlier character in the same chunk is complete.
    text = "0\u0a40\U000c0000"
    ids = codec.encode(text)
    d = IncrementalDetokenizer(codec)
    first = d.push(ids[:7])
    assert first == "0\u0a40"  # released without waiting for the 4-byte character
    assert d.push(ids[7:]) + d.flush() == "\U000c0000"
    assert _stream(codec, ids, [3, 4]) == ["0", "\u0a40", "\U000c0000", ""]
