"""Replay: feed an actor core the inbox recorded in an event log and check that it
produces the recorded outbox, byte for byte.

Theory of operation
-------------------
An actor core is deterministic (`handle(msg) -> list[Msg]`, no clock, no environment,
no randomness of its own), so its outputs are a function of its inputs. A log holds
both: every message on the bus, with the publisher in its envelope. For a registered
core the harness

1. builds the core: a message whose topic is under the spec's `config` prefixes and
   whose publisher is the actor is handed to the factory (with no `config` prefixes
   the factory gets None). Each such message starts one run of the actor (a restart
   publishes it again); a replay covers one run, the first unless `run` says which,
   from its config message to the next one or the end of the log;
2. takes the inbox: every message of the run the spec's `inbox` takes (types by exact
   topic, strings as prefixes), in log order, whoever published it (so a `Tick` a
   shell sends its own core counts);
3. takes the recorded outbox: every message the actor published, except those under
   the inbox (its own ticks) or under `ignore` (the shell's own traffic: health, bus);
4. feeds the inbox in order, concatenates what `handle` returns, and compares it with
   the recorded outbox item by item on their msgpack encodings. The first difference
   (a different message, a missing one, or an extra one) ends the replay and is
   reported with the inbox message that produced it and both sides pretty-printed.

What a shell does to be replayable
----------------------------------
- Publishes what it built the core from (its config inside `Ready.info`, or a
  dedicated config message) before it hands the core anything.
- Feeds the core exactly what its subscription delivers, in delivery order; a message
  it makes for its own core (a `Tick`) is published and received back like any other,
  so the log holds it where the core saw it. Every subscriber of a broker sees one
  order, the recorder's included, so the log's order is the core's order.
- Publishes every output of `handle`, in order. Traffic the shell makes by itself
  (health, metrics read from a clock) goes under the spec's `ignore` prefixes.
- Declares its inbox by message type when an inbox topic is a prefix of an outbox
  topic (`DropTree` is `cache.drop`, `TreeDropped` is `cache.dropped`): a type matches
  its exact topic, a string matches as a prefix.

Registering a core
------------------
Call `register_core(name, factory, inbox=..., config=...)` from the actor's shell
module (never from core.py, which must stay free of bus imports), and list that module
in `CORE_MODULES` so `busctl replay --actor NAME` finds it; `busctl replay --import
MODULE_OR_FILE` loads any other module that registers one (the tests do this).

Invariants
----------
- A replay never mutates the log and never reads a clock: the same log and core give
  the same verdict every time.
- A verdict of "identical" means every recorded outbox message was produced, in order,
  and nothing else was (unless `allow_short_recording` accepts trailing extras from a
  recording that stopped before the actor's last outputs reached the recorder).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import pathlib
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from shunter.bus.log import LogReader, decode_record
from shunter.bus.messages import Envelope, Msg, topic_of


class Core(Protocol):
    def handle(self, msg: Msg) -> list[Msg]: ...


@dataclass(frozen=True)
class CoreSpec:
    name: str  # what `busctl replay --actor` calls it
    factory: Callable[[Msg | None], Core]  # builds a core from its recorded config message
    inbox: tuple[str | type[Msg], ...]  # what the core consumes: topic prefixes (str) or
    #                                     message types (their exact topic)
    actor_id: str  # the shell's publisher id on the bus; its messages are the outbox
    config: tuple[str, ...] = ()  # topic prefixes of the message the core is built from
    ignore: tuple[str, ...] = ("health.", "bus.")  # shell traffic, not the core's outbox

    def __post_init__(self) -> None:
        for item in self.inbox:
            if not isinstance(item, str) and not (isinstance(item, type) and issubclass(item, Msg)):
                raise TypeError(
                    f"core {self.name!r}: inbox item {item!r} is not a prefix or a Msg type"
                )
        exact = frozenset(topic_of(t) for t in self.inbox if not isinstance(t, str))
        object.__setattr__(self, "_exact", exact)
        object.__setattr__(self, "_prefixes", tuple(p for p in self.inbox if isinstance(p, str)))

    def takes(self, topic: str) -> bool:
        """Whether a message of this topic is the core's input."""
        return topic in self._exact or topic.startswith(self._prefixes)  # type: ignore[attr-defined]


# name -> module that registers it when imported (the actor shells)
CORE_MODULES: dict[str, str] = {
    "scheduler": "shunter.actors.scheduler.actor",
    "cache": "shunter.actors.cache_manager.actor",
    "tokenizer": "shunter.actors.tokenizer.actor",
}

_REGISTRY: dict[str, CoreSpec] = {}


def register_core(
    name: str,
    factory: Callable[[Msg | None], Core],
    inbox: Iterable[str | type[Msg]],
    *,
    actor_id: str | None = None,
    config: Iterable[str] = (),
    ignore: Iterable[str] = ("health.", "bus."),
) -> CoreSpec:
    """Make a core replayable under `name`. Registering a name again replaces it."""
    spec = CoreSpec(
        name=name,
        factory=factory,
        inbox=tuple(inbox),
        actor_id=actor_id or name,
        config=tuple(config),
        ignore=tuple(ignore),
    )
    if not spec.inbox:
        raise ValueError(f"core {name!r}: inbox needs at least one topic prefix or type")
    _REGISTRY[name] = spec
    return spec


def registered() -> dict[str, CoreSpec]:
    return dict(_REGISTRY)


def import_registrations(target: str) -> None:
    """Import a module by name, or a Python file by path, for its `register_core` calls."""
    if target.endswith(".py") or os.sep in target:
        path = pathlib.Path(target).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"no such file: {path}")
        mod_name = f"_shunter_replay_{path.stem}"
        spec = importlib.util.spec_from_file_location(mod_name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        spec.loader.exec_module(module)
    else:
        importlib.import_module(target)


def get_core(name: str) -> CoreSpec:
    if name not in _REGISTRY and name in CORE_MODULES:
        try:
            importlib.import_module(CORE_MODULES[name])
        except ModuleNotFoundError as e:
            raise KeyError(
                f"core {name!r}: its module {CORE_MODULES[name]} is missing ({e})"
            ) from e
    if name not in _REGISTRY:
        known = sorted(set(_REGISTRY) | set(CORE_MODULES))
        raise KeyError(f"no replayable core named {name!r}; known: {', '.join(known)}")
    return _REGISTRY[name]


# --- rendering --------------------------------------------------------------------


def as_named(obj: Any) -> Any:
    """Builtins with field names (array_like Structs encode as bare arrays)."""
    if isinstance(obj, msgspec.Struct):
        return {f: as_named(getattr(obj, f)) for f in obj.__struct_fields__}
    if isinstance(obj, list | tuple):
        return [as_named(v) for v in obj]
    if isinstance(obj, dict):
        return {k: as_named(v) for k, v in obj.items()}
    return obj


@functools.cache
def _defaults(cls: type[msgspec.Struct]) -> tuple[tuple[str, Any], ...]:
    """(field, default value or NODEFAULT) of a Struct type, in field order."""
    return tuple(
        (f.name, f.default_factory() if f.default_factory is not msgspec.NODEFAULT else f.default)
        for f in msgspec.structs.fields(cls)
    )


def render(obj: Any, max_items: int | None = None) -> str:
    """A compact repr: Structs as `Type(field=value)` without fields left at their
    defaults; lists longer than max_items shortened to their head and a count."""
    if isinstance(obj, msgspec.Struct):
        parts = []
        for f, default in _defaults(type(obj)):
            value = getattr(obj, f)
            if default is not msgspec.NODEFAULT and value == default:
                continue
            parts.append(f"{f}={render(value, max_items)}")
        return f"{type(obj).__name__}({', '.join(parts)})"
    if isinstance(obj, list | tuple):
        items = obj if max_items is None else obj[:max_items]
        body = ", ".join(render(v, max_items) for v in items)
        if len(items) < len(obj):
            body += f", ... +{len(obj) - len(items)}"
        return f"[{body}]"
    if isinstance(obj, dict):
        pairs = list(obj.items())
        items = pairs if max_items is None else pairs[:max_items]
        body = ", ".join(f"{render(k)}: {render(v, max_items)}" for k, v in items)
        if len(items) < len(pairs):
            body += f", ... +{len(pairs) - len(items)}"
        return "{" + body + "}"
    return repr(obj)


def pretty(msg: Msg, max_items: int | None = None) -> str:
    """One readable line: `topic Type(field=value, ...)`."""
    return f"{topic_of(msg)} {render(msg, max_items)}"


def field_differences(expected: Any, got: Any, path: str = "") -> list[str]:
    """Where two messages differ, as `path: expected X, got Y` lines (leaves only)."""
    if type(expected) is not type(got):
        return [f"{path or '.'}: expected {expected!r}, got {got!r}"]
    if isinstance(expected, msgspec.Struct):
        return [
            line
            for f in expected.__struct_fields__
            for line in field_differences(
                getattr(expected, f), getattr(got, f), f"{path}.{f}" if path else f
            )
        ]
    if isinstance(expected, list | tuple) and len(expected) == len(got):
        return [
            line
            for i, (a, b) in enumerate(zip(expected, got))
            for line in field_differences(a, b, f"{path}[{i}]")
        ]
    if expected != got:
        return [f"{path or '.'}: expected {expected!r}, got {got!r}"]
    return []


# --- replay -----------------------------------------------------------------------


class Divergence(msgspec.Struct, frozen=True):
    index: int  # position in the outbox of the first difference
    inbox_index: int  # inbox message whose handling produced it (-1: none, e.g. missing)
    input: str | None  # that inbox message, pretty-printed
    expected: str | None  # the recorded message (None: the core produced an extra one)
    got: str | None  # the produced message (None: the core did not produce it)
    differences: list[str] = []  # field by field, when both are the same type


class ReplayResult(msgspec.Struct, frozen=True):
    actor: str
    actor_id: str
    num_inbox: int  # inbox messages fed
    num_outbox: int  # recorded outbox messages
    num_produced: int  # messages the core produced
    divergence: Divergence | None
    num_unrecorded: int = 0  # trailing extras accepted by allow_short_recording

    @property
    def identical(self) -> bool:
        return self.divergence is None

    def report(self) -> str:
        head = (
            f"replay {self.actor} (publisher {self.actor_id}): {self.num_inbox} inbox, "
            f"{self.num_outbox} recorded outbox, {self.num_produced} produced"
        )
        d = self.divergence
        if d is None:
            tail = f" ({self.num_unrecorded} produced after the recording ended)"
            return head + ": identical" + (tail if self.num_unrecorded else "")
        lines = [head, f"FIRST DIVERGENCE at outbox index {d.index}"]
        if d.input is not None:
            lines.append(f"  after inbox #{d.inbox_index}: {d.input}")
        lines.append(f"  expected: {d.expected or '<nothing: the core produced an extra message>'}")
        lines.append(f"  got:      {d.got or '<nothing: the core did not produce it>'}")
        shown = d.differences[:MAX_DIFFERENCES_SHOWN]
        lines += [f"    {line}" for line in shown]
        if len(d.differences) > len(shown):
            lines.append(f"    ... {len(d.differences) - len(shown)} more differences")
        return "\n".join(lines)


_encoder = msgspec.msgpack.Encoder()
_envelope_decoder = msgspec.msgpack.Decoder(Envelope)
MAX_DIFFERENCES_SHOWN = 20


def _matches(topic: str, prefixes: tuple[str, ...]) -> bool:
    return topic.startswith(prefixes)


def replay(
    log_path: str | os.PathLike,
    spec: CoreSpec | str,
    *,
    actor_id: str | None = None,
    allow_short_recording: bool = False,
    run: int = 0,
) -> ReplayResult:
    """Replay one core against a log; see the module docstring for the rules."""
    if isinstance(spec, str):
        spec = get_core(spec)
    actor_id = actor_id or spec.actor_id
    # Only what the actor's replay needs is decoded: a log may hold topics this build
    # does not know, and decoding every message of a long log costs.
    messages: list[tuple[Envelope, Msg]] = []
    for rec in LogReader(log_path).records():
        topic = rec.topic.decode("ascii", "replace")
        if not spec.takes(topic):
            if not _matches(topic, spec.config) and _matches(topic, spec.ignore):
                continue
            if _envelope_decoder.decode(rec.envelope).publisher_id != actor_id:
                continue
        messages.append(decode_record(rec))

    start, end = 0, len(messages)
    config_msg: Msg | None = None
    if spec.config:
        starts = [
            i
            for i, (env, msg) in enumerate(messages)
            if env.publisher_id == actor_id and _matches(topic_of(msg), spec.config)
        ]
        if not starts:
            raise LookupError(
                f"{log_path}: no message under {list(spec.config)} published by "
                f"{actor_id!r} to build core {spec.name!r} from"
            )
        if not 0 <= run < len(starts):
            raise LookupError(
                f"{log_path}: run {run} of {actor_id!r} asked, the log has {len(starts)}"
            )
        config_msg, start = messages[starts[run]][1], starts[run] + 1
        if run + 1 < len(starts):
            end = starts[run + 1]
    elif run != 0:
        raise LookupError(f"core {spec.name!r} has no config message, so the log is one run")
    inbox: list[Msg] = []
    outbox: list[Msg] = []
    for env, msg in messages[start:end]:
        topic = topic_of(msg)
        if spec.takes(topic):
            inbox.append(msg)
        elif env.publisher_id == actor_id and not _matches(topic, spec.ignore):
            outbox.append(msg)

    core = spec.factory(config_msg)
    produced = 0
    divergence: Divergence | None = None
    num_unrecorded = 0
    for i, msg in enumerate(inbox):
        try:
            outs = core.handle(msg)
        except Exception as e:  # the core broke on a recorded input: that is the verdict
            want = pretty(outbox[produced]) if produced < len(outbox) else None
            raised = f"<the core raised {type(e).__name__}: {e}>"
            divergence = Divergence(produced, i, pretty(msg), want, raised)
            break
        for out in outs:
            if produced >= len(outbox):
                if allow_short_recording:
                    num_unrecorded += 1
                    produced += 1
                    continue
                divergence = Divergence(produced, i, pretty(msg), None, pretty(out))
            else:
                want = outbox[produced]
                if _encoder.encode(out) != _encoder.encode(want):
                    diffs = field_differences(want, out) if type(want) is type(out) else []
                    divergence = Divergence(
                        produced, i, pretty(msg), pretty(want), pretty(out), diffs
                    )
            produced += 1
            if divergence is not None:
                break
        if divergence is not None:
            break
    if divergence is None and produced - num_unrecorded < len(outbox):
        missing = produced - num_unrecorded
        divergence = Divergence(missing, -1, None, pretty(outbox[missing]), None)
    return ReplayResult(
        actor=spec.name,
        actor_id=actor_id,
        num_inbox=len(inbox),
        num_outbox=len(outbox),
        num_produced=produced,
        divergence=divergence,
        num_unrecorded=num_unrecorded,
    )
