"""JSON values as regular expressions, whatever their schema: how values are spelled
(the JSON and Python-literal dialects), any value nesting a bounded depth, and an
object's members in order (json_schema.py writes schemas with these).

Theory of operation: a Dialect holds the patterns of one character of a string and of
true, false and null, and writes a literal value's text; strings, numbers, lists and
dicts are written alike in both dialects. Members and items are separated by "," or
", ", a key from its value by ":" or ": " (SPACE); `any_value` nests objects and
arrays around the scalars one level at a time.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, NamedTuple

from shunter.actors.grammar.lexical import FRACTION, alt

ANY_DEPTH = 1
SPACE = "[ ]?"
_INTEGER = r"-?(?:0|[1-9][0-9]{0,17})"
_NUMBER = _INTEGER + f"(?:{FRACTION})?" + r"(?:[eE][+-]?[0-9]{1,3})?"


def _python_text(value: Any) -> str:
    """A JSON value as a Python literal (True, False, None; strings, numbers, lists and
    dicts written as json.dumps writes them, which Python reads alike)."""
    if value is True or value is False or value is None:
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(map(_python_text, value)) + "]"
    if isinstance(value, dict):
        items = (
            json.dumps(k, ensure_ascii=False) + ": " + _python_text(v) for k, v in value.items()
        )
        return "{" + ", ".join(items) + "}"
    return json.dumps(value, ensure_ascii=False)


class Dialect(NamedTuple):
    """How values are spelled: JSON, or the Python literals of pythonic tool calls."""

    string_char: str  # one character of a string's content, escapes included
    true: str
    false: str
    null: str
    text: Callable[[Any], str]  # a value's text

    def literal(self, value: Any) -> str:
        return re.escape(self.text(value))

    @property
    def string(self) -> str:
        return f'"{self.string_char}*"'

    def scalar(self, kind: str) -> str | None:
        return {"string": self.string, "integer": _INTEGER, "number": _NUMBER,
                "boolean": f"(?:{self.true}|{self.false})", "null": self.null}.get(kind)  # fmt: skip


JSON = Dialect(r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})', "true", "false", "null",
               lambda v: json.dumps(v, ensure_ascii=False))  # fmt: skip
PYTHON = Dialect(r'(?:[^"\\\x00-\x1f]|\\["\\bfnrt]|\\u[0-9a-fA-F]{4})', "True", "False", "None",
                 _python_text)  # fmt: skip


def members_in_order(members: list[tuple[str, bool]]) -> str:
    """An object's members in order, each (pattern, required); one that is not required
    may be left out. Alternatives say which member comes first (no comma before it),
    up to the first required one."""
    sep = "," + SPACE

    def rest(i: int) -> str:
        return "".join(f"{sep}{m}" if req else f"(?:{sep}{m})?" for m, req in members[i:])

    firsts = []
    for k, (m, req) in enumerate(members):
        firsts.append(m + rest(k + 1))
        if req:
            break
    else:
        firsts.append("")  # every member left out
    return alt(firsts)


def object_of(value: str, d: Dialect = JSON) -> str:
    """Any object whose values match `value`."""
    member = d.string + ":" + SPACE + value
    return r"\{(?:" + member + "(?:," + SPACE + member + r")*)?\}"


def any_value(depth: int = ANY_DEPTH, d: Dialect = JSON) -> str:
    """Any JSON value nesting at most `depth` objects or arrays."""
    scalar = alt([d.string, _NUMBER, d.true, d.false, d.null])
    value = scalar
    for _ in range(depth):
        arr = r"\[(?:" + value + "(?:," + SPACE + value + r")*)?\]"
        value = alt([scalar, object_of(value, d), arr])
    return value
