"""JSON Schema as a regular expression (actors/grammar/json_schema.py): instances of a
schema, written compactly or with spaces, match its pattern whole (checked with
Python's re, whose syntax the pattern keeps to where no string `pattern` is in it, and
with the constraint's own NFA), values of another shape do not; numeric bounds admit
exactly the integers between them and only decimals between them; unsupported
keywords and malformed schemas are ValueErrors that say which."""

from __future__ import annotations

import json
import random
import re
from fractions import Fraction

import pytest

from shunter.actors.grammar.ebnf import MAX_RECURSION
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
    "required": ["name", "age", "score", "ok", "kind", "tags", "where"],
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
    assert re.fullmatch(pattern, '{"a": {"b": {"c": [1]}}}')  # three levels below the top
    for bad in ("[1]", '{"a": 1,}', '{"a" 1}', "{'a': 1}", '{"a": {"b": {"c": {"d": [1]}}}}'):
        assert not re.fullmatch(pattern, bad), bad


def _accepts(schema) -> callable:
    return constraint_nfa(schema_regex(schema)).fullmatch


def test_integer_bounds_admit_exactly_the_integers_between_them():
    rng = random.Random(0)
    for _ in range(200):
        lo = rng.randint(-(10**6), 10**6)
        hi = lo + rng.randint(0, 10 ** rng.randint(0, 7))
        accepts = _accepts({"type": "integer", "minimum": lo, "maximum": hi})
        for v in (lo, hi, lo - 1, hi + 1, rng.randint(lo, hi), rng.randint(lo - 999, hi + 999)):
            assert accepts(str(v)) == (lo <= v <= hi), (lo, hi, v)
    accepts = _accepts({"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 12.5})
    assert [v for v in range(-50, 50) if accepts(str(v))] == list(range(-2, 13))
    assert not accepts("-0") and not accepts("007")
    assert _accepts({"type": "integer", "minimum": 10**6})("123456789012345678")
    with pytest.raises(ValueError, match="no integer"):
        schema_regex({"type": "integer", "minimum": 3, "maximum": 2.5})


NUMBERS = [f"{sign}{i}{frac}" for sign in ("", "-") for i in range(8)
           for frac in ("", ".5", ".25", ".001", ".999")]  # fmt: skip
KEYS = {"minimum": Fraction.__ge__, "exclusiveMinimum": Fraction.__gt__,
        "maximum": Fraction.__le__, "exclusiveMaximum": Fraction.__lt__}  # fmt: skip


def test_number_bounds_admit_only_decimals_between_them_and_all_of_those_at_integer_bounds():
    rng = random.Random(1)
    for _ in range(300):
        node = {k: rng.choice([rng.randint(-5, 5), rng.randint(-50, 50) / 10])
                for k in rng.sample(sorted(KEYS), rng.randint(1, 3))}  # fmt: skip
        try:
            accepts = _accepts({"type": "number", **node})
        except ValueError as e:
            assert "no number" in str(e)
            continue
        integral = all(isinstance(v, int) for v in node.values())
        for text in NUMBERS:
            inside = all(KEYS[k](Fraction(text), Fraction(str(v))) for k, v in node.items())
            if accepts(text):
                assert inside, (node, text)
            elif integral and text != "-0":
                assert not inside, (node, text)
    accepts = _accepts({"type": "number", "minimum": 0, "maximum": 1})
    assert all(map(accepts, ["0", "0.5", "1", "1.000"])) and not any(map(accepts, ["1.5", "-0.1"]))


def test_a_string_pattern_is_matched_whole_and_kept_valid_json():
    accepts = _accepts({"type": "string", "pattern": r"^[A-Z]{2}-\d{3}$"})
    assert accepts('"AB-123"') and not accepts('"AB-1234"') and not accepts('"ab-123"')
    accepts = _accepts({"type": "string", "pattern": "a.b"})  # "." takes what JSON escapes
    for text in ('"axb"', r'"a\"b"', r'"a\\b"', r'"a\tb"', r'"a\u0001b"', r'"a\u001Fb"'):
        assert accepts(text), text
        assert json.loads(text)  # the pattern's output is a JSON string
    for text in ('"a"b"', '"a\tb"', r'"a\nb"'):  # a raw quote or tab; "." is no newline
        assert not accepts(text), text
    assert _accepts({"type": "string", "pattern": r"cost\$"})('"cost$"')
    with pytest.raises(ValueError, match="unbalanced"):  # it cannot close its own group
        schema_regex({"type": "string", "pattern": "a)|(b"})


@pytest.mark.parametrize(
    ("fmt", "good", "bad"),
    [
        ("date-time", ["2024-01-31T12:00:00Z", "2024-02-29 23:59:60.5+05:30"],
         ["2024-13-01T00:00:00Z", "2024-01-31"]),
        ("date", ["1999-12-31"], ["1999-12-32", "99-12-31"]),
        ("time", ["08:30:00Z"], ["8:30"]),
        ("duration", ["P3DT4H", "P2W", "PT0.5S", "P1Y2M"], ["3D", "P", "PT", "P1DT"]),
        ("email", ["a.b+c@example.co"], ["a@", "@b.c", "a b@c.d"]),
        ("hostname", ["api.example.com"], ["-bad.com", "a..b"]),
        ("ipv4", ["192.168.0.1"], ["256.1.1.1", "1.2.3"]),
        ("ipv6", ["::1", "fe80::1:2", "1:2:3:4:5:6:7:8", "::", "1:2:3:4:5:6:7::"],
         ["1:2:3:4:5:6:7:8:9", "1::2::3", "1:2:3:4::5:6:7:8"]),
        ("uuid", ["123e4567-e89b-12d3-a456-426614174000"], ["123e4567"]),
        ("uri", ["https://example.com/a?b=c#d"], ["example", "://x"]),
    ],
)  # fmt: skip
def test_string_formats(fmt, good, bad):
    pattern = schema_regex({"type": "string", "format": fmt})
    constraint_nfa(pattern)
    for text in good:
        assert re.fullmatch(pattern, json.dumps(text)), text
    for text in bad:
        assert not re.fullmatch(pattern, json.dumps(text)), text


def test_properties_that_are_not_required_may_be_left_out_and_only_those():
    schema = {"type": "object", "required": ["b"], "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "integer"}}}  # fmt: skip
    accepts = _accepts(schema)
    for text in ('{"a": 1, "b": 2, "c": 3}', '{"b": 2}', '{"a": 1,"b": 2}', '{"b": 2, "c": 3}'):
        assert accepts(text), text
    for text in (
        "{}",
        '{"a": 1}',
        '{"a": 1, "c": 3}',
        '{"b": 2,}',
        '{, "b": 2}',
        '{"c": 3, "b": 2}',
    ):
        assert not accepts(text), text
    accepts = _accepts({**schema, "required": []})
    assert all(map(accepts, ["{}", '{"c": 3}', '{"a": 1, "c": 3}'])) and not accepts('{,"c": 3}')


def test_recursive_references_unroll_a_bounded_number_of_levels():
    tree = {"type": "object", "required": ["name", "children"], "properties": {
        "name": {"type": "string", "maxLength": 8},
        "children": {"type": "array", "items": {"$ref": "#"}}}}  # fmt: skip
    accepts = _accepts(tree)
    node = {"name": "leaf", "children": []}
    for _ in range(MAX_RECURSION):
        assert accepts(json.dumps(node))
        node = {"name": "n", "children": [node, {"name": "x", "children": []}]}
    assert accepts(json.dumps(node))  # the root, then MAX_RECURSION references
    assert not accepts(json.dumps({"name": "n", "children": [node]}))
    linked = {"$defs": {"Node": {"type": "object", "required": ["v", "next"], "properties": {
        "v": {"type": "integer"},
        "next": {"anyOf": [{"$ref": "#/$defs/Node"}, {"type": "null"}]}}}},
        "$ref": "#/$defs/Node"}  # fmt: skip
    assert _accepts(linked)('{"v": 1, "next": {"v": 2, "next": null}}')
    optional = {"type": "object", "required": ["v"],
                "properties": {"v": {"type": "integer"}, "child": {"$ref": "#"}}}  # fmt: skip
    assert _accepts(optional)('{"v": 1}') and _accepts(optional)('{"v": 1, "child": {"v": 2}}')


def test_what_a_schema_leaves_free_is_any_json_nested_a_bounded_depth():
    assert schema_regex({"type": "object"}) == json_object()
    anything = _accepts({})
    assert all(map(anything, ["1", '"x"', "null", '{"a": [1, 2]}', "[[1]]", '{"a": [[1]]}']))
    assert not anything('{"a": [[[1]]]}')  # three containers, the top one counted
    accepts = _accepts({"type": "object", "additionalProperties": {"type": "integer"}})
    assert accepts('{"a": 1, "b":2}') and accepts("{}") and not accepts('{"a": "x"}')
    accepts = _accepts({"type": "object", "properties": {"a": {"description": "free"},
                        "b": {"type": "object"}, "c": {"type": "array"}}})  # fmt: skip
    assert accepts('{"a": [1], "b": {"x": 1}, "c": [1, "z"]}')
    assert not accepts('{"a": [[1]], "b": {}, "c": []}')  # one level inside a schema
    assert _accepts({"type": "object", "properties": {}})("{}")  # a tool without parameters
    assert not _accepts({"type": "object", "properties": {}})('{"a": 1}')


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"type": "object", "properties": {"a": {"$ref": "other.json#"}}}, "local references"),
        ({"$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}, "minItems": 1}},
          "$ref": "#/$defs/n"}, "no way to end"),
        ({"type": "object", "required": ["c"], "properties": {"c": {"$ref": "#"}}},
         "no way to end"),
        ({"type": "string", "format": "credit-card"}, "format 'credit-card'"),
        ({"type": "string", "pattern": "(?=a)"}, "lookaround"),
        ({"type": "object", "patternProperties": {"a": {}}}, "patternProperties"),
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


def test_a_schema_that_fans_out_at_every_level_is_refused_quickly():
    import time

    defs = {f"d{i}": {"type": "object", "properties": {
        k: {"$ref": f"#/$defs/d{i + 1}"} for k in "abcdefghij"}} for i in range(5)}  # fmt: skip
    defs["d5"] = {"type": "integer"}
    start = time.monotonic()
    with pytest.raises(ValueError, match="passes"):
        schema_regex({"$defs": defs, "$ref": "#/$defs/d0"})
    assert time.monotonic() - start < 10  # 10**5 integers were never written
