"""Structural tags (SGLang's `structural_tag`, chat's response_format of that type) as a
regular expression that token_fsm.py can constrain a generation to.

Theory of operation: the output is free text, except that wherever one of the
`triggers` occurs, what follows from it must be one of the `structures`: its `begin`
(which starts with a trigger), a JSON value its `schema` describes (json_schema.py),
then its `end`; free text goes on after it. As a pattern: F (S F)*, where F is any text
in which no trigger occurs (regex.py's `(?A:...)` group) and S the alternatives
begin + schema + end. So a model may answer in prose, and a call it starts is held to
its schema until its end tag.

The newer format-object form, `{"type": "structural_tag", "format": {...}}`, is told
apart by its `format` and written by structural_format.py (this form is its
triggered_tags with json_schema contents).

Invariants: every structure's begin starts with a trigger (else its text could not
follow free text), triggers and begins are non-empty; refused with a ValueError that
names what is wrong.
"""

from __future__ import annotations

import re
from typing import Any

from shunter.actors.grammar.json_schema import json_object_arg, schema_regex
from shunter.actors.grammar.structural_format import format_regex


def _fail(why: str) -> ValueError:
    return ValueError(f"structural_tag: {why}")


def structural_tag_regex(spec: dict[str, Any] | str) -> str:
    """The pattern of outputs the structural tag `spec` allows (module docstring):
    {"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}, or {"format":
    {...}} (structural_format.py); "type" ignored."""
    spec = json_object_arg(spec, "structural_tag")
    if "format" in spec:
        return format_regex(spec["format"])
    structures, triggers = spec.get("structures"), spec.get("triggers")
    if not isinstance(triggers, list) or not triggers:
        raise _fail("triggers must be a non-empty list of strings")
    if not all(isinstance(t, str) and t for t in triggers):
        raise _fail("triggers must be non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise _fail("structures must be a non-empty list of {begin, schema, end}")
    alternatives = []
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not s["begin"]:
            raise _fail(f"structures[{i}] needs a non-empty begin string")
        end = s.get("end", "")
        if not isinstance(end, str):
            raise _fail(f"structures[{i}].end must be a string")
        if not any(s["begin"].startswith(t) for t in triggers):
            raise _fail(f"structures[{i}].begin {s['begin']!r} starts with none of the triggers")
        try:
            body = schema_regex(s.get("schema", {}))
        except ValueError as e:
            raise _fail(f"structures[{i}].schema: {e}") from None
        alternatives.append(re.escape(s["begin"]) + body + re.escape(end))
    free = "(?A:" + "|".join(re.escape(t) for t in triggers) + ")"
    return free + "(?:(?:" + "|".join(alternatives) + ")" + free + ")*"
