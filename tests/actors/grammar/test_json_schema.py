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
from shunter.actors.grammar.json_schema import json_object, keyword_args_regex, schema_regex
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


def _multiple_within(text: str, node: dict) -> bool:
    """Whether text is a JSON number that node admits."""
    if not re.fullmatch(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?", text):
        return False
    value, exact = Fraction(text), lambda v: Fraction(repr(v))  # repr: as the schema wrote it
    if node["type"] == "integer" and "." in text:
        return False
    return (value / exact(node["multipleOf"])).denominator == 1 and all(
        KEYS[k](value, exact(v)) for k, v in node.items() if k in KEYS
    )


def _assert_admits_exactly_the_multiples(node: dict, texts: list[str]) -> None:
    """Checked with Python's re and the constraint's NFA; zero written -0 may be left out."""
    pattern = schema_regex(node)
    nfa_accepts, re_accepts = constraint_nfa(pattern).fullmatch, re.compile(pattern).fullmatch
    num_admitted = 0
    for text in texts:
        expected = _multiple_within(text, node)
        admitted = bool(re_accepts(text))
        assert admitted == nfa_accepts(text), (node, text)
        if text.startswith("-") and expected and Fraction(text) == 0:
            continue
        assert admitted == expected, (node, text)
        num_admitted += expected
    assert num_admitted, node  # the sweep reaches a multiple


MULTIPLE_BOUNDS = [{}, {"minimum": -137, "maximum": 1234},
                   {"exclusiveMinimum": -1000.5, "exclusiveMaximum": 999}, {"minimum": 7.5}]  # fmt: skip


@pytest.mark.parametrize("bounds", MULTIPLE_BOUNDS)
@pytest.mark.parametrize("step", [2, 5, 8, 10, 20, 25, 40, 125, 1000, 2.5, 0.5])
def test_integer_multiple_of_a_divisor_of_a_power_of_ten_is_exact(step, bounds):
    rng = random.Random(step)
    texts = [str(v) for v in range(-1300, 1301)] + ["-0", "00", "08", "1.0", "1e3"]
    texts += [str(rng.randint(-(10**17), 10**17) // 40 * 40 + d) for _ in range(40) for d in (0, 5)]
    _assert_admits_exactly_the_multiples({"type": "integer", "multipleOf": step, **bounds}, texts)


DECIMALS = [f"{sign}{i}.{f:0{n}d}" for sign in ("", "-") for i in range(4)
            for n in (1, 2, 3, 4) for f in range(0, 10**n, 1 if n < 4 else 7)]  # fmt: skip


@pytest.mark.parametrize("bounds", [{}, {"minimum": -1.25, "exclusiveMaximum": 2.5},
                                    {"exclusiveMinimum": 0.1, "maximum": 3.05},
                                    {"exclusiveMinimum": 1}])  # fmt: skip
@pytest.mark.parametrize("step", [0.1, 0.01, 0.001, 0.5, 0.25, 0.2, 0.125, 0.05, 1, 2])
def test_number_multiple_of_a_fraction_of_a_power_of_ten_or_an_integer_is_exact(step, bounds):
    texts = DECIMALS + [str(v) for v in range(-20, 21)] + ["-0", "1.5000000", "2.0e1", "-0.0"]
    _assert_admits_exactly_the_multiples({"type": "number", "multipleOf": step, **bounds}, texts)


@pytest.mark.parametrize(("kind", "step", "lo", "hi"), [("integer", 3, -40, 500), ("integer", 16, 0, 4000),
    ("integer", 7, -100.5, 100), ("number", 0.3, -3, 3.3), ("number", 1.5, -4, 40), ("number", 0.75, 0, 3)])  # fmt: skip
def test_any_other_step_between_two_near_bounds_lists_its_values(kind, step, lo, hi):
    texts = [str(v) for v in range(-150, 4100)] + (DECIMALS if kind == "number" else [])
    _assert_admits_exactly_the_multiples({"type": kind, "multipleOf": step, "minimum": lo,
                                          "maximum": hi}, texts)  # fmt: skip


@pytest.mark.parametrize("node", [{"type": "integer", "multipleOf": 3},
    {"type": "integer", "multipleOf": 16, "minimum": 0}, {"type": "number", "multipleOf": 0.3},
    {"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 10000},
    {"type": "number", "multipleOf": 1e-17}])  # fmt: skip
def test_a_step_no_small_pattern_says_is_not_enforced_and_the_bounds_still_are(node):
    without = {k: v for k, v in node.items() if k != "multipleOf"}
    assert schema_regex(node) == schema_regex(without)


def test_multiple_of_holds_in_python_keyword_arguments():
    accepts = constraint_nfa(keyword_args_regex({"type": "object", "required": ["n"], "properties": {
        "n": {"type": "integer", "multipleOf": 5, "minimum": 0}}})).fullmatch  # fmt: skip
    assert accepts("n=15") and accepts("n=0") and not accepts("n=16") and not accepts("n=-5")


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
        ({"type": "integer", "multipleOf": 0}, "'multipleOf' must be a number above 0"),
        ({"type": "number", "multipleOf": -0.5}, "'multipleOf' must be a number above 0"),
        ({"type": "number", "multipleOf": "2"}, "'multipleOf' must be a number above 0"),
        ({"type": "integer", "multipleOf": True}, "'multipleOf' must be a number above 0"),
        ({"type": "integer", "multipleOf": 4, "minimum": 1, "maximum": 3}, "no integer"),
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
