"""JSON Schema (the part structured outputs use) as a regular expression that token_fsm.py
can constrain a generation to.

Theory of operation: the schema is walked once and each node becomes a pattern for
one JSON value of that shape; the output is a single value. Objects list the
properties of `properties` in order, those not `required` optional (strict
structured outputs require every one), separated by "," or ", " and ":" or ": " (no
other whitespace: a model that writes JSON across lines is held to one line); an
object schema without `properties` is any object (its values of
`additionalProperties`' schema where that is one).
Arrays take `items` repeated between `minItems` and `maxItems` (any values without
`items`). Strings are JSON strings (escapes included) with `minLength`/`maxLength`
counted in characters, or their `pattern` (a whole-string match: a leading ^ and a
trailing $ change nothing), or their `format` (date-time, date, time, duration,
email, hostname, ipv4, ipv6, uuid, uri). Integers keep to `minimum`/`maximum` and
their exclusive forms exactly; numbers too, in decimal notation, with bounds rounded
to integers inward (so a bound of 0.5 admits 1 and up). `enum` and `const` are their
JSON texts; `anyOf`/`oneOf` and type lists are alternatives; `$ref` to `#`,
`#/$defs/...` or `#/definitions/...` is inlined. A node that says nothing about its
value (`{}`, `true`, a description alone) is any JSON value. A regular language cannot count
brackets, so what is free nests a bounded number of objects or arrays: `json_object()`
(any JSON object) holds values nesting JSON_OBJECT_DEPTH levels; a schema free from
its top alike (`{}` is such a value, `{"type": "object"}` is `json_object()`); a free
value or container inside a schema nests ANY_DEPTH levels, itself counted.

Values are spelled as JSON, or (the PYTHON dialect, `keyword_args_regex`) as Python
literals: True, False and None, the keyword arguments of a call `name=value, ...` in
place of an object's members (pythonic tool calls); strings, numbers, lists and dicts
are written alike in both. The dialects, free values and member lists are
json_values.py's.

A reference (`#` for the whole schema) may recur: it is expanded up to ebnf.py's
MAX_RECURSION times inside itself (fewer where the automaton would pass the
constraint's limit of states), and below that only what can do without it is kept: a property that is
not required is left out, an array with no `minItems` stays empty, an `anyOf` keeps
its other branches. Refused with a ValueError that names the keyword: a recursion with
no such way out, `patternProperties`, `allOf` of more than one schema, an unknown
`format`, a `multipleOf` that is not a number above 0, and anything nested deeper
than MAX_DEPTH. `multipleOf` is exact, bounds included (lexical.py; no exponent form
then): for integers whose step divides a power of ten (2, 5, 8, 10, 20, 25, 40, 50,
100, ...; a step of 2.5 is 5) and numbers whose step is such an integer or 1/2^a5^b
(0.1, 0.01, 0.5, 0.25, 0.2, 0.125, 0.05, ...); any other step where both bounds leave
at most lexical.MAX_LISTED multiples. Not enforced (the output is valid JSON of the
right shape, but these are not checked): other steps (an unbounded multiple of 3,
0.3, 1.5 or 16: the bounds alone), and `minLength`/`maxLength` beside a `pattern` or
`format`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from shunter.actors.grammar.json_values import (
    ANY_DEPTH,
    JSON,
    PYTHON,
    SPACE,
    Dialect,
    any_value,
    members_in_order,
    object_of,
)
from shunter.actors.grammar.lexical import (
    FORMATS,
    Irregular,
    alt,
    bounds,
    exact,
    integers,
    multiples,
    numbers,
)
from shunter.actors.grammar.regex import MAX_CONSTRAINT_CHARS, Nfa, PatternTooLarge

MAX_DEPTH = 16
JSON_OBJECT_DEPTH = 3


def _alt_some(parts: list[str | None]) -> str | None:
    """The alternatives that are not None; None if none is left."""
    kept = [p for p in parts if p is not None]
    return alt(kept) if kept else None


class _Converter:
    def __init__(self, root: dict, max_recursion: int = 3, dialect: Dialect = JSON) -> None:
        self.root = root
        self.max_recursion = max_recursion
        self.d = dialect
        self.refs: list[str] = ["#"]  # the references being expanded; the root is "#"

    def fail(self, why: str) -> ValueError:
        return ValueError(f"json_schema: {why}")

    def value(self, node: Any, depth: int) -> str | None:
        """The pattern of node's values; None where none fits within the recursion
        bound (a reference already expanded max_recursion times inside itself).
        PatternTooLarge as soon as a part passes MAX_CONSTRAINT_CHARS."""
        pattern = self._value(node, depth)
        if pattern is not None and len(pattern) > MAX_CONSTRAINT_CHARS:
            raise PatternTooLarge(f"json_schema: the schema's pattern passes "
                                  f"{MAX_CONSTRAINT_CHARS} characters")  # fmt: skip
        return pattern

    def _value(self, node: Any, depth: int) -> str | None:
        if depth > MAX_DEPTH:
            raise self.fail(f"nested deeper than {MAX_DEPTH} levels")
        if node is True:
            return self.free(depth)
        if not isinstance(node, dict):
            raise self.fail(f"a schema must be an object, got {node!r}")
        if "$ref" in node:
            return self.ref(node["$ref"], depth)
        if "patternProperties" in node:
            raise self.fail("'patternProperties' is not supported")
        if "allOf" in node:
            if len(node["allOf"]) != 1:
                raise self.fail("'allOf' of more than one schema is not supported")
            return self.value(node["allOf"][0], depth + 1)
        if "const" in node:
            return self.d.literal(node["const"])
        if "enum" in node:
            if not node["enum"]:
                raise self.fail("'enum' must not be empty")
            return alt([self.d.literal(v) for v in node["enum"]])
        for key in ("anyOf", "oneOf"):
            if key in node:
                return _alt_some([self.value(n, depth + 1) for n in node[key]])
        types = node.get("type")
        if types is None:
            if "properties" in node or "additionalProperties" in node:
                types = "object"
            elif "items" in node:
                types = "array"
            elif "pattern" in node or "format" in node:
                types = "string"
            else:
                return self.free(depth)
        if isinstance(types, list):
            return _alt_some([self.typed({**node, "type": t}, t, depth) for t in types])
        return self.typed(node, types, depth)

    def typed(self, node: dict, kind: str, depth: int) -> str | None:
        if kind == "object":
            return self.obj(node, depth)
        if kind == "array":
            return self.array(node, depth)
        if kind == "string":
            return self.string(node)
        if kind in ("integer", "number"):
            return self.numeric(node, kind)
        if self.d.scalar(kind) is None:
            raise self.fail(f"unknown type {kind!r}")
        return self.d.scalar(kind)

    def numeric(self, node: dict, kind: str) -> str:
        """An integer or number within its bounds, a multiple of `multipleOf` where a
        pattern can say so (lexical.multiples)."""
        step = None
        if "multipleOf" in node:
            step = exact(node["multipleOf"])
            if step is None or step <= 0:
                raise self.fail(f"'multipleOf' must be a number above 0, got "
                                f"{json.dumps(node['multipleOf'])[:40]}")  # fmt: skip
            if kind == "integer" and step.numerator == 1:  # every integer is a multiple
                step = None
        try:
            if step is None:
                raise Irregular
            pattern = multiples(node, step, kind == "integer")
        except Irregular:  # no multipleOf, or one not enforced: the bounds alone
            lo, hi = bounds(node)
            if lo is None and hi is None:
                return self.d.scalar(kind)
            pattern = (integers if kind == "integer" else numbers)(lo, hi)
        if pattern is None:
            raise self.fail(f"no {kind} is within {json.dumps(node)[:80]}")
        return pattern

    def free(self, depth: int, *, inside: bool = False) -> str:
        """Any value where a schema says nothing (the module docstring's depths); inside:
        a member of a free object or array at this depth."""
        return any_value(JSON_OBJECT_DEPTH if depth == 0 else ANY_DEPTH - inside, self.d)

    def string(self, node: dict) -> str:
        if "pattern" in node:
            return f'"(?J:{self.pattern(node["pattern"])})"'
        if "format" in node:
            if node["format"] not in FORMATS:
                raise self.fail(f"format {node['format']!r} is not supported (one of "
                                f"{', '.join(sorted(FORMATS))})")  # fmt: skip
            return f'"(?:{FORMATS[node["format"]]})"'
        if "minLength" in node or "maxLength" in node:
            lo = int(node.get("minLength", 0))
            hi = node.get("maxLength")
            return f'"{self.d.string_char}{{{lo},{"" if hi is None else int(hi)}}}"'
        return self.d.string

    def pattern(self, pattern: str) -> str:
        if not isinstance(pattern, str):
            raise self.fail("'pattern' must be a string")
        return whole_match_body(pattern, "json_schema pattern")

    def obj(self, node: dict, depth: int) -> str | None:
        if "properties" not in node:
            extra = node.get("additionalProperties", True)
            if extra is False:
                return r"\{\}"
            free = extra is True or extra == {}
            value = self.free(depth, inside=True) if free else self.value(extra, depth + 1)
            return r"\{\}" if value is None else object_of(value, self.d)
        props = node.get("properties") or {}
        if not isinstance(props, dict):
            raise self.fail("'properties' must be an object")
        required = set(node.get("required") or ())
        members = []
        for name, schema in props.items():
            value = self.value(schema, depth + 1)
            if value is None:  # past the recursion bound: left out where it may be
                if name in required:
                    return None
                continue
            members.append((self.d.literal(name) + ":" + SPACE + value, name in required))
        return r"\{" + members_in_order(members) + r"\}"

    def array(self, node: dict, depth: int) -> str | None:
        items = node.get("items")
        item = self.free(depth, inside=True) if items is None else self.value(items, depth + 1)
        lo, hi = int(node.get("minItems", 0)), node.get("maxItems")
        if item is None:
            return r"\[\]" if lo == 0 else None
        rest_hi = "" if hi is None else str(max(int(hi) - 1, 0))
        more = f"(?:,{SPACE}{item}){{{max(lo - 1, 0)},{rest_hi}}}"
        body = f"{item}{more}"
        if hi is not None and int(hi) == 0:
            return r"\[\]"
        return r"\[" + (body if lo >= 1 else f"(?:{body})?") + r"\]"

    def ref(self, ref: str, depth: int) -> str | None:
        if ref == "#":
            target = self.root
        else:
            prefix = next((p for p in ("#/$defs/", "#/definitions/") if ref.startswith(p)), None)
            if prefix is None:
                raise self.fail(
                    f"only local references (#, #/$defs/...) are supported, got {ref!r}"
                )
            defs = self.root.get(prefix[2:-1]) or {}
            name = ref[len(prefix) :]
            if name not in defs:
                raise self.fail(f"reference {ref!r} names no definition")
            target = defs[name]
        if self.refs.count(ref) > self.max_recursion:
            return None
        self.refs.append(ref)
        try:
            return self.value(target, depth + 1)
        finally:
            self.refs.pop()


def json_object_arg(value: Any, name: str) -> dict:
    """A parameter given as a JSON object or as its text, as a dict; ValueError naming
    `name` otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object")
    return value


def whole_match_body(pattern: str, param: str) -> str:
    """A pattern that is matched whole, its anchors dropped (a leading ^ and a trailing
    $ change nothing), checked on its own (so that it cannot close the group it is put
    in); ValueError naming `param` if refused."""
    body = pattern[1:] if pattern.startswith("^") else pattern
    if body.endswith("$"):
        backslashes = len(body) - 1 - len(body[:-1].rstrip("\\"))
        if backslashes % 2 == 0:  # not an escaped "\\$"
            body = body[:-1]
    Nfa(body or "(?:)", param=param, max_states=100_000)
    return body


def schema_regex(schema: dict | str) -> str:
    """The pattern of the JSON values `schema` describes (module docstring)."""
    schema = json_object_arg(schema, "json_schema")
    return _unrolled(schema, lambda c: c.value(schema, 0), JSON)


def keyword_args_regex(schema: dict) -> str:
    """The keyword arguments `name=value, ...` of a Python call whose parameters
    `schema` (an object schema) describes, values as Python literals (pythonic tool
    calls): the properties in order, those not required optional; without
    `properties`, any identifiers with any values."""
    schema = json_object_arg(schema, "parameters")

    def kwargs(c: _Converter) -> str | None:
        if "properties" not in schema:
            member = r"[A-Za-z_][A-Za-z0-9_]*=" + c.free(1)
            return f"(?:{member}(?:,{SPACE}{member})*)?"
        required = set(schema.get("required") or ())
        members = []
        for name, node in (schema.get("properties") or {}).items():
            value = c.value(node, 1)
            if value is None:
                if name in required:
                    return None
                continue
            members.append((re.escape(name) + "=" + value, name in required))
        return members_in_order(members)

    return _unrolled(schema, kwargs, PYTHON, empty_ok=True)  # no parameters: ()


def _unrolled(schema: dict, write_with: Callable[[_Converter], str | None], d: Dialect, *,
              empty_ok: bool = False) -> str:  # fmt: skip
    from shunter.actors.grammar.ebnf import unroll

    def write(levels: int) -> str | None:
        try:
            return write_with(_Converter(schema, levels, d))
        except (TypeError, AttributeError, KeyError) as e:  # a keyword's value of the wrong kind
            raise ValueError(
                f"json_schema: a keyword has a value of the wrong type ({e})"
            ) from None

    return unroll(write, "json_schema", empty_ok=empty_ok)


def json_object(depth: int = JSON_OBJECT_DEPTH) -> str:
    """Any JSON object whose values nest at most `depth` objects or arrays deep."""
    return object_of(any_value(depth))
