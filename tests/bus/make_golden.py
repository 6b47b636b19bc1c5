"""(Re)generate the golden bytes of the message catalog: run by hand when a message is
added or changed on purpose, then commit tests/data/golden/.

    python tests/bus/make_golden.py            # add missing messages / new versions
    python tests/bus/make_golden.py --check    # exit 1 if anything would be written

Layout: tests/data/golden/<topic>/v001.msgpack (the bytes) and v001.json (the same
instance with field names); the envelope frame lives under `_envelope/` and
`_wire_envelope/`. A changed encoding is written as the next version and the
older ones stay: tests/bus/test_golden.py checks that the newest re-encodes to identical
bytes and that every older one still decodes to the same field values, which is the
schema-evolution contract (append fields with defaults; never reorder or retype).

The canonical instance of a message is built from its type alone: every field gets a
distinct non-default value (so a reordered pair of same-typed fields is caught), lists
hold two items, optionals and unions take their first non-None member.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

import msgspec
import msgspec.inspect as mi

from shunter.bus.codec import WireEnvelope
from shunter.bus.messages import ALL_MESSAGES, Envelope, topic_of

# Everything with a pinned encoding, by directory name: every message under its topic,
# and the envelope frame, as the transports send it (with its topic seq) and as
# `Envelope` readers such as the event log decode it.
PINNED: dict[str, type[msgspec.Struct]] = {
    **{topic_of(m): m for m in ALL_MESSAGES},
    "_envelope": Envelope,
    "_wire_envelope": WireEnvelope,
}

GOLDEN = pathlib.Path(__file__).resolve().parents[1] / "data" / "golden"


class _Values:
    """Deterministic distinct values: the n-th scalar asked for gets n in it."""

    def __init__(self) -> None:
        self.n = 0

    def next(self) -> int:
        self.n += 1
        return self.n

    def build(self, t: mi.Type, name: str, default: Any = msgspec.NODEFAULT) -> Any:
        match t:
            case mi.StructType():
                return t.cls(**{f.name: self.build(f.type, f.name, f.default) for f in t.fields})
            case mi.BoolType():
                n = self.next()
                return not default if isinstance(default, bool) else n % 2 == 1
            case mi.IntType():
                return 100 + self.next()
            case mi.FloatType():
                return self.next() + 0.25  # exact in binary, so JSON round-trips it
            case mi.StrType():
                return f"{name}-{self.next()}"
            case mi.BytesType() | mi.ByteArrayType():
                return f"{name}-{self.next()}".encode()
            case mi.ListType() | mi.VarTupleType() | mi.SetType() | mi.FrozenSetType():
                items = [self.build(t.item_type, name) for _ in range(2)]
                return items if isinstance(t, mi.ListType) else tuple(items)
            case mi.DictType():
                return {
                    self.build(t.key_type, name): self.build(t.value_type, name) for _ in range(2)
                }
            case mi.UnionType():
                return self.build(next(u for u in t.types if not isinstance(u, mi.NoneType)), name)
            case mi.LiteralType():
                return t.values[0]
            case mi.NoneType():
                return None
            case mi.AnyType():  # free-form JSON (template variables): a nested value
                return {f"{name}-{self.next()}": [self.next(), True, None]}
            case _:
                raise TypeError(f"field {name!r}: no canonical value for {t!r}; extend _Values")


def canonical(cls: type[msgspec.Struct]) -> msgspec.Struct:
    return _Values().build(mi.type_info(cls), cls.__name__)


def named(obj: Any) -> Any:
    """JSON-ready builtins with field names (array_like Structs encode as arrays)."""
    if isinstance(obj, msgspec.Struct):
        return {f: named(getattr(obj, f)) for f in obj.__struct_fields__}
    if isinstance(obj, list | tuple | set | frozenset):
        return [named(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): named(v) for k, v in obj.items()}
    if isinstance(obj, bytes):
        return obj.hex()
    return obj


def versions(topic: str) -> list[pathlib.Path]:
    return sorted((GOLDEN / topic).glob("v*.msgpack"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if stale")
    args = p.parse_args(argv)
    stale = 0
    for topic, cls in PINNED.items():
        msg = canonical(cls)
        data = msgspec.msgpack.encode(msg)
        have = versions(topic)
        if have and have[-1].read_bytes() == data:
            continue
        stale += 1
        path = GOLDEN / topic / f"v{len(have) + 1:03d}.msgpack"
        print(f"{'stale' if args.check else 'writing'}: {path.relative_to(GOLDEN)}")
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            text = json.dumps(named(msg), indent=1, sort_keys=False)
            path.with_suffix(".json").write_text(text + "\n")
    print(f"{len(PINNED)} types, {stale} {'stale' if args.check else 'written'}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
