"""Regular expressions as Thompson NFAs: the compiler (its parser in regex_parser.py)
behind stop regexes (actors/tokenizer/stop_regex.py) and constrained decoding
(token_fsm.py).

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

from shunter.actors.grammar.regex_extensions import chars_or_others, word_automaton
from shunter.actors.grammar.regex_parser import Parser, Pred

MAX_PATTERN_CHARS = 1000
MAX_CONSTRAINT_CHARS = (
    200_000  # what a schema or grammar becomes may be long; states bound the work
)


class PatternTooLarge(ValueError):
    """A pattern written from a schema or grammar passed MAX_CONSTRAINT_CHARS (json_schema.py
    and ebnf.py stop as soon as a part of it does, so no input makes them run long)."""


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
        self.anchored, tree = Parser(pattern, param, end_anchor, extensions).parse()
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
