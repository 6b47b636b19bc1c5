"""The two constraint extensions of regex.py's syntax, as syntax-tree and automaton
pieces: `(?J:...)`, a pattern's characters as a JSON string writes them, and
`(?A:w1|w2|...)`, text in which none of the words occurs.

Theory of operation: `json_escaped` rewrites each character step of a parsed pattern
into its unescaped form where JSON allows one and its escaped forms after a backslash
(the short escape, or \\u00XX in either case for a control character).
`word_automaton` is Aho-Corasick over the words, complete over their characters
(others lead to the root), with the states where a word has just ended marked; the
builder keeps every other state accepting, so a text is taken until a word completes.

Invariants: pure functions of their arguments; the tree nodes keep regex_parser.py's shapes
("char", pred) | ("cat", [...]) | ("alt", [...]) | ("rep", node, lo, hi) | ("list", item,
sep) | ("empty",).
"""

from __future__ import annotations

from collections.abc import Callable

Pred = Callable[[str], bool]


def _literal(c: str) -> Pred:
    return c.__eq__


_JSON_SHORT = {'"': '"', "\\": "\\", "\b": "b", "\f": "f", "\n": "n", "\r": "r", "\t": "t"}
_HEX = "0123456789abcdef"


def _json_unsafe(c: str) -> bool:
    return c in '"\\' or c < " "


def json_escaped(node: tuple) -> tuple:
    """`node` with every character step reading the character as a JSON string holds
    it: unescaped where JSON allows that, else after a backslash (the short escape, or
    \\u00XX for a control character, its hex digits in either case)."""
    kind = node[0]
    if kind == "empty":
        return node
    if kind in ("cat", "alt"):
        return (kind, [json_escaped(child) for child in node[1]])
    if kind == "rep":
        return ("rep", json_escaped(node[1]), node[2], node[3])
    if kind == "list":
        return ("list", json_escaped(node[1]), json_escaped(node[2]))
    pred = node[1]
    plain = ("char", lambda c: pred(c) and not _json_unsafe(c))
    short = {letter for c, letter in _JSON_SHORT.items() if pred(c)}
    controls = [chr(i) for i in range(0x20) if pred(chr(i))]
    escapes = []
    if short:
        escapes.append(("char", short.__contains__))
    for high in "01":
        lows = {_HEX[ord(c) & 15] for c in controls if ord(c) >> 4 == int(high)}
        lows |= {d.upper() for d in lows}
        if lows:
            escapes.append(("cat", [("char", _literal(ch)) for ch in "u00" + high]
                            + [("char", lows.__contains__)]))  # fmt: skip
    if not escapes:
        return plain
    escaped = (
        "cat",
        [("char", _literal("\\")), escapes[0] if len(escapes) == 1 else ("alt", escapes)],
    )
    return ("alt", [plain, escaped])


def chars_or_others(chars: set[str], alphabet: set[str]) -> Pred:
    """A character of `chars`, or one that is not in `alphabet`."""
    return lambda ch: ch in chars or ch not in alphabet


def word_automaton(words: list[str]) -> tuple[list[dict[str, int]], set[int]]:
    """Aho-Corasick over `words`: goto[s][c] for every state and every character of
    the words (other characters lead to state 0), and the states where a word ends."""
    trie: list[dict[str, int]] = [{}]
    ends: set[int] = set()
    for w in words:
        s = 0
        for c in w:
            if c not in trie[s]:
                trie.append({})
                trie[s][c] = len(trie) - 1
            s = trie[s][c]
        ends.add(s)
    alphabet = sorted({c for w in words for c in w})
    fail = [0] * len(trie)
    goto: list[dict[str, int]] = [{} for _ in trie]
    order = [0]
    for s in order:  # breadth first: a state's fail link is complete before its children's
        for c in alphabet:
            if c in trie[s]:
                t = trie[s][c]
                goto[s][c] = t
                fail[t] = goto[fail[s]][c] if s else 0
                if fail[t] in ends:
                    ends.add(t)
                order.append(t)
            else:
                goto[s][c] = goto[fail[s]][c] if s else 0
    return goto, ends
