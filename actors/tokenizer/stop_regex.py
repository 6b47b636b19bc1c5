"""Stop regexes (SGLang's `stop_regex`), matched on streamed text in linear time.

Theory of operation: a pattern is parsed into a small syntax tree and compiled into a
Thompson NFA (character steps and epsilon splits). `RegexScanner` simulates that NFA
over the output text one character at a time, the whole set of live states at once,
each state with the earliest output offset a thread through it started at, so the
work is (characters x states) whatever the pattern: no input can make it backtrack,
which Python's `re` could (a hostile pattern would stall the tokenizer, and with it
every request). A match is reported at the first character where any thread reaches
the accepting state, with the earliest start among those threads: generation stops
as soon as some match is complete. Until then the earliest start of any live thread
is where text must be held back, since a match may still begin there. So a match is
the first to end, not Python's leftmost-greedy one: with `no_stop_trim` the kept text
ends where the match first completed (`\\d+` keeps one digit), and where a later
match ends before an earlier-starting one could, the later one stops the request.

Syntax: Python's `re` without what needs backtracking or a look beyond the current
character: literals and escapes (\\n \\t \\xhh \\uhhhh, escaped punctuation), `.` (any
character but a newline), classes `[...]` / `[^...]` with ranges, \\d \\w \\s and their
negations, groups `(...)`, `(?:...)`, `(?P<name>...)`, alternation `|`, the quantifiers
`* + ? {n} {n,} {n,m}` and their lazy forms (which match the same), and `^` at the
start of the pattern (the match must start at the output's first character). Refused
with a `ValueError` that names it: `$`, `\\b`, backreferences, lookarounds, inline
flags, and patterns that match the empty string (they would stop at once).

Invariants: scanning is a pure function of the text fed so far (no clock, no state
outside the scanner); a character reaches each NFA state at most once, so it costs at
most the NFA's size, and a request's patterns have at most MAX_STATES states together
(the tokenizer checks the sum).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

MAX_PATTERN_CHARS = 1000
MAX_STATES = 500  # a request's patterns together: each character costs up to this many steps
MAX_REPEAT = 1000

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
# | ("empty",)


class _Parser:
    def __init__(self, pattern: str) -> None:
        self.p = pattern
        self.i = 0

    def fail(self, why: str) -> ValueError:
        return ValueError(f"stop_regex {self.p!r}: {why} (at offset {self.i})")

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
        items = []
        while (c := self.peek()) is not None and c not in "|)":
            items.append(self.repeat())
        if not items:
            return ("empty",)
        return items[0] if len(items) == 1 else ("cat", items)

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
            if self.peek() == "?":
                self.i += 1
                kind = self.peek()
                if kind == ":":
                    self.i += 1
                elif kind == "P" and self.p.startswith("P<", self.i):
                    close = self.p.find(">", self.i)
                    if close < 0:
                        raise self.fail("unterminated group name")
                    self.i = close + 1
                elif kind in ("=", "!", "<"):
                    raise self.fail("lookaround assertions are not supported")
                else:
                    raise self.fail("inline flags and other (?...) groups are not supported")
            node = self.alt()
            if self.peek() != ")":
                raise self.fail("missing ')'")
            self.i += 1
            return node
        if c == "[":
            return ("char", self.char_class())
        if c == ".":
            return ("char", lambda ch: ch != "\n")
        if c == "\\":
            e = self.escape(in_class=False)
            return ("char", _literal(e) if isinstance(e, str) else e)
        if c == "$":
            raise self.fail("'$' is not supported (streamed text has no end to anchor to)")
        if c == "^":
            raise self.fail("'^' is only supported at the start of the pattern")
        if c in "*+?":
            raise self.fail(f"nothing to repeat before {c!r}")
        if c == ")":
            raise self.fail("unbalanced ')'")
        return ("char", _literal(c))

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


class _Nfa:
    """States: `step[s]` = (pred, next) for a character step, `split[s]` = targets for
    an epsilon state; `accept` is the one accepting state."""

    def __init__(self) -> None:
        self.step: list[tuple[Pred, int] | None] = []
        self.split: list[list[int]] = []

    def new(self) -> int:
        if len(self.step) >= MAX_STATES:
            raise ValueError(f"stop_regex: the pattern is too large (over {MAX_STATES} states)")
        self.step.append(None)
        self.split.append([])
        return len(self.step) - 1

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
        _, child, lo, hi = node
        if hi is None:  # child{lo,}: lo copies, then a loop
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


class StopRegex:
    """A compiled stop regex (see the module docstring); `ValueError` if refused."""

    def __init__(self, pattern: str) -> None:
        if not pattern:
            raise ValueError("stop_regex must not be empty")
        if len(pattern) > MAX_PATTERN_CHARS:
            raise ValueError(f"stop_regex is limited to {MAX_PATTERN_CHARS} characters")
        self.pattern = pattern
        self.anchored, tree = _Parser(pattern).parse()
        nfa = _Nfa()
        self.accept = nfa.new()
        self.start = nfa.build(tree, self.accept)
        self._step = nfa.step
        self._split = nfa.split
        self._start_closure = self._close(nfa, self.start)
        if self.accept in self._start_closure:
            raise ValueError(f"stop_regex {pattern!r} matches the empty string")

    @staticmethod
    def _close(nfa: _Nfa, s: int) -> tuple[int, ...]:
        """The character-step states (and the accepting one) reachable from s without
        reading a character."""
        seen, stack, out = {s}, [s], []
        while stack:
            t = stack.pop()
            if nfa.split[t]:
                for u in nfa.split[t]:
                    if u not in seen:
                        seen.add(u)
                        stack.append(u)
            else:
                out.append(t)
        return tuple(sorted(out))

    @property
    def num_states(self) -> int:
        return len(self._step)


@functools.lru_cache(maxsize=256)
def compile_stop_regex(pattern: str) -> StopRegex:
    """StopRegex(pattern), kept for the next request that sends the same pattern (a
    compiled regex is never changed; scanners keep their state apart)."""
    return StopRegex(pattern)


class RegexScanner:
    """One pattern scanned over a growing text; offsets count characters from the
    text's start."""

    def __init__(self, regex: StopRegex) -> None:
        self.regex = regex
        self.offset = 0  # characters fed so far
        self._live: dict[int, int] = {}  # character-step state -> earliest thread start

    def feed(self, text: str) -> tuple[int, int] | None:
        """Read text; (start, end) of the first match to complete, or None. After a
        match the scanner is done with; feed no more."""
        rx = self.regex
        step, split, accept = rx._step, rx._split, rx.accept
        live = self._live
        for ch in text:
            if not rx.anchored or self.offset == 0:  # a thread may start here (the latest)
                for s in rx._start_closure:
                    live.setdefault(s, self.offset)
            moved = sorted((begin, st[1]) for s, begin in live.items()
                           if (st := step[s]) is not None and st[0](ch))  # fmt: skip
            # Each state is reached once per character, first from the earliest start
            # (Thompson's construction: the work is bounded by the NFA's size).
            nxt: dict[int, int] = {}
            seen: set[int] = set()
            for begin, t in moved:
                stack = [t]
                while stack:
                    u = stack.pop()
                    if u in seen:
                        continue
                    seen.add(u)
                    if split[u]:
                        stack.extend(split[u])
                    else:
                        nxt[u] = begin
            self.offset += 1
            if accept in nxt:
                self._live = {}
                return nxt[accept], self.offset
            live = nxt
        self._live = live
        return None

    def earliest_live_start(self) -> int | None:
        """Where the earliest match that may still complete would start (text from
        there on must be held back), or None."""
        return min(self._live.values(), default=None)
