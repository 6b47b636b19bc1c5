"""Structural tags in the format-object form (`{"type": "structural_tag", "format":
{...}}`, xgrammar's structural tags as newer SGLang takes them) as a regular expression
that token_fsm.py can constrain a generation to; structural_tag.py hands such specs here.

Theory of operation: a format is a tree of format objects, each the text of one chunk
of the output, and each becomes a pattern, its children's first. const_string is its
text; json_schema, grammar and regex are what json_schema.py, ebnf.py and the pattern
itself (matched whole, checked on its own) give; sequence, or, optional, plus, star and
repeat concatenate, alternate and repeat their parts; tag is begin + content + end (an
end may be a list of strings, any one of them). Free text is regex.py's `(?A:...)`,
text in which none of some words occurs; as in xgrammar, the words are
- any_text's `excludes` and the end strings of the nearest enclosing tag, so that
  `<think>` any_text `</think>` runs to the first `</think>` (no words: any text);
- triggered_tags': its triggers, its `excludes` and the nearest enclosing tag's ends.
  With F its free text and S one of its tags (whose begin starts with exactly one of
  the triggers) it is F (S F)*; at_least_one: (S F)+, no text before the first tag;
  stop_after_first: F S?; both: S;
- dispatch's: its rules' patterns and its `excludes` (xgrammar adds no enclosing end
  here). With D a rule's pattern then its format: F (D F)*; with loop false, F D?.
tags_with_separator is T (separator T)* or nothing, T one of its tags; at_least_one:
not nothing; stop_after_first: one T at most.

A format tree has no references, so every format is a regular language and nothing is
unrolled; only sizes are bounded: nesting (MAX_NESTING), repeat counts (regex_parser.py's
MAX_REPEAT), the pattern and its automaton (the constraint's limits). Refused with a
ValueError naming the node's path (`format.elements[2].tags[0].begin`) and the reason:
token-level formats (token, exclude_token, any_tokens, token_triggered_tags,
token_dispatch, and a tag's begin or end given as a token: the constraint is on text),
any_text's length budgets (max_tokens, max_chars), json_schema's styles other than
json and its any_order, the deprecated qwen_xml_parameter, unknown types, fields that
are missing or of the wrong kind, a triggered_tags tag whose begin starts with none of
the triggers or with more than one.

Invariants: a pure function of the spec; every format's pattern can be concatenated
as it is (alternatives are grouped) and keeps to regex.py's syntax with its extensions.
"""

from __future__ import annotations

import re
from typing import Any

from shunter.actors.grammar.ebnf import ebnf_regex
from shunter.actors.grammar.json_schema import schema_regex, whole_match_body
from shunter.actors.grammar.regex import MAX_CONSTRAINT_CHARS
from shunter.actors.grammar.regex_parser import MAX_REPEAT

MAX_NESTING = 32  # format objects inside each other, at most
TOKEN_LEVEL = ("token", "exclude_token", "any_tokens", "token_triggered_tags", "token_dispatch")
_REQUIRED = object()


def _fail(path: str, why: str) -> ValueError:
    return ValueError(f"structural_tag: {path} {why}")


def _field(node: dict, path: str, key: str, kinds: tuple[type, ...], what: str,
           default: Any = _REQUIRED) -> Any:  # fmt: skip
    """node[key], one of `kinds` (a bool is no int); `default` where it is missing or
    null, a ValueError naming its path where it is required or of another kind."""
    value = node.get(key)
    if value is None:
        if default is _REQUIRED:
            raise _fail(f"{path}.{key}", f"is required: {what}")
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise _fail(f"{path}.{key}", f"must be {what}")
    return value


def _words(node: dict, path: str, key: str, *, required: bool = False) -> list[str]:
    """node[key], a list of non-empty strings (empty where it may be left out)."""
    what = "a non-empty list of non-empty strings" if required else "a list of non-empty strings"
    words = _field(node, path, key, (list,), what, _REQUIRED if required else [])
    if required and not words:
        raise _fail(f"{path}.{key}", f"must be {what}")
    for i, word in enumerate(words):
        if not isinstance(word, str) or not word:
            raise _fail(f"{path}.{key}[{i}]", "must be a non-empty string")
    return words


def _free(words: list[str]) -> str:
    """Text in which none of `words` occurs; any text where there are none."""
    kept = list(dict.fromkeys(words))
    return "(?A:" + "|".join(map(re.escape, kept)) + ")" if kept else r"[\s\S]*"


def _one_of(patterns: list[str]) -> str:
    return "(?:" + "|".join(patterns) + ")"


class _Writer:
    """Format objects to patterns (module docstring); `ends` are the end strings of the
    nearest enclosing tag, which free text stops at."""

    def __init__(self) -> None:
        self.depth = 0

    def write(self, node: Any, path: str, ends: tuple[str, ...]) -> str:
        if node is None:
            raise _fail(path, 'is required: a format object {"type": ...}')
        if not isinstance(node, dict):
            raise _fail(path, 'must be a format object {"type": ...}')
        kind = node.get("type")
        if not isinstance(kind, str):
            raise _fail(f"{path}.type", "must be a format type's name")
        if kind in TOKEN_LEVEL:
            raise _fail(f"{path}.type", f"{kind!r} is a token-level format, which is not "
                        "supported (the constraint is on text)")  # fmt: skip
        if kind == "qwen_xml_parameter":
            raise _fail(f"{path}.type", "'qwen_xml_parameter' is not supported (only "
                        "json_schema's json style)")  # fmt: skip
        if kind not in _WRITERS:
            raise _fail(f"{path}.type", f"{kind!r} is not a format type (one of "
                        f"{', '.join(_WRITERS)})")  # fmt: skip
        if self.depth >= MAX_NESTING:
            raise _fail(path, f"nests formats more than {MAX_NESTING} deep")
        self.depth += 1
        try:
            pattern = _WRITERS[kind](self, node, path, ends)
        finally:
            self.depth -= 1
        if len(pattern) > MAX_CONSTRAINT_CHARS:
            raise _fail(path, f"makes a pattern of more than {MAX_CONSTRAINT_CHARS} characters")
        return pattern

    def const_string(self, node: dict, path: str, ends: tuple[str, ...]) -> str:
        return re.escape(_field(node, path, "value", (str,), "a string"))

    def json_schema(self, node: dict, path: str, ends: tuple[str, ...]) -> str:
        schema = node.get("json_schema")
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise _fail(f"{path}.json_schema", "must be a JSON Schema (an object, or true)")
        style = _field(node, path, "style", (str,), "a string", "json")
        if style != "json":
            raise _fail(f"{path}.style", f"{style!r} is not supported (only 'json')")
        if _field(node, path, "any_order", (bool,), "a boolean", False):
            raise _fail(f"{path}.any_order", "is not supported (properties come in the "
                        "order the schema lists them)")  # fmt: skip
        spaces = _field(node, path, "max_whitespace_cnt", (int,), "an integer", 1)
        if spaces < 1:
            raise _fail(f"{path}.max_whitespace_cnt", "below 1 is not supported (a space "
                        "may follow a ',' or ':')")  # fmt: skip
        try:
            return schema_regex(schema)
        except ValueError as e:
            raise _fail(f"{path}.json_schema:", str(e)) from None

    def grammar(self, node: dict, path: str, ends: tuple[str, ...]) -> str:
        grammar = _field(node, path, "grammar", (str,), "EBNF text")
        try:
            return "(?:" + ebnf_regex(grammar) + ")"
        except ValueError as e:
            raise _fail(f"{path}.grammar:", str(e)) from None

    def regex(self, node: dict, path: str, ends: tuple[str, ...]) -> str:
        pattern = _field(node, path, "pattern", (str,), "a non-empty string")
        if not pattern:
            raise _fail(f"{path}.pattern", "must be a non-empty string")
        return "(?:" + whole_match_body(pattern, f"structural_tag: {path}.pattern") + ")"

    def any_text(self, node: dict, path: str, ends: tuple[str, ...]) -> str:
        for budget in ("max_tokens", "max_chars"):
            if node.get(budget) is not None:
                raise _fail(f"{path}.{budget}", "is not supported (a length budget; the "
                            "request's max_tokens bounds the whole output)")  # fmt: skip
        return _free(_words(node, path, "excludes") + list(ends))

    def elements(self, node: dict, path: str, ends: tuple[str, ...]) -> list[str]:
        what = "a non-empty list of formats"
        elements = _field(node, path, "elements", (list,), what)
        if not elements:
            raise _fail(f"{path}.elements", f"must be {what}")
        return [self.write(e, f"{path}.elements[{i}]", ends) for i, e in enumerate(elements)]

    def sequence(self, node: dict, path: str, ends: tuple[str, ...]) -> str:
        return "".join(self.elements(node, path, ends))

    def or_(self, node: dict, path: str, ends: tuple[str, ...]) -> str:
        return _one_of(self.elements(node, path, ends))

    def repeat(self, node: dict, path: str, ends: tuple[str, ...], lo: int = -1,
               hi: int = -1) -> str:  # fmt: skip
        """content {lo,hi} (hi -1: no bound); the repeat format's from its min and max."""
        if node.get("type") == "repeat":
            lo = _field(node, path, "min", (int,), "an integer")
            hi = _field(node, path, "max", (int,), "an integer (-1: no bound)")
            if lo < 0:
                raise _fail(f"{path}.min", "must be at least 0")
            if hi < -1 or 0 <= hi < lo:
                raise _fail(f"{path}.max", "must be -1 (no bound) or at least min")
            if max(lo, hi) > MAX_REPEAT:
                raise _fail(path, f"repeat counts are limited to {MAX_REPEAT}")
        content = self.write(node.get("content"), f"{path}.content", ends)
        if not content or hi == 0:
            return ""
        count = {(0, 1): "?", (0, -1): "*", (1, -1): "+"}.get((lo, hi))
        if count is None:
            count = f"{{{lo},{'' if hi == -1 else hi}}}"
        return f"(?:{content}){count}"

    def tag(self, node: dict, path: str, ends: tuple[str, ...]) -> str:
        for key in ("begin", "end"):
            if isinstance(node.get(key), dict):
                raise _fail(f"{path}.{key}", "is a token format, which is not supported "
                            "(the constraint is on text)")  # fmt: skip
        begin = _field(node, path, "begin", (str,), "a string")
        end = node.get("end")
        end = [end] if isinstance(end, str) else end
        if not (isinstance(end, list) and end and all(isinstance(e, str) for e in end)):
            raise _fail(f"{path}.end", "must be a string or a non-empty list of strings")
        content = self.write(node.get("content"), f"{path}.content", tuple(e for e in end if e))
        end_patterns = [re.escape(e) for e in dict.fromkeys(end)]
        end_pattern = end_patterns[0] if len(end_patterns) == 1 else _one_of(end_patterns)
        return re.escape(begin) + content + end_pattern

    def tags(self, node: dict, path: str) -> list[str]:
        """The patterns of node's `tags`, tag formats (their type may be left out)."""
        what = "a non-empty list of tag formats"
        tags = _field(node, path, "tags", (list,), what)
        if not tags:
            raise _fail(f"{path}.tags", f"must be {what}")
        patterns = []
        for i, tag in enumerate(tags):
            if isinstance(tag, dict):
                if tag.get("type", "tag") != "tag":
                    raise _fail(f"{path}.tags[{i}].type", "must be 'tag'")
                tag = {**tag, "type": "tag"}
            patterns.append(self.write(tag, f"{path}.tags[{i}]", ()))
        return patterns

    def triggered_tags(self, node: dict, path: str, ends: tuple[str, ...]) -> str:
        triggers = _words(node, path, "triggers", required=True)
        tags = self.tags(node, path)
        for i, tag in enumerate(node["tags"]):
            begin = tag["begin"]
            starts = sum(begin.startswith(t) for t in triggers)
            if starts != 1:
                raise _fail(f"{path}.tags[{i}].begin", f"{begin!r} starts with "
                            f"{'none' if not starts else 'more than one'} of the triggers")  # fmt: skip
        at_least_one = _field(node, path, "at_least_one", (bool,), "a boolean", False)
        stop_after_first = _field(node, path, "stop_after_first", (bool,), "a boolean", False)
        tag, free = _one_of(tags), _free(triggers + _words(node, path, "excludes") + list(ends))
        if at_least_one:
            return tag if stop_after_first else f"(?:{tag}{free})+"
        return f"{free}(?:{tag})?" if stop_after_first else f"{free}(?:{tag}{free})*"

    def tags_with_separator(self, node: dict, path: str, ends: tuple[str, ...]) -> str:
        tag = _one_of(self.tags(node, path))
        separator = re.escape(_field(node, path, "separator", (str,), "a string"))
        at_least_one = _field(node, path, "at_least_one", (bool,), "a boolean", False)
        stop_after_first = _field(node, path, "stop_after_first", (bool,), "a boolean", False)
        some = tag if stop_after_first else f"{tag}(?:{separator}{tag})*"
        return some if at_least_one else f"(?:{some})?"

    def dispatch(self, node: dict, path: str, ends: tuple[str, ...]) -> str:
        what = "a non-empty list of [pattern, format] pairs"
        rules = _field(node, path, "rules", (list,), what)
        if not rules:
            raise _fail(f"{path}.rules", f"must be {what}")
        patterns, rule_patterns = [], []
        for i, rule in enumerate(rules):
            if not (isinstance(rule, list) and len(rule) == 2):
                raise _fail(f"{path}.rules[{i}]", "must be a [pattern, format] pair")
            if not isinstance(rule[0], str) or not rule[0]:
                raise _fail(f"{path}.rules[{i}][0]", "must be a non-empty string")
            patterns.append(rule[0])
            content = self.write(rule[1], f"{path}.rules[{i}][1]", ends)
            rule_patterns.append(re.escape(rule[0]) + content)
        rule, free = _one_of(rule_patterns), _free(patterns + _words(node, path, "excludes"))
        if _field(node, path, "loop", (bool,), "a boolean", True):
            return f"{free}(?:{rule}{free})*"
        return f"{free}(?:{rule})?"


_WRITERS = {
    "const_string": _Writer.const_string,
    "json_schema": _Writer.json_schema,
    "grammar": _Writer.grammar,
    "regex": _Writer.regex,
    "any_text": _Writer.any_text,
    "sequence": _Writer.sequence,
    "or": _Writer.or_,
    "optional": lambda w, node, path, ends: w.repeat(node, path, ends, 0, 1),
    "plus": lambda w, node, path, ends: w.repeat(node, path, ends, 1, -1),
    "star": lambda w, node, path, ends: w.repeat(node, path, ends, 0, -1),
    "repeat": _Writer.repeat,
    "tag": _Writer.tag,
    "triggered_tags": _Writer.triggered_tags,
    "tags_with_separator": _Writer.tags_with_separator,
    "dispatch": _Writer.dispatch,
}


def format_regex(fmt: Any) -> str:
    """The pattern of the outputs the format object `fmt` allows (module docstring);
    ValueError naming the offending node's path where it is refused."""
    from shunter.actors.grammar.token_fsm import constraint_nfa

    pattern = _Writer().write(fmt, "format", ()) or "(?:)"  # "" would be no constraint
    try:
        constraint_nfa(pattern)
    except ValueError as e:
        raise _fail("format:", str(e)) from None
    return pattern
