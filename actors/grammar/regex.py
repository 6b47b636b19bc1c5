"""Regular expressions as Thompson NFAs: the parser and compiler behind stop regexes
(actors/tokenizer/stop_regex.py) and constrained decoding (token_fsm.py).

Theory of operation: a pattern is parsed into a small syntax tree and compiled into a
Thompson NFA of character steps and epsilon splits; counted repeats are unrolled, so
the NFA's size is bounded by the caller's `max_states`. Simulating every state at once
costs at most the NFA's size per character, whatever the text: no input can make it
backtrack, as Python's `re` can. A separated list, which a regular expression can only
write as `X(?:SEP X)*` (a JSON array or object, a run of tool calls), is compiled with
one copy of X and a loop back through SEP (a "list" node; the two X's are the same text,
so the same language), and `X+` with one looped copy: nested lists grow the NFA twofold
a level, not fourfold.

Syntax: Python's `re` without what needs backtracking or a look beyond the current
character: literals and escapes (\\n \\t \\xhh \\uhhhh, escaped punctuation), `.` (any
character but a newline), classes `[...]` / `[^...]` with ranges, \\d \\w \\s and their
negations, groups `(...)`, `(?:...)`, `(?P<name>...)`, alternation `|`, the quantifiers
`* + ? {n} {n,} {n,m}` and their lazy forms (which match the same), `^` at the start
of the pattern and, where the caller allows it, `$` at its end. Refused with a
`ValueError` that names the parameter and the reason: `\\b`, backreferences,
lookarounds, inline flags.

Two extensions, where the caller allows them (constraints): `(?J:...)` matches the
text its pattern matches as it is written inside a JSON string: a quote, a backslash
and the control characters it would match match only in their escaped forms (`\\"`,
`\\\\`, `\\n` or `\\u000a`, ...). A JSON Schema's string `pattern` is kept this way
(json_schema.py), so whatever the pattern allows, the output stays valid JSON.
`(?A:w1|w2|...)`, its words literals (escaped as `re.escape` does), matches any text
in which no word occurs: an Aho-Corasick automaton over the words, every state but a
word's end accepting (structural_tag.py's free text between tagged structures).
"""

from __future__ import annotations

from collections.abc import Callable

from shunter.actors.grammar.regex_extensions import chars_or_others, json_escaped, word_automaton

MAX_PATTERN_CHARS = 1000
MAX_REPEAT = 1000
MAX_GROUP_DEPTH = 100  # groups nested deeper are refused (the parser and builder recurse)
MAX_CONSTRAINT_CHARS = (
    200_000  # what a schema or grammar becomes may be long; states bound the work
)


class PatternTooLarge(ValueError):
    """A pattern written from a schema or grammar passed MAX_CONSTRAINT_CHARS (json_schema.py
    and ebnf.py stop as soon as a part of it does, so no input makes them run long)."""


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


# ---- syntax tree -------------------------------------------------------------------
# ("char", pred) | ("cat", [nodes]) | ("alt", [nodes]) | ("rep", node, min, max or None)
# | ("list", item, sep): item (sep item)* | ("empty",)


def _cat(items: list[tuple]) -> tuple:
    return ("empty",) if not items else items[0] if len(items) == 1 else ("cat", items)


class _Parser:
    def __init__(self, pattern: str, param: str, end_anchor: bool, extensions: bool) -> None:
        self.p = pattern
        self.i = 0
        self.param = param
        self.end_anchor = end_anchor  # a final "$" is allowed (a whole-text match)
        self.extensions = extensions  # (?J:...) and (?A:...) are allowed (the module docstring)
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


# ---- NFA ---------------------------------------------------------------------------


class _Builder:
    """States: `step[s]` = (pred, next) for a character step, `split[s]` = targets for
    an epsilon state."""

    def __init__(self, param: str, max_states: int) -> None:
        self.step: list[tuple[Pred, int] | None] = []
        self.split: list[list[int]] = []
        self.param = param
        self.max_states = max_states

    def new(self) -> int:
        if len(self.step) >= self.max_states:
            raise ValueError(f"{self.param}: the pattern is too large (over {self.max_states} "
                             "states)")  # fmt: skip
        self.step.append(None)
        self.split.append([])
        return len(self.step) - 1

    def avoid(self, words: list[str], out: int) -> int:
        """States for text in which no word occurs (`(?A:...)`), continuing to `out`
        from wherever it ends; returns the entry state."""
        goto, ends = word_automaton(words)
        live = [s for s in range(len(goto)) if s not in ends]
        entry = {s: self.new() for s in live}
        for s in live:
            targets: dict[int, set[str]] = {}
            for c, t in goto[s].items():
                targets.setdefault(t, set()).add(c)
            alphabet = set(goto[s])  # every state lists every character of the words
            branches = [out]
            for t, chars in targets.items():
                if t in ends:
                    continue  # that character completes a word
                r = self.new()
                pred = chars_or_others(chars, alphabet) if t == 0 else chars.__contains__
                self.step[r] = (pred, entry[t])
                branches.append(r)
            if 0 not in targets:  # characters outside the words still lead to the root
                r = self.new()
                self.step[r] = (chars_or_others(set(), alphabet), entry[0])
                branches.append(r)
            self.split[entry[s]] = branches
        return entry[0]

    def build(self, node: tuple, out: int) -> int:
        """States for `node` that continue to `out`; returns its entry state."""
        kind = node[0]
        if kind == "empty":
            return out
        if kind == "char":
            s = self.new()
            self.step[s] = (node[1], out)
            return s
        if kind == "cat":
            for child in reversed(node[1]):
                out = self.build(child, out)
            return out
        if kind == "alt":
            s = self.new()
            self.split[s] = [self.build(child, out) for child in node[1]]
            return s
        if kind == "avoid":
            return self.avoid(node[1], out)
        if kind == "list":  # item (sep item)*: one item, after it the end or sep and back
            after = self.new()
            entry = self.build(node[1], after)
            self.split[after] = [out, self.build(node[2], entry)]
            return entry
        _, child, lo, hi = node
        if hi is None and lo:  # child{lo,}: lo - 1 copies, then one that loops back
            after = self.new()
            entry = self.build(child, after)
            self.split[after] = [out, entry]
            lo -= 1
        elif hi is None:  # child*
            loop = self.new()
            self.split[loop] = [self.build(child, loop), out]
            entry = loop
        else:  # child{lo,hi}: lo copies, then hi - lo optional ones
            entry = out
            for _ in range(hi - lo):
                s = self.new()
                self.split[s] = [self.build(child, entry), out]
                entry = s
        for _ in range(lo):
            entry = self.build(child, entry)
        return entry


class Nfa:
    """A pattern compiled (see the module docstring); `ValueError` if refused.

    `step[s]` is (predicate, next state) for a state that reads a character, None for
    the others; `split[s]` the epsilon targets of a state that reads none; `accept`
    the accepting state; `start_closure` the reading states (and perhaps `accept`)
    that the start reaches without reading; `anchored`: the pattern began with ^."""

    def __init__(self, pattern: str, *, param: str, max_states: int, end_anchor: bool = False,
                 max_chars: int = MAX_PATTERN_CHARS, extensions: bool = False) -> None:  # fmt: skip
        if not pattern:
            raise ValueError(f"{param} must not be empty")
        if len(pattern) > max_chars:
            raise ValueError(f"{param} is limited to {max_chars} characters")
        self.pattern = pattern
        self.anchored, tree = _Parser(pattern, param, end_anchor, extensions).parse()
        b = _Builder(param, max_states)
        self.accept = b.new()
        self.start = b.build(tree, self.accept)
        self.step, self.split = b.step, b.split
        self.start_closure = self.close([self.start])

    def close(self, states) -> tuple[int, ...]:
        """The reading states (and the accepting one) reachable from `states` without
        reading a character, sorted."""
        seen, stack, out = set(states), list(states), []
        while stack:
            t = stack.pop()
            if self.split[t]:
                for u in self.split[t]:
                    if u not in seen:
                        seen.add(u)
                        stack.append(u)
            else:
                out.append(t)
        return tuple(sorted(out))

    @property
    def num_states(self) -> int:
        return len(self.step)

    @property
    def matches_empty(self) -> bool:
        return self.accept in self.start_closure

    def fullmatch(self, text: str) -> bool:
        """Whether the pattern matches all of `text` (a direct simulation, for checks and
        tests; the scanners keep their own state sets)."""
        states = self.start_closure
        for c in text:
            nxt = [self.step[s][1] for s in states if s != self.accept and self.step[s][0](c)]
            if not nxt:
                return False
            states = self.close(nxt)
        return self.accept in states
