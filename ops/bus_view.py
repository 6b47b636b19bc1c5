"""What busctl shows of the bus: which messages a view keeps (`Filter`: topic
prefixes, request ids at any depth of a message), how a message becomes a line
(`Renderer`: text with optional colors, or JSON), and a log's per-topic and
per-publisher statistics (`log_statistics`). Pure functions of messages and records;
busctl's commands (ops/busctl.py) feed them from a broker or a recorded log.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Iterator
from typing import Any, TextIO

import msgspec
import msgspec.inspect as mi

from shunter.bus.log import Record
from shunter.bus.messages import Envelope, Msg
from shunter.bus.replay import as_named, render

_COLORS = {
    "req": "32", "tok": "34", "cache": "33", "sched": "35", "spill": "36", "flip": "95",
    "health": "90", "bus": "31",
}  # fmt: skip
_envelope_decoder = msgspec.msgpack.Decoder(Envelope)
_json = msgspec.json.Encoder()


@functools.cache
def _has_request_id(cls: type) -> bool:
    """Whether a Struct type holds a field named request_id at any depth."""
    seen: set[type] = set()

    def walk(t: mi.Type) -> bool:
        match t:
            case mi.StructType(cls=c, fields=fields):
                if c in seen:
                    return False
                seen.add(c)
                return any(f.name == "request_id" or walk(f.type) for f in fields)
            case mi.ListType() | mi.VarTupleType() | mi.SetType() | mi.FrozenSetType():
                return walk(t.item_type)
            case mi.DictType():
                return walk(t.value_type)
            case mi.UnionType():
                return any(walk(u) for u in t.types)
            case mi.TupleType():
                return any(walk(u) for u in t.item_types)
        return False

    return walk(mi.type_info(cls))


def request_ids(obj: Any) -> Iterator[str]:
    """Every request_id field value inside a message."""
    if isinstance(obj, msgspec.Struct):
        if not _has_request_id(type(obj)):
            return
        for f in obj.__struct_fields__:
            value = getattr(obj, f)
            if f == "request_id" and isinstance(value, str):
                yield value
            else:
                yield from request_ids(value)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from request_ids(v)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from request_ids(v)


class Filter:
    def __init__(self, prefixes: list[str] | None, rids: list[str] | None):
        self.prefixes = tuple(prefixes or ())
        self.rids = set(rids or ())

    def wants_topic(self, topic: str) -> bool:
        return not self.prefixes or topic.startswith(self.prefixes)

    def wants(self, msg: Msg) -> bool:
        if not self.rids:
            return True
        for rid in request_ids(msg):
            if rid in self.rids:
                return True
            base, _, n = rid.rpartition("-")
            if n.isdigit() and base in self.rids:
                return True
        return False


class Renderer:
    def __init__(self, out: TextIO, *, as_json: bool, color: bool, max_items: int | None):
        self.out, self.as_json, self.color, self.max_items = out, as_json, color, max_items

    def _c(self, code: str, text: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.color else text

    def line(self, topic: str, env: Envelope, msg: Msg | None, error: str = "") -> str:
        if self.as_json:
            obj: dict[str, Any] = {
                "topic": topic, "publisher_id": env.publisher_id, "seq": env.seq,
                "mono_ns": env.mono_ns, "wall_ns": env.wall_ns,
            }  # fmt: skip
            if msg is None:
                obj["error"] = error
            else:
                obj["msg"] = as_named(msg)
            return _json.encode(obj).decode()
        ts = datetime.datetime.fromtimestamp(env.wall_ns / 1e9, tz=datetime.UTC)
        body = render(msg, self.max_items) if msg is not None else f"<undecodable: {error}>"
        color = _COLORS.get(topic.split(".", 1)[0], "0")
        return " ".join(
            (
                self._c("2", ts.strftime("%H:%M:%S.%f")[:-3]),
                self._c("36", f"{env.publisher_id}#{env.seq}"),
                self._c(f"1;{color}", topic),
                body,
            )
        )

    def emit(self, text: str) -> None:
        self.out.write(text + "\n")


def log_statistics(records: Iterator[Record]) -> dict[str, Any]:
    """Per-topic counts and rates, per-publisher seq gaps, over a log's records."""
    topics: dict[str, dict[str, Any]] = {}
    pubs: dict[str, dict[str, Any]] = {}
    first_ns = last_ns = None
    for rec in records:
        env = _envelope_decoder.decode(rec.envelope)
        topic = rec.topic.decode("ascii", "replace")
        t = topics.setdefault(topic, {"count": 0, "bytes": 0, "first_ns": env.wall_ns})
        t["count"] += 1
        t["bytes"] += len(rec.body)
        t["last_ns"] = env.wall_ns
        first_ns = env.wall_ns if first_ns is None else min(first_ns, env.wall_ns)
        last_ns = env.wall_ns if last_ns is None else max(last_ns, env.wall_ns)
        p = pubs.get(env.publisher_id)
        if p is None:
            p = pubs[env.publisher_id] = {
                "count": 0, "first_seq": env.seq, "last_seq": env.seq, "gaps": 0, "lost": 0,
                "restarts": 0,
            }  # fmt: skip
        elif env.seq > p["last_seq"] + 1:
            p["gaps"] += 1
            p["lost"] += env.seq - p["last_seq"] - 1
        elif env.seq <= p["last_seq"]:
            p["restarts"] += 1
        p["count"] += 1
        p["last_seq"] = env.seq
    duration_s = (last_ns - first_ns) / 1e9 if first_ns is not None else 0.0
    for t in topics.values():
        t["msgs_per_s"] = t["count"] / duration_s if duration_s > 0 else None
    return {"duration_s": duration_s, "topics": topics, "publishers": pubs}
