"""EBNF grammars (SGLang's `ebnf` sampling parameter, in the GBNF dialect that
llama.cpp and xgrammar read) as a regular expression that token_fsm.py can constrain a
generation to.

Theory of operation: the grammar is parsed into rules, then the `root` rule is written
out as one pattern with every rule reference inlined. A context-free grammar is more
than a regular expression can say, so a rule may recur inside itself at most
MAX_RECURSION times (fewer where the automaton would pass the constraint's limit of
states); below that, only the branches that can do without it are kept (an
alternative without the reference, a repeat taken zero times, an optional part left
out). A grammar whose root cannot end that way is refused.

Syntax: `name ::= body` rules (a body runs on over lines until the next `name ::=`),
`#` comments, string literals in double or single quotes (escapes \\n \\t \\r \\\\ \\"
\\' \\xhh \\uhhhh \\Uhhhhhhhh), character classes `[...]` and `[^...]` with ranges and
the same escapes, `.` (any character), rule references, grouping `( )`, alternation
`|`, and the postfixes `* + ?` and `{n}` `{n,}` `{n,m}`. Refused with a ValueError
that says where: anything else, an undefined rule, a missing `root`.

Invariants: the pattern keeps to regex.py's syntax (and Python's `re`); every rule is
checked once whether or not root reaches it.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from shunter.actors.grammar.lexical import alt
from shunter.actors.grammar.regex import MAX_CONSTRAINT_CHARS, PatternTooLarge

MAX_RECURSION = 3  # a rule is expanded at most this many times inside itself
MAX_INLINE_DEPTH = 64  # rules inlined inside each other, at most
MAX_GRAMMAR_CHARS = 20_000
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
_RULE_START = re.compile(r"(?m)^[ \t]*([A-Za-z_][A-Za-z0-9_.-]*)[ \t]*::=")
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'", "[": "[",
            "]": "]", "-": "-", "^": "^", "/": "/", "0": "\0", "f": "\f", "v": "\v"}  # fmt: skip

# Expression nodes: ("lit", text) | ("class", negate, [(lo, hi)]) | ("any",) | ("ref", name)
# | ("seq", [nodes]) | ("alt", [nodes]) | ("rep", node, lo, hi or None)


class _Parser:
    def __init__(self, text: str) -> None:
        self.p = text
        self.i = 0

    def fail(self, why: str) -> ValueError:
        line = self.p.count("\n", 0, self.i) + 1
        return ValueError(f"ebnf: {why} (line {line})")

    def skip(self, newlines: bool) -> None:
        """Past spaces and comments (and newlines where the expression cannot end)."""
        while self.i < len(self.p):
            c = self.p[self.i]
            if c == "#":
                end = self.p.find("\n", self.i)
                self.i = len(self.p) if end < 0 else end
            elif c in " \t\r" or (c == "\n" and newlines):
                self.i += 1
            else:
                return

    def rules(self) -> dict[str, tuple]:
        starts = list(_RULE_START.finditer(self.p))
        self.i = 0
        self.skip(newlines=True)
        if not starts or starts[0].start() > self.i:
            raise self.fail("a grammar is rules of the form `name ::= ...`")
        rules: dict[str, tuple] = {}
        for k, m in enumerate(starts):
            name = m.group(1)
            if name in rules:
                self.i = m.start()
                raise self.fail(f"rule {name!r} is defined twice")
            end = starts[k + 1].start() if k + 1 < len(starts) else len(self.p)
            self.i = m.end()
            rules[name] = self.alt(end)
            self.skip(newlines=True)
            if self.i < end:
                raise self.fail(f"unexpected {self.p[self.i]!r} in rule {name!r}")
        return rules

    def alt(self, end: int, depth: int = 0) -> tuple:
        branches = [self.seq(end, depth)]
        while True:
            self.skip(newlines=True)
            if self.i < end and self.p[self.i] == "|":
                self.i += 1
                branches.append(self.seq(end, depth))
            else:
                return branches[0] if len(branches) == 1 else ("alt", branches)

    def seq(self, end: int, depth: int) -> tuple:
        items = []
        while True:
            self.skip(newlines=True)
            if self.i >= end or self.p[self.i] in "|)":
                break
            items.append(self.postfix(end, depth))
        if not items:
            return ("seq", [])
        return items[0] if len(items) == 1 else ("seq", items)

    def postfix(self, end: int, depth: int) -> tuple:
        node = self.atom(end, depth)
        while self.i < end and self.p[self.i] in "*+?{":
            c = self.p[self.i]
            if c == "{":
                close = self.p.find("}", self.i)
                m = re.fullmatch(r"\s*(\d+)\s*(,\s*(\d*)\s*)?", self.p[self.i + 1 : close])
                if close < 0 or close > end or m is None:
                    raise self.fail("a repeat is {n}, {n,} or {n,m}")
                lo = int(m.group(1))
                hi = lo if m.group(2) is None else (int(m.group(3)) if m.group(3) else None)
                if hi is not None and hi < lo:
                    raise self.fail(f"{{{lo},{hi}}}: the maximum is below the minimum")
                self.i = close + 1
            else:
                self.i += 1
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            node = ("rep", node, lo, hi)
        return node

    def atom(self, end: int, depth: int) -> tuple:
        c = self.p[self.i]
        if c in "\"'":
            return self.literal(c, end)
        if c == "[":
            return self.char_class(end)
        if c == ".":
            self.i += 1
            return ("any",)
        if c == "(":
            if depth > 64:
                raise self.fail("groups are nested too deep")
            self.i += 1
            node = self.alt(end, depth + 1)
            if self.i >= end or self.p[self.i] != ")":
                raise self.fail("missing ')'")
            self.i += 1
            return node
        m = _NAME.match(self.p, self.i)
        if m is None or m.end() > end:
            raise self.fail(f"unexpected {c!r}")
        self.i = m.end()
        return ("ref", m.group())

    def char(self, end: int) -> str:
        """One character of a literal or class, escapes read."""
        if self.i >= end:
            raise self.fail("unterminated literal or class")
        c = self.p[self.i]
        self.i += 1
        if c != "\\":
            return c
        if self.i >= end:
            raise self.fail("a backslash ends the rule")
        e = self.p[self.i]
        self.i += 1
        if e in _ESCAPES:
            return _ESCAPES[e]
        width = {"x": 2, "u": 4, "U": 8}.get(e)
        digits = self.p[self.i : self.i + width] if width else ""
        if not width or not re.fullmatch(r"[0-9a-fA-F]+", digits) or len(digits) != width:
            raise self.fail(f"unknown escape \\{e}")
        self.i += width
        if int(digits, 16) > 0x10FFFF:
            raise self.fail(f"\\{e}{digits} is no character")
        return chr(int(digits, 16))

    def literal(self, quote: str, end: int) -> tuple:
        self.i += 1
        text = []
        while self.i < end and self.p[self.i] != quote:
            text.append(self.char(end))
        if self.i >= end:
            raise self.fail("unterminated string")
        self.i += 1
        return ("lit", "".join(text))

    def char_class(self, end: int) -> tuple:
        self.i += 1
        negate = self.i < end and self.p[self.i] == "^"
        self.i += negate
        ranges = []
        while self.i < end and self.p[self.i] != "]":
            lo = self.char(end)
            hi = lo
            if self.i + 1 < end and self.p[self.i] == "-" and self.p[self.i + 1] != "]":
                self.i += 1
                hi = self.char(end)
                if hi < lo:
                    raise self.fail(f"bad range {lo!r}-{hi!r}")
            ranges.append((lo, hi))
        if self.i >= end:
            raise self.fail("unterminated character class")
        self.i += 1
        if not ranges and not negate:
            raise self.fail("an empty character class matches nothing")
        return ("class", negate, ranges)


def _class_char(c: str) -> str:
    if c in "\\]^-[":
        return "\\" + c
    return c if c.isprintable() and c != " " else f"\\u{ord(c):04x}" if ord(c) < 0x10000 else c


class _Writer:
    """Rules to one pattern, references inlined (module docstring)."""

    def __init__(self, rules: dict[str, tuple], max_recursion: int) -> None:
        self.rules = rules
        self.max_recursion = max_recursion
        self.stack: list[str] = []

    def write(self, node: tuple) -> str | None:
        """Node's pattern; None where nothing fits within the recursion bound.
        PatternTooLarge as soon as a part passes MAX_CONSTRAINT_CHARS (a rule used
        twice in each of a chain of rules would double it at every link)."""
        pattern = self._write(node)
        if pattern is not None and len(pattern) > MAX_CONSTRAINT_CHARS:
            raise PatternTooLarge(f"ebnf: the grammar's pattern passes {MAX_CONSTRAINT_CHARS} "
                                  "characters")  # fmt: skip
        return pattern

    def _write(self, node: tuple) -> str | None:
        kind = node[0]
        if kind == "lit":
            return re.escape(node[1])
        if kind == "any":
            return r"[\s\S]"
        if kind == "class":
            _, negate, ranges = node
            body = "".join(_class_char(a) if a == b else f"{_class_char(a)}-{_class_char(b)}"
                           for a, b in ranges)  # fmt: skip
            return f"[{'^' if negate else ''}{body}]" if body else r"[\s\S]"
        if kind == "ref":
            name = node[1]
            if self.stack.count(name) > self.max_recursion:
                return None
            if len(self.stack) >= MAX_INLINE_DEPTH:
                raise ValueError(
                    f"ebnf: rules refer to each other more than {MAX_INLINE_DEPTH} deep"
                )
            self.stack.append(name)
            try:
                return self.write(self.rules[name])
            finally:
                self.stack.pop()
        if kind == "seq":
            parts = [self.write(n) for n in node[1]]
            if any(p is None for p in parts):
                return None
            return "(?:" + "".join(parts) + ")" if len(parts) > 1 else (parts[0] if parts else "")
        if kind == "alt":
            kept = [p for p in map(self.write, node[1]) if p is not None]
            return alt(kept) if kept else None
        _, child, lo, hi = node
        inner = self.write(child)
        if inner is None:
            return "" if lo == 0 else None
        if hi == 0:
            return ""
        count = {(0, None): "*", (1, None): "+", (0, 1): "?"}.get((lo, hi))
        if count is None:
            count = f"{{{lo}}}" if lo == hi else f"{{{lo},{'' if hi is None else hi}}}"
        return f"(?:{inner}){count}"


def _references(node: tuple) -> list[str]:
    kind = node[0]
    if kind == "ref":
        return [node[1]]
    if kind in ("seq", "alt"):
        return [r for child in node[1] for r in _references(child)]
    if kind == "rep":
        return _references(node[1])
    return []


def ebnf_regex(grammar: str, root: str = "root") -> str:
    """The pattern of the texts `grammar`'s `root` rule derives (module docstring)."""
    if not isinstance(grammar, str) or not grammar.strip():
        raise ValueError("ebnf must be a non-empty string")
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"ebnf is limited to {MAX_GRAMMAR_CHARS} characters")
    rules = _Parser(grammar).rules()
    for name, body in rules.items():
        for ref in _references(body):
            if ref not in rules:
                raise ValueError(f"ebnf: rule {name!r} refers to {ref!r}, which is not defined")
    if root not in rules:
        raise ValueError(f"ebnf: the grammar has no {root!r} rule")
    return unroll(lambda depth: _Writer(rules, depth).write(("ref", root)),
                  f"ebnf: {root!r}")  # fmt: skip


def unroll(write: Callable[[int], str | None], what: str, *, empty_ok: bool = False) -> str:
    """The pattern write(levels) gives for the most levels of recursion, from
    MAX_RECURSION down, whose automaton is within the constraint's limit of states;
    ValueError if none ends or fits. (json_schema.py unrolls its references the same
    way.)"""
    from shunter.actors.grammar.token_fsm import constraint_nfa

    too_large = None
    for levels in range(MAX_RECURSION, -1, -1):
        try:
            pattern = write(levels)
        except PatternTooLarge as e:
            too_large = e
            continue
        if pattern is None:
            break
        if pattern == "":
            if empty_ok:
                return pattern
            raise ValueError(f"{what} derives only the empty text")
        if levels == MAX_RECURSION and write(levels - 1) == pattern:
            return pattern  # nothing recurs: its size is the tokenizer's to check
        try:
            constraint_nfa(pattern)
        except ValueError as e:
            too_large = e
            continue
        return pattern
    if too_large is not None:
        raise too_large
    raise ValueError(f"{what} recurs with no way to end within {MAX_RECURSION} levels "
                     "(a branch, an option, an empty repeat without the recursion)")  # fmt: skip
