"""JSON Schema as a regular expression (actors/grammar/json_schema.py): instances of a
schema, written compactly or with spaces, match its pattern whole (checked with
Python's re, whose syntax the pattern keeps to), values of another shape do not;
unsupported keywords and malformed schemas are ValueErrors that say which."""

from __future__ import annotations

import json
import re

import pytest

from shunter.actors.grammar.json_schema import json_object, schema_regex
from shunter.actors.grammar.token_fsm import constraint_nfa

SCHEMA = {
    "type": "object",
    "$defs": {"tag": {"type": "string", "maxLength": 5}},
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 20},
        "age": {"type": "integer"},
        "score": {"type": "number"},
        "ok": {"type": ["boolean", "null"]},
        "kind": {"enum": ["a", "b", 3, None]},
        "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "minItems": 1, "maxItems": 3},
        "where": {
            "anyOf": [{"type": "object", "properties": {"x": {"const": 1}}}, {"type": "null"}]
        },
    },
}
GOOD = {"name": "Bob \"B\" Smith", "age": -3, "score": 1.5e3, "ok": None, "kind": 3,
        "tags": ["a", "bc"], "where": {"x": 1}}  # fmt: skip


@pytest.mark.parametrize("separators", [(",", ":"), (", ", ": ")])
def test_an_instance_matches_and_other_shapes_do_not(separators):
    pattern = schema_regex(SCHEMA)
    constraint_nfa(pattern)  # within the automaton's limits
    dump = lambda v: json.dumps(v, separators=separators, ensure_ascii=False)  # noqa: E731
    assert re.fullmatch(pattern, dump(GOOD))
    assert re.fullmatch(pattern, dump({**GOOD, "where": None, "ok": True, "kind": "b"}))
    for bad in ({**GOOD, "age": 1.5}, {**GOOD, "tags": []}, {**GOOD, "tags": ["toolong"]},
                {**GOOD, "kind": "c"}, {**GOOD, "name": ""}, {k: v for k, v in GOOD.items()
                                                             if k != "age"}):  # fmt: skip
        assert not re.fullmatch(pattern, dump(bad)), bad


def test_json_object_takes_nested_objects_and_arrays():
    pattern = json_object()
    constraint_nfa(pattern)
    assert re.fullmatch(pattern, '{"a": {"b": [1, 2.5, "x"]}, "c": null, "d": true}')
    assert re.fullmatch(pattern, "{}")
    for bad in ("[1]", '{"a": 1,}', '{"a" 1}', "{'a': 1}", '{"a": {"b": {"c": {"d": 1}}}}'):
        assert not re.fullmatch(pattern, bad), bad


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"type": "string", "pattern": "a+"}, "'pattern'"),
        ({}, "any value"),
        ({"description": "x"}, "needs a type"),
        ({"type": "object", "properties": {"a": {"$ref": "#"}}}, "local references"),
        ({"$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}}}, "$ref": "#/$defs/n"},
         "recursive"),
        ({"type": "array"}, "needs 'items'"),
        ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "allOf"),
        ({"type": "date"}, "unknown type"),
        ({"enum": 5}, "wrong type"),
        ({"type": "string", "maxLength": []}, "wrong type"),
        ("{not json", "not valid JSON"),
    ],
)  # fmt: skip
def test_unsupported_or_malformed_schemas_are_refused(schema, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        schema_regex(schema)
