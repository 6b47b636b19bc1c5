"""JSON Schema (the part structured outputs use) as a regular expression that token_fsm.py
can constrain a generation to.

Theory of operation: the schema is walked once and each node becomes a pattern for
one JSON value of that shape; the output is a single value. Objects list every
property of `properties` in order (required or not, as strict structured outputs
ask), separated by "," or ", " and ":" or ": "; arrays take `items` repeated between
`minItems` and `maxItems`; strings are JSON strings (escapes included) with
`minLength`/`maxLength` counted in characters; `enum` and `const` are their JSON
texts; `anyOf`/`oneOf` and type lists are alternatives; `$ref` to `#/$defs/...` or
`#/definitions/...` is inlined. `json_object()` is any JSON object, nested at most
JSON_OBJECT_DEPTH levels (a regular language cannot count brackets).

Refused with a ValueError that names the keyword: recursive references, `pattern`,
`patternProperties`, `allOf` of more than one schema, a node with no type, enum or
const, and anything nested deeper than MAX_DEPTH. Not enforced (the output is valid
JSON of the right shape, but these bounds are not checked): numeric `minimum` /
`maximum` / `multipleOf`, string `format`.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_DEPTH = 12
JSON_OBJECT_DEPTH = 2
_SPACE = "[ ]?"
_STRING_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'
_INTEGER = r"-?(?:0|[1-9][0-9]{0,17})"
_NUMBER = _INTEGER + r"(?:\.[0-9]{1,17})?(?:[eE][+-]?[0-9]{1,3})?"
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


class _Converter:
    def __init__(self, root: dict) -> None:
        self.root = root
        self.refs: list[str] = []

    def fail(self, why: str) -> ValueError:
        return ValueError(f"json_schema: {why}")

    def value(self, node: Any, depth: int) -> str:
        if depth > MAX_DEPTH:
            raise self.fail(f"nested deeper than {MAX_DEPTH} levels")
        if node is True or node == {}:
            raise self.fail("a schema that allows any value is not supported (give a type)")
        if not isinstance(node, dict):
            raise self.fail(f"a schema must be an object, got {node!r}")
        if "$ref" in node:
            return self.ref(node["$ref"], depth)
        for key in ("pattern", "patternProperties"):
            if key in node:
                raise self.fail(f"'{key}' is not supported")
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
                return _alt([self.value(n, depth + 1) for n in node[key]])
        types = node.get("type")
        if types is None:
            if "properties" in node:
                types = "object"
            else:
                raise self.fail(f"a schema needs a type, enum or const: {json.dumps(node)[:80]}")
        if isinstance(types, list):
            return _alt([self.typed({**node, "type": t}, t, depth) for t in types])
        return self.typed(node, types, depth)

    def typed(self, node: dict, kind: str, depth: int) -> str:
        if kind == "object":
            return self.obj(node, depth)
        if kind == "array":
            return self.array(node, depth)
        if kind == "string" and ("minLength" in node or "maxLength" in node):
            lo = int(node.get("minLength", 0))
            hi = node.get("maxLength")
            return f'"{_STRING_CHAR}{{{lo},{"" if hi is None else int(hi)}}}"'
        if kind not in _SCALARS:
            raise self.fail(f"unknown type {kind!r}")
        return _SCALARS[kind]

    def obj(self, node: dict, depth: int) -> str:
        props = node.get("properties") or {}
        if not isinstance(props, dict):
            raise self.fail("'properties' must be an object")
        members = [_literal(name) + ":" + _SPACE + self.value(schema, depth + 1)
                   for name, schema in props.items()]  # fmt: skip
        return r"\{" + ("," + _SPACE).join(members) + r"\}"

    def array(self, node: dict, depth: int) -> str:
        items = node.get("items")
        if items is None:
            raise self.fail("an array needs 'items'")
        item = self.value(items, depth + 1)
        lo, hi = int(node.get("minItems", 0)), node.get("maxItems")
        rest_hi = "" if hi is None else str(max(int(hi) - 1, 0))
        more = f"(?:,{_SPACE}{item}){{{max(lo - 1, 0)},{rest_hi}}}"
        body = f"{item}{more}"
        if hi is not None and int(hi) == 0:
            return r"\[\]"
        return r"\[" + (body if lo >= 1 else f"(?:{body})?") + r"\]"

    def ref(self, ref: str, depth: int) -> str:
        prefix = next((p for p in ("#/$defs/", "#/definitions/") if ref.startswith(p)), None)
        if prefix is None:
            raise self.fail(f"only local references (#/$defs/...) are supported, got {ref!r}")
        if ref in self.refs:
            raise self.fail(f"recursive reference {ref!r} is not supported")
        defs = self.root.get(prefix[2:-1]) or {}
        name = ref[len(prefix) :]
        if name not in defs:
            raise self.fail(f"reference {ref!r} names no definition")
        self.refs.append(ref)
        try:
            return self.value(defs[name], depth + 1)
        finally:
            self.refs.pop()


def schema_regex(schema: dict | str) -> str:
    """The pattern of the JSON values `schema` describes (module docstring)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError("json_schema must be a JSON object")
    try:
        return _Converter(schema).value(schema, 0)
    except (TypeError, AttributeError, KeyError) as e:  # a keyword's value of the wrong kind
        raise ValueError(f"json_schema: a keyword has a value of the wrong type ({e})") from None


def json_object(depth: int = JSON_OBJECT_DEPTH) -> str:
    """Any JSON object whose values nest at most `depth` objects or arrays deep."""
    scalar = _alt([_SCALARS["string"], _NUMBER, "true", "false", "null"])
    value = scalar
    for _ in range(depth):
        obj = (r"\{(?:" + _SCALARS["string"] + ":" + _SPACE + value + "(?:," + _SPACE
               + _SCALARS["string"] + ":" + _SPACE + value + r")*)?\}")  # fmt: skip
        arr = r"\[(?:" + value + "(?:," + _SPACE + value + r")*)?\]"
        value = _alt([scalar, obj, arr])
    return r"\{" + "(?:" + _SCALARS["string"] + ":" + _SPACE + value + "(?:," + _SPACE + \
        _SCALARS["string"] + ":" + _SPACE + value + r")*)?\}"  # fmt: skip
