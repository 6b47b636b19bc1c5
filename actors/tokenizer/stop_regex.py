"""Stop regexes (SGLang's `stop_regex`), matched on streamed text in linear time.

Theory of operation: the pattern is compiled into a Thompson NFA (actors/grammar/
regex.py, which also gives the syntax). `RegexScanner` simulates that NFA over the
output text one character at a time, the whole set of live states at once, each
state with the earliest output offset a thread through it started at, so the work is
(characters x states) whatever the pattern: no input can make it backtrack, which
Python's `re` could (a hostile pattern would stall the tokenizer, and with it every
request). A match is reported at the first character where any thread reaches the
accepting state, with the earliest start among those threads: generation stops as
soon as some match is complete. Until then the earliest start of any live thread is
where text must be held back, since a match may still begin there. So a match is the
first to end, not Python's leftmost-greedy one: with `no_stop_trim` the kept text ends
where the match first completed (`\\d+` keeps one digit), and where a later match
ends before an earlier-starting one could, the later one stops the request. `^`
anchors a match at the output's first character; `$` and patterns that match the
empty string (they would stop at once) are refused.

Invariants: scanning is a pure function of the text fed so far (no clock, no state
outside the scanner); a character reaches each NFA state at most once, so it costs at
most the NFA's size, and a request's patterns have at most MAX_STATES states together
(the tokenizer checks the sum).
"""

from __future__ import annotations

import functools

from shunter.actors.grammar.regex import Nfa

MAX_STATES = 500  # a request's patterns together: each character costs up to this many steps


class StopRegex:
    """A compiled stop regex (see the module docstring); `ValueError` if refused."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.nfa = Nfa(pattern, param="stop_regex", max_states=MAX_STATES)
        if self.nfa.matches_empty:
            raise ValueError(f"stop_regex {pattern!r} matches the empty string")

    @property
    def num_states(self) -> int:
        return self.nfa.num_states


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
        nfa = self.regex.nfa
        step, split, accept = nfa.step, nfa.split, nfa.accept
        live = self._live
        for ch in text:
            if not nfa.anchored or self.offset == 0:  # a thread may start here (the latest)
                for s in nfa.start_closure:
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
