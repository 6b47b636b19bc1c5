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

A reference (`#` for the whole schema) may recur: it is expanded up to ebnf.py's
MAX_RECURSION times inside itself (fewer where the automaton would pass the
constraint's limit of states), and below that only what can do without it is kept: a property that is
not required is left out, an array with no `minItems` stays empty, an `anyOf` keeps
its other branches. Refused with a ValueError that names the keyword: a recursion with
no such way out, `patternProperties`, `allOf` of more than one schema, an unknown
`format`, and anything nested deeper than MAX_DEPTH. Not enforced (the output is
valid JSON of the right shape, but these are not checked): `multipleOf`, and
`minLength`/`maxLength` beside a `pattern` or `format`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from shunter.actors.grammar.regex import MAX_CONSTRAINT_CHARS, PatternTooLarge

MAX_DEPTH = 16
JSON_OBJECT_DEPTH = 2
ANY_DEPTH = 1
MAX_DIGITS = 18  # integers and integer parts have at most this many digits
_SPACE = "[ ]?"
_STRING_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'
_INTEGER = r"-?(?:0|[1-9][0-9]{0,17})"
_FRACTION = r"\.[0-9]{1,17}"
_NUMBER = _INTEGER + f"(?:{_FRACTION})?" + r"(?:[eE][+-]?[0-9]{1,3})?"
_SCALARS = {
    "string": f'"{_STRING_CHAR}*"',
    "integer": _INTEGER,
    "number": _NUMBER,
    "boolean": "(?:true|false)",
    "null": "null",
}


def _literal(value: Any) -> str:
    return re.escape(json.dumps(value, ensure_ascii=False))


def _alt(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


def _alt_some(parts: list[str | None]) -> str | None:
    """The alternatives that are not None; None if none is left."""
    kept = [p for p in parts if p is not None]
    return _alt(kept) if kept else None


_DATE = r"[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])"
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:(?:[0-5][0-9]|60)(?:\.[0-9]{1,9})?(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_H16 = r"[0-9A-Fa-f]{1,4}"


def _some(parts: list[str]) -> str:
    """One or more of `parts`, in their order."""
    return _alt(
        [parts[i] + "".join(f"(?:{p})?" for p in parts[i + 1 :]) for i in range(len(parts))]
    )


_SECONDS = _some(["[0-9]{1,9}H", "[0-9]{1,9}M", r"[0-9]{1,9}(?:\.[0-9]{1,9})?S"])
_FORMATS = {  # the string formats of JSON Schema's validation vocabulary that we shape
    "date-time": _DATE + r"[Tt ]" + _TIME,
    "date": _DATE,
    "time": _TIME,
    "duration": "P(?:[0-9]{1,9}W|" + _some(["[0-9]{1,9}Y", "[0-9]{1,9}M", "[0-9]{1,9}D"])
                + "(?:T" + _SECONDS + ")?|T" + _SECONDS + ")",
    "email": r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]{1,64}(?:\.[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]{1,64}){0,8}"
             r"@" + _LABEL + r"(?:\." + _LABEL + r"){0,8}",
    "hostname": _LABEL + r"(?:\." + _LABEL + r"){0,8}",
    "ipv4": _OCTET + r"(?:\." + _OCTET + r"){3}",
    "ipv6": "(?:" + "|".join(  # eight groups, or at most seven around one "::"
        [f"(?:{_H16}:){{7}}{_H16}"]
        + [(f"(?:{_H16}:){{{i - 1}}}{_H16}" if i else "") + "::"
           + (f"(?:(?:{_H16}:){{0,{6 - i}}}{_H16})?" if i < 7 else "") for i in range(8)]) + ")",
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "uri": r"[A-Za-z][A-Za-z0-9+.-]{0,31}:[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=%]{1,256}",
}  # fmt: skip


def _digits_between(lo: str, hi: str) -> str:
    """The decimal strings of one length from lo to hi (lo <= hi, no sign)."""
    if lo == hi:
        return lo
    if len(lo) == 1:
        return f"[{lo}-{hi}]"
    if lo[0] == hi[0]:
        return lo[0] + _digits_between(lo[1:], hi[1:])
    rest = len(lo) - 1
    low_full, high_full = lo[1:] == "0" * rest, hi[1:] == "9" * rest
    first, last = int(lo[0]) + (not low_full), int(hi[0]) - (not high_full)
    parts = [] if low_full else [lo[0] + _digits_between(lo[1:], "9" * rest)]
    if first <= last:
        parts.append(f"[{first}-{last}][0-9]{{{rest}}}")
    if not high_full:
        parts.append(hi[0] + _digits_between("0" * rest, hi[1:]))
    return _alt(parts)


def _naturals(lo: int, hi: int | None) -> str:
    """0 <= lo <= n <= hi (hi None: up to MAX_DIGITS digits), without leading zeros."""
    top = 10**MAX_DIGITS - 1
    hi = top if hi is None else min(hi, top)
    parts = []
    for n in range(len(str(lo)), len(str(hi)) + 1):
        a, b = max(lo, 10 ** (n - 1) if n > 1 else 0), min(hi, 10**n - 1)
        if a <= b:
            parts.append(_digits_between(str(a), str(b)))
    return _alt(parts)


Bound = tuple[int, bool]  # an integer part and whether it may be reached exactly


def _bounds(node: dict) -> tuple[Bound | None, Bound | None]:
    """A numeric node's lower and upper bounds (None: unbounded) as (integer, reached):
    between them any value; at an integer bound, the bound itself if `reached`; a
    bound that is no integer is rounded inward and is reached."""
    import math

    def bound(inclusive: str, exclusive: str, inward, tighter) -> Bound | None:
        found = []
        for key in (inclusive, exclusive):
            v = node.get(key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                continue
            found.append((inward(v), key == inclusive or inward(v) != v))
        return tighter(found) if found else None

    lo = bound(
        "minimum", "exclusiveMinimum", math.ceil, lambda b: max(b, key=lambda x: (x[0], not x[1]))
    )
    hi = bound(
        "maximum", "exclusiveMaximum", math.floor, lambda b: min(b, key=lambda x: (x[0], x[1]))
    )
    return lo, hi


def _integers(lo: Bound | None, hi: Bound | None) -> str | None:
    """The integers between two bounds, or None where there are none."""
    a = None if lo is None else lo[0] + (not lo[1])
    b = None if hi is None else hi[0] - (not hi[1])
    if a is not None and b is not None and a > b:
        return None
    parts = []
    if b is None or b >= 0:
        parts.append(_naturals(max(a or 0, 0), b))
    if a is None or a < 0:
        parts.append("-" + _naturals(max(-b, 1) if b is not None else 1, None if a is None else -a))
    return _alt(parts)


def _magnitudes(lo: Bound, hi: Bound | None) -> str | None:
    """Non-negative decimals x (no exponent) with lo <= x <= hi as _bounds reads them:
    an unreached lower bound needs a fraction that is not all zeros, a reached upper
    bound may only have zeros after it."""
    (a, a_in), top = lo, hi
    b = None if top is None else top[0]
    if b is not None and (a > b or (a == b and not (a_in and top[1]))):
        return None
    parts = []
    if not a_in:
        parts.append(f"{a}" + r"\.[0-9]{0,16}[1-9]")
        a += 1
    if b is None or a <= b - 1:
        parts.append(_naturals(a, None if b is None else b - 1) + f"(?:{_FRACTION})?")
    if b is not None and top[1] and a <= b:
        parts.append(str(b) + r"(?:\.0{1,17})?")
    return _alt(parts) if parts else None


def _numbers(lo: Bound | None, hi: Bound | None) -> str | None:
    """The decimals between two bounds (zero or more on each side of 0), or None."""
    parts = []
    if hi is None or hi[0] >= 0:
        pos_lo = lo if lo is not None and lo[0] >= 0 else (0, True)
        parts.append(_magnitudes(pos_lo, hi))
    if lo is None or lo[0] < 0:
        neg_lo = (-hi[0], hi[1]) if hi is not None and hi[0] < 0 else (0, False)
        neg = _magnitudes(neg_lo, None if lo is None else (-lo[0], lo[1]))
        parts.append(None if neg is None else "-" + neg)
    parts = [p for p in parts if p is not None]
    return _alt(parts) if parts else None


class _Converter:
    def __init__(self, root: dict, max_recursion: int = 3) -> None:
        self.root = root
        self.max_recursion = max_recursion
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
            return _literal(node["const"])
        if "enum" in node:
            if not node["enum"]:
                raise self.fail("'enum' must not be empty")
            return _alt([_literal(v) for v in node["enum"]])
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
            lo, hi = _bounds(node)
            if lo is None and hi is None:
                return _SCALARS[kind]
            pattern = (_integers if kind == "integer" else _numbers)(lo, hi)
            if pattern is None:
                raise self.fail(f"no {kind} is within {json.dumps(node)[:80]}")
            return pattern
        if kind not in _SCALARS:
            raise self.fail(f"unknown type {kind!r}")
        return _SCALARS[kind]

    def free(self, depth: int, *, inside: bool = False) -> str:
        """Any value where a schema says nothing (the module docstring's depths); inside:
        a member of a free object or array at this depth."""
        return any_value(JSON_OBJECT_DEPTH if depth == 0 else ANY_DEPTH - inside)

    def string(self, node: dict) -> str:
        if "pattern" in node:
            return f'"(?J:{self.pattern(node["pattern"])})"'
        if "format" in node:
            if node["format"] not in _FORMATS:
                raise self.fail(f"format {node['format']!r} is not supported (one of "
                                f"{', '.join(sorted(_FORMATS))})")  # fmt: skip
            return f'"(?:{_FORMATS[node["format"]]})"'
        if "minLength" in node or "maxLength" in node:
            lo = int(node.get("minLength", 0))
            hi = node.get("maxLength")
            return f'"{_STRING_CHAR}{{{lo},{"" if hi is None else int(hi)}}}"'
        return _SCALARS["string"]

    def pattern(self, pattern: str) -> str:
        """A string's `pattern`, its anchors dropped, checked on its own (so that it
        cannot close the group it is put in)."""
        from shunter.actors.grammar.regex import Nfa

        if not isinstance(pattern, str):
            raise self.fail("'pattern' must be a string")
        body = pattern[1:] if pattern.startswith("^") else pattern
        if body.endswith("$"):
            backslashes = len(body) - 1 - len(body[:-1].rstrip("\\"))
            if backslashes % 2 == 0:  # not an escaped "\\$"
                body = body[:-1]
        Nfa(body or "(?:)", param="json_schema pattern", max_states=100_000)
        return body

    def obj(self, node: dict, depth: int) -> str | None:
        if "properties" not in node:
            extra = node.get("additionalProperties", True)
            if extra is False:
                return r"\{\}"
            free = extra is True or extra == {}
            value = self.free(depth, inside=True) if free else self.value(extra, depth + 1)
            return r"\{\}" if value is None else _object_of(value)
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
            members.append((_literal(name) + ":" + _SPACE + value, name in required))
        return r"\{" + _members(members) + r"\}"

    def array(self, node: dict, depth: int) -> str | None:
        items = node.get("items")
        item = self.free(depth, inside=True) if items is None else self.value(items, depth + 1)
        lo, hi = int(node.get("minItems", 0)), node.get("maxItems")
        if item is None:
            return r"\[\]" if lo == 0 else None
        rest_hi = "" if hi is None else str(max(int(hi) - 1, 0))
        more = f"(?:,{_SPACE}{item}){{{max(lo - 1, 0)},{rest_hi}}}"
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


def schema_regex(schema: dict | str) -> str:
    """The pattern of the JSON values `schema` describes (module docstring)."""
    schema = json_object_arg(schema, "json_schema")
    from shunter.actors.grammar.ebnf import unroll

    def write(levels: int) -> str | None:
        try:
            return _Converter(schema, levels).value(schema, 0)
        except (TypeError, AttributeError, KeyError) as e:  # a keyword's value of the wrong kind
            raise ValueError(
                f"json_schema: a keyword has a value of the wrong type ({e})"
            ) from None

    return unroll(write, "json_schema")


def _members(members: list[tuple[str, bool]]) -> str:
    """An object's members in order, each (pattern, required); one that is not required
    may be left out. Alternatives say which member comes first (no comma before it),
    up to the first required one."""
    sep = "," + _SPACE

    def rest(i: int) -> str:
        return "".join(f"{sep}{m}" if req else f"(?:{sep}{m})?" for m, req in members[i:])

    firsts = []
    for k, (m, req) in enumerate(members):
        firsts.append(m + rest(k + 1))
        if req:
            break
    else:
        firsts.append("")  # every member left out
    return _alt(firsts)


def _object_of(value: str) -> str:
    member = _SCALARS["string"] + ":" + _SPACE + value
    return r"\{(?:" + member + "(?:," + _SPACE + member + r")*)?\}"


def any_value(depth: int = ANY_DEPTH) -> str:
    """Any JSON value nesting at most `depth` objects or arrays."""
    scalar = _alt([_SCALARS["string"], _NUMBER, "true", "false", "null"])
    value = scalar
    for _ in range(depth):
        arr = r"\[(?:" + value + "(?:," + _SPACE + value + r")*)?\]"
        value = _alt([scalar, _object_of(value), arr])
    return value


def json_object(depth: int = JSON_OBJECT_DEPTH) -> str:
    """Any JSON object whose values nest at most `depth` objects or arrays deep."""
    return _object_of(any_value(depth))
