"""The wire codec: every message in the catalog survives encode/decode unchanged."""

from __future__ import annotations

import msgspec
import msgspec.inspect as mi
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shunter.bus.codec import (
    Decoder,
    Frames,
    WireEnvelope,
    decode_envelope,
    decode_wire_envelope,
    encode,
    encode_body,
    topic_bytes,
    types_for,
)
from shunter.bus.messages import (
    ALL_MESSAGES,
    LAST_SAMPLED,
    TOPICS,
    Envelope,
    ForwardBatch,
    Heartbeat,
    SamplingParams,
    Tick,
    topic_of,
)

_INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
_FLOAT = st.floats(allow_nan=False, width=64)
_TEXT = st.text(max_size=12)
_MAX_LEN = 4


def strategy_for(t: mi.Type) -> st.SearchStrategy:
    """A hypothesis strategy for any field type the catalog uses, from msgspec's own
    description of the type (st.from_type does not understand msgspec Structs)."""
    match t:
        case mi.IntType():
            return _INT64
        case mi.FloatType():
            return _FLOAT
        case mi.StrType():
            return _TEXT
        case mi.BoolType():
            return st.booleans()
        case mi.NoneType():
            return st.none()
        case mi.BytesType():
            return st.binary(max_size=16)
        case mi.ListType(item_type=item):
            return st.lists(strategy_for(item), max_size=_MAX_LEN)
        case mi.VarTupleType(item_type=item):
            return st.lists(strategy_for(item), max_size=_MAX_LEN).map(tuple)
        case mi.TupleType(item_types=items):
            return st.tuples(*(strategy_for(i) for i in items))
        case mi.DictType(key_type=k, value_type=v):
            return st.dictionaries(strategy_for(k), strategy_for(v), max_size=_MAX_LEN)
        case mi.UnionType(types=types):
            return st.one_of(*(strategy_for(x) for x in types))
        case mi.LiteralType(values=values):
            return st.sampled_from(values)
        case mi.StructType(cls=cls, fields=fields):
            kwargs = {f.name: strategy_for(f.type) for f in fields}
            return st.fixed_dictionaries(kwargs).map(lambda kw: cls(**kw))
        case mi.AnyType():  # free-form JSON values (template variables)
            scalars = st.none() | st.booleans() | _INT64 | _FLOAT | _TEXT
            return st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                                | st.dictionaries(_TEXT, inner, max_size=3), max_leaves=6)  # fmt: skip
    raise NotImplementedError(f"no strategy for {t!r}: extend strategy_for")


def message_strategy(cls: type) -> st.SearchStrategy:
    return strategy_for(mi.type_info(cls))


envelopes = st.builds(Envelope, _TEXT, st.integers(0, 2**63 - 1), _INT64, _INT64)
ANY = Decoder()


@pytest.mark.parametrize("cls", ALL_MESSAGES, ids=lambda c: topic_of(c))
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_message_round_trips(cls, data):
    msg = data.draw(message_strategy(cls))
    env = data.draw(envelopes)
    frames = encode(msg, env)
    assert isinstance(frames, Frames)
    assert frames.topic == topic_of(cls).encode()
    assert decode_envelope(frames.envelope) == env
    assert ANY.decode(frames.body) == msg
    typed = Decoder(types=(cls,)).decode(frames.body)
    assert typed == msg and type(typed) is cls
    assert encode_body(typed) == frames.body  # canonical: re-encoding is byte-identical


@pytest.mark.heavy
@pytest.mark.parametrize("cls", ALL_MESSAGES, ids=lambda c: topic_of(c))
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_every_message_round_trips_long(cls, data):
    msg = data.draw(message_strategy(cls))
    assert Decoder(types=(cls,)).decode(encode_body(msg)) == msg


def test_catalog_topics_are_unique_and_plain():
    assert len(TOPICS) == len(ALL_MESSAGES)
    for cls in ALL_MESSAGES:
        b = topic_bytes(cls)
        assert b and not b.startswith(b"\x00") and b.decode("ascii") == topic_of(cls)
    assert types_for("sched.batch", "sched.tick") == (ForwardBatch, Tick)
    with pytest.raises(ValueError, match="unknown topics"):
        types_for("no.such")


def test_typed_decoder_rejects_other_messages():
    body = encode_body(Tick(now_ns=3))
    inbox = Decoder(types=(ForwardBatch, Heartbeat))
    with pytest.raises(msgspec.ValidationError):
        inbox.decode(body)
    with pytest.raises(msgspec.ValidationError):
        Decoder(types=(ForwardBatch,)).decode(body)
    with pytest.raises(msgspec.DecodeError):
        inbox.decode(b"\xc1 not msgpack")
    assert Decoder(types=(Tick, Heartbeat)).decode(body) == Tick(now_ns=3)
    with pytest.raises(ValueError):
        Decoder(types=())
    with pytest.raises(TypeError):
        Decoder(types=(SamplingParams,))  # a Struct, but not a tagged bus message


def test_messages_are_immutable_and_body_starts_with_tag():
    msg = ForwardBatch(step_id=1, rows=[0], input_ids=[LAST_SAMPLED])
    with pytest.raises(AttributeError):
        msg.step_id = 2  # type: ignore[misc]
    assert msgspec.msgpack.decode(encode_body(msg))[0] == "sched.batch"


def test_decode_envelope_rejects_garbage():
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        decode_envelope(b"\x93\x01\x02")
    with pytest.raises(msgspec.DecodeError):
        decode_envelope(b"")


def test_topic_seq_rides_after_the_envelope_and_plain_readers_ignore_it():
    env = Envelope("scheduler", 41, 5, 6)
    frames = encode(Tick(1), env, topic_seq=7)
    assert decode_envelope(frames.envelope) == env  # readers of Envelope are unaffected
    assert decode_wire_envelope(frames.envelope) == WireEnvelope("scheduler", 41, 5, 6, 7)
    assert decode_wire_envelope(frames.envelope).envelope() == env
    assert decode_wire_envelope(encode(Tick(1), env).envelope).topic_seq == -1
