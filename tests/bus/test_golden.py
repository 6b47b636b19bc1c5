"""Golden bytes: the wire encoding of every message is pinned by checked-in bytes.

The newest version of each message must decode and re-encode to identical bytes, and
every older version must still decode to the same field values (schema evolution:
append with defaults, never reorder or retype). Regenerate with
`python tests/bus/make_golden.py` only when a change is intended.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
from typing import Any

import msgspec
import pytest

from shunter.bus.messages import TOPICS, Msg

HERE = pathlib.Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("make_golden", HERE / "make_golden.py")
make_golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_golden)
GOLDEN = make_golden.GOLDEN


def _subset_mismatches(old: Any, new: Any, path: str = "") -> list[str]:
    """Where `new` does not hold `old`'s values (new may have appended fields)."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [
            m
            for k, v in old.items()
            for m in (
                [f"{path}.{k}: missing"]
                if k not in new
                else _subset_mismatches(v, new[k], f"{path}.{k}")
            )
        ]
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [
            m
            for i, (a, b) in enumerate(zip(old, new))
            for m in _subset_mismatches(a, b, f"{path}[{i}]")
        ]
    if old != new or type(old) is not type(new):
        return [f"{path or '.'}: golden {old!r}, decoded {new!r}"]
    return []


def check_version(cls: type[msgspec.Struct], path: pathlib.Path, newest: bool) -> list[str]:
    """Problems with one golden file decoded as `cls` (empty: fine)."""
    data = path.read_bytes()
    try:
        msg = msgspec.msgpack.decode(data, type=cls)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        return [f"{path.name}: no longer decodes as {cls.__name__}: {e}"]
    problems = []
    if newest and msgspec.msgpack.encode(msg) != data:
        problems.append(f"{path.name}: re-encodes to different bytes (the encoding changed)")
    golden = json.loads(path.with_suffix(".json").read_text())
    decoded = json.loads(json.dumps(make_golden.named(msg)))
    problems += [f"{path.name}: {m}" for m in _subset_mismatches(golden, decoded)]
    return problems


@pytest.mark.parametrize("name", list(make_golden.PINNED))
def test_golden_bytes(name):
    cls = make_golden.PINNED[name]
    found = make_golden.versions(name)
    assert found, (
        f"{cls.__name__} ({name}) has no golden bytes: run python tests/bus/make_golden.py"
    )
    problems = [p for v in found for p in check_version(cls, v, newest=v == found[-1])]
    assert not problems, "\n".join(problems)


def test_no_golden_for_an_unknown_topic():
    assert set(TOPICS) <= set(make_golden.PINNED)  # every message is pinned
    pinned = make_golden.PINNED
    orphans = sorted(d.name for d in GOLDEN.iterdir() if d.is_dir() and d.name not in pinned)
    assert not orphans, f"golden bytes for topics not in the catalog: {orphans}"


def test_golden_files_are_current():
    """The checked-in files match what make_golden would write now."""
    assert make_golden.main(["--check"]) == 0


def test_canonical_values_are_not_defaults():
    """A default-valued field would not show a changed default or a retype."""
    import msgspec.inspect as mi

    for cls in make_golden.PINNED.values():
        msg = make_golden.canonical(cls)
        for f in mi.type_info(cls).fields:
            if f.required:
                continue
            default = f.default_factory() if f.default is msgspec.NODEFAULT else f.default
            assert getattr(msg, f.name) != default, (cls.__name__, f.name)


# --- the checks catch what they must ---------------------------------------------


class TickAsFloat(Msg, tag="sched.tick"):
    now_ns: float  # retyped: int -> float


class PongSwapped(Msg, tag="health.pong"):
    actor_id: str  # reordered with ping_id
    ping_id: str


class PongRenamed(Msg, tag="health.pong"):
    ping_id: str
    actor: str  # was actor_id: a different meaning under the same position


def test_a_retyped_field_is_caught():
    (v,) = make_golden.versions("sched.tick")[-1:]
    problems = check_version(TickAsFloat, v, newest=True)
    assert any("different bytes" in p for p in problems), problems


@pytest.mark.parametrize("variant", [PongSwapped, PongRenamed])
def test_a_reordered_or_renamed_field_is_caught(variant):
    (v,) = make_golden.versions("health.pong")[-1:]
    problems = check_version(variant, v, newest=True)
    assert problems and not any("different bytes" in p for p in problems), problems


def test_an_appended_field_with_default_keeps_old_versions_valid(tmp_path):
    class PongPlus(Msg, tag="health.pong"):
        ping_id: str
        actor_id: str
        load: int = 0

    (v,) = make_golden.versions("health.pong")[-1:]
    assert check_version(PongPlus, v, newest=False) == []
    # as the newest version it would need regenerating: its encoding grew a field
    assert any("different bytes" in p for p in check_version(PongPlus, v, newest=True))


def test_wire_envelopes_decode_as_envelopes():
    """The event log and busctl read envelope frames as `Envelope`: the transport's
    appended topic seq must stay invisible to them."""
    from shunter.bus.messages import Envelope

    for v in make_golden.versions("_wire_envelope"):
        env = msgspec.msgpack.decode(v.read_bytes(), type=Envelope)
        wire = json.loads(v.with_suffix(".json").read_text())
        assert make_golden.named(env) == {k: wire[k] for k in Envelope.__struct_fields__}
