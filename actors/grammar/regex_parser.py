"""The parser behind regex.py's Thompson NFAs: a pattern's text as the syntax tree that
regex.py's builder compiles, in the syntax regex.py's docstring describes.

Theory of operation: recursive descent, one method a level (alternation,
concatenation, quantifiers, atoms); a concatenation whose last item is `(?:SEP X)*`
and whose items before it end with X (compared by source text) folds them into one
("list", X, SEP) node. `(?J:...)` groups are rewritten by regex_extensions.json_escaped
as they close. Refused with a `ValueError` that names the parameter, the reason and the
offset.

Tree nodes: ("char", pred) | ("cat", [nodes]) | ("alt", [nodes]) | ("rep", node, min,
max or None) | ("list", item, sep): item (sep item)* | ("avoid", words) | ("empty",).
"""

from __future__ import annotations

from collections.abc import Callable

from shunter.actors.grammar.regex_extensions import json_escaped

MAX_REPEAT = 1000
MAX_GROUP_DEPTH = 100  # groups nested deeper are refused (the parser and builder recurse)

Pred = Callable[[str], bool]

_CLASS_ESCAPES: dict[str, Pred] = {
    "d": str.isdecimal,
    "D": lambda c: not c.isdecimal(),
    "w": lambda c: c.isalnum() or c == "_",
    "W": lambda c: not (c.isalnum() or c == "_"),
    "s": str.isspace,
    "S": lambda c: not c.isspace(),
}
_CHAR_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a", "0": "\0"}
_REFUSED_ESCAPES = {
    "b": "\\b (a word boundary)",
    "B": "\\B (a word boundary)",
    "A": "\\A",
    "Z": "\\Z",
    "z": "\\z",
    "G": "\\G",
}


def _cat(items: list[tuple]) -> tuple:
    return ("empty",) if not items else items[0] if len(items) == 1 else ("cat", items)


class Parser:
    """One pattern's parse: `parse()` gives whether it began with ^, and its tree."""

    def __init__(self, pattern: str, param: str, end_anchor: bool, extensions: bool) -> None:
        self.p = pattern
        self.i = 0
        self.param = param
        self.end_anchor = end_anchor  # a final "$" is allowed (a whole-text match)
        self.extensions = extensions  # (?J:...) and (?A:...) are allowed (regex.py's docstring)
        self.depth = 0  # groups open at this point
        self.texts: dict[int, tuple[tuple, list[str]]] = {}  # cat nodes' item texts

    def fail(self, why: str) -> ValueError:
        shown = self.p if len(self.p) <= 80 else self.p[:60] + "..."
        return ValueError(f"{self.param} {shown!r}: {why} (at offset {self.i})")

    def peek(self) -> str | None:
        return self.p[self.i] if self.i < len(self.p) else None

    def take(self) -> str:
        c = self.p[self.i]
        self.i += 1
        return c

    def parse(self) -> tuple[bool, tuple]:
        anchored = self.peek() == "^"
        if anchored:
            self.i += 1
        node = self.alt()
        if self.i < len(self.p):
            raise self.fail("unbalanced ')'")
        return anchored, node

    def alt(self) -> tuple:
        branches = [self.cat()]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.cat())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def cat(self) -> tuple:
        items: list[tuple] = []
        texts: list[str] = []  # each item's source text
        while (c := self.peek()) is not None and c not in "|)":
            start = self.i
            items.append(self.repeat())
            texts.append(self.p[start : self.i])
            self.fold_list(items, texts)
        node = _cat(items)
        if node[0] == "cat":  # kept (with the node, so its id stays its own) for fold_list
            self.texts[id(node)] = (node, texts)
        return node

    def fold_list(self, items: list[tuple], texts: list[str]) -> None:
        """Fold the items that end with X followed by (?:SEP X)* into one ("list", X,
        SEP), X being the longest run of whole items that the group ends with, compared
        by their source text."""
        last = items[-1]
        if last[0] != "rep" or last[2:] != (0, None):
            return
        kept = self.texts.get(id(last[1]))
        if kept is None or kept[0] is not last[1]:
            return
        inner, inner_texts = last[1][1], kept[1]
        n = 0
        while n < len(inner) - 1 and n < len(items) - 1 and inner_texts[-1 - n] == texts[-2 - n]:
            n += 1
        if n:
            folded = ("list", _cat(items[-1 - n : -1]), _cat(inner[: len(inner) - n]))
            items[-1 - n :] = [folded]
            texts[-1 - n :] = ["".join(texts[-1 - n :])]

    def repeat(self) -> tuple:
        node, quantified = self.atom(), False
        while (c := self.peek()) is not None and c in "*+?{":
            if c == "{":
                bounds = self.bounds()
                if bounds is None:  # a literal "{", as Python reads one that is no count
                    break
                lo, hi = bounds
            else:
                self.i += 1
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            if self.peek() == "?":  # lazy: the same set of matches
                self.i += 1
            elif self.peek() == "+":
                raise self.fail("possessive quantifiers are not supported")
            if quantified:
                raise self.fail("a quantifier cannot follow another")
            node, quantified = ("rep", node, lo, hi), True
        return node

    def bounds(self) -> tuple[int, int | None] | None:
        end = self.p.find("}", self.i)
        body = self.p[self.i + 1 : end] if end > 0 else ""
        lo_s, sep, hi_s = body.partition(",")
        if end < 0 or not lo_s.isdigit() or (hi_s and not hi_s.isdigit()):
            return None
        lo = int(lo_s)
        hi = lo if not sep else (int(hi_s) if hi_s else None)
        if hi is not None and hi < lo:
            raise self.fail(f"{{{body}}}: the maximum is below the minimum")
        if max(lo, hi or 0) > MAX_REPEAT:
            raise self.fail(f"repeat counts are limited to {MAX_REPEAT}")
        self.i = end + 1
        return lo, hi

    def atom(self) -> tuple:
        c = self.take()
        if c == "(":
            if self.depth >= MAX_GROUP_DEPTH:
                raise self.fail(f"groups are nested more than {MAX_GROUP_DEPTH} deep")
            json_group = False
            if self.peek() == "?":
                self.i += 1
                kind = self.peek()
                if kind == ":":
                    self.i += 1
                elif kind == "J" and self.extensions and self.p.startswith("J:", self.i):
                    self.i += 2
                    json_group = True
                elif kind == "A" and self.extensions and self.p.startswith("A:", self.i):
                    self.i += 2
                    return ("avoid", self.words())
                elif kind == "P" and self.p.startswith("P<", self.i):
                    close = self.p.find(">", self.i)
                    if close < 0:
                        raise self.fail("unterminated group name")
                    self.i = close + 1
                elif kind in ("=", "!", "<"):
                    raise self.fail("lookaround assertions are not supported")
                else:
                    raise self.fail("inline flags and other (?...) groups are not supported")
            self.depth += 1
            node = self.alt()
            self.depth -= 1
            if self.peek() != ")":
                raise self.fail("missing ')'")
            self.i += 1
            return json_escaped(node) if json_group else node
        if c == "[":
            return ("char", self.char_class())
        if c == ".":
            return ("char", lambda ch: ch != "\n")
        if c == "\\":
            e = self.escape(in_class=False)
            return ("char", _literal(e) if isinstance(e, str) else e)
        if c == "$":
            if self.end_anchor and self.i == len(self.p):
                return ("empty",)
            raise self.fail("'$' is not supported (streamed text has no end to anchor to)")
        if c == "^":
            raise self.fail("'^' is only supported at the start of the pattern")
        if c in "*+?":
            raise self.fail(f"nothing to repeat before {c!r}")
        if c == ")":
            raise self.fail("unbalanced ')'")
        return ("char", _literal(c))

    def words(self) -> list[str]:
        """The literal words of an `(?A:...)` group, up to its ")"."""
        words, word = [], []
        while True:
            if self.peek() is None:
                raise self.fail("missing ')'")
            c = self.take()
            if c in "|)":
                if not word:
                    raise self.fail("(?A:...) words must not be empty")
                words.append("".join(word))
                word = []
                if c == ")":
                    return words
            elif c == "\\":
                e = self.escape(in_class=False)
                if not isinstance(e, str):
                    raise self.fail("(?A:...) takes literal words only")
                word.append(e)
            elif c in "([{*+?.^$":
                raise self.fail(f"(?A:...) takes literal words only (escape {c!r})")
            else:
                word.append(c)

    def escape(self, *, in_class: bool) -> str | Pred:
        """What follows a backslash: the character it stands for, or a class escape's
        predicate."""
        if self.peek() is None:
            raise self.fail("a pattern cannot end with a backslash")
        c = self.take()
        if c in _CLASS_ESCAPES:
            return _CLASS_ESCAPES[c]
        if c in _CHAR_ESCAPES:
            return _CHAR_ESCAPES[c]
        if c == "b" and in_class:  # a backspace inside a class, as in Python
            return "\b"
        if c in "xu":
            width = 2 if c == "x" else 4
            digits = self.p[self.i : self.i + width]
            if len(digits) != width or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.fail(f"\\{c} needs {width} hex digits")
            self.i += width
            return chr(int(digits, 16))
        if c.isdigit():
            raise self.fail("backreferences are not supported")
        if c in _REFUSED_ESCAPES:
            raise self.fail(f"{_REFUSED_ESCAPES[c]} is not supported")
        if c.isalnum():
            raise self.fail(f"unknown escape \\{c}")
        return c

    def char_class(self) -> Pred:
        negate = self.peek() == "^"
        if negate:
            self.i += 1
        preds: list[Pred] = []
        chars: set[str] = set()
        ranges: list[tuple[str, str]] = []
        first = True
        while True:
            c = self.peek()
            if c is None:
                raise self.fail("unterminated character class")
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            lo = self.class_item()
            dash = self.peek() == "-" and self.p[self.i + 1 : self.i + 2] not in ("]", "")
            if isinstance(lo, str) and dash:
                self.i += 1
                hi = self.class_item()
                if not isinstance(hi, str) or hi < lo:
                    raise self.fail("bad character range")
                ranges.append((lo, hi))
            elif isinstance(lo, str):
                chars.add(lo)
            else:
                preds.append(lo)

        def member(ch: str) -> bool:
            hit = ch in chars or any(a <= ch <= b for a, b in ranges) or any(p(ch) for p in preds)
            return hit != negate

        return member

    def class_item(self) -> str | Pred:
        """One member: a character, or a class escape's predicate."""
        c = self.take()
        return self.escape(in_class=True) if c == "\\" else c


def _literal(c: str) -> Pred:
    return c.__eq__
