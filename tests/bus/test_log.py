"""Event log: writer and reader round trips, rotation, flush bounds, torn tails,
corruption, and the recorder on a real in-process bus."""

from __future__ import annotations

import functools
import importlib.util
import pathlib
import zlib

import anyio
import msgspec
import pytest
import structlog.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shunter.bus.codec import encode
from shunter.bus.inproc import InProcHub
from shunter.bus.log import (
    MAGIC,
    LogCorrupt,
    LogDecodeError,
    LogReader,
    LogWriter,
    RecorderConfig,
    decode_record,
    list_segments,
    record,
)
from shunter.bus.messages import (
    ALL_MESSAGES,
    Envelope,
    RequestOutput,
    StepResult,
    Tick,
    TokensOut,
)

HERE = pathlib.Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("make_golden", HERE / "make_golden.py")
make_golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_golden)

S = 1_000_000_000  # ns per second


@pytest.fixture
def anyio_backend():
    return "asyncio"  # zmq.asyncio needs an asyncio loop


def traffic(n: int):
    """n (envelope, message) pairs of varied types and sizes, from three publishers."""
    canon = [make_golden.canonical(cls) for cls in ALL_MESSAGES]
    seqs = {"scheduler": 0, "executor.0": 0, "cache": 0}
    out = []
    for i in range(n):
        match i % 4:
            case 0:
                pid, msg = "executor.0", StepResult(i, list(range(i % 97)), [i] * (i % 97))
            case 1:
                outs = [RequestOutput(f"r{j}", [i, j]) for j in range(i % 13)]
                pid, msg = "scheduler", TokensOut(i, outs)
            case 2:
                pid, msg = "scheduler", Tick(now_ns=i * 1000)
            case _:
                pid, msg = "cache", canon[i % len(canon)]
        out.append((Envelope(pid, seqs[pid], i, 10 * i), msg))
        seqs[pid] += 1
    return out


def write(directory, pairs, config=None, t0=0, dt=1):
    w = LogWriter(directory, config)
    for k, (env, msg) in enumerate(pairs):
        w.append(encode(msg, env), t0 + k * dt)
    w.close()
    return w


def test_round_trip_in_order_across_rotated_segments(tmp_path):
    pairs = traffic(3000)
    w = write(tmp_path, pairs, RecorderConfig(max_segment_bytes=32 << 10))
    segs = list_segments(tmp_path)
    assert len(segs) >= 5, segs
    assert [s.name for s in segs] == [f"events-{i:06d}.log" for i in range(1, len(segs) + 1)]
    assert all(s.stat().st_size <= (32 << 10) + 4096 for s in segs)
    reader = LogReader(tmp_path)
    got = list(reader.messages())
    assert got == pairs
    st = reader.statistics()
    assert (st.num_records, st.num_segments, st.torn) == (3000, len(segs), False)
    assert (
        st.num_bytes
        == w.statistics().num_bytes
        == sum(s.stat().st_size for s in segs) - len(segs) * len(MAGIC)
    )
    # raw records keep the wire frames untouched
    first = next(LogReader(tmp_path).records())
    assert (first.topic, first.envelope, first.body) == tuple(encode(pairs[0][1], pairs[0][0]))


def test_a_single_segment_file_reads_alone(tmp_path):
    write(tmp_path, traffic(500), RecorderConfig(max_segment_bytes=8 << 10))
    segs = list_segments(tmp_path)
    whole = [r.body for r in LogReader(tmp_path).records()]
    second = [r.body for r in LogReader(segs[1]).records()]
    assert second and whole[len([*LogReader(segs[0]).records()]) :][: len(second)] == second


def test_rotation_by_time_and_no_empty_segments(tmp_path):
    pairs = traffic(10)
    cfg = RecorderConfig(max_segment_age_s=1.0)
    w = LogWriter(tmp_path, cfg)
    times = [0, S // 2, S - 1, S, S + 1, 5 * S, 5 * S + 1, 9 * S, 9 * S, 10 * S]
    for (env, msg), t in zip(pairs, times):
        w.append(encode(msg, env), t)
    w.tick(100 * S)  # closes the aged segment; nothing new is opened while idle
    w.tick(200 * S)
    assert w.statistics().segment is None
    w.close()
    counts = [sum(1 for _ in LogReader(s).records()) for s in list_segments(tmp_path)]
    # a segment spans [opened, opened + 1 s): 0..S-1 | S, S+1 | 5S, 5S+1 | 9S, 9S | 10S
    assert counts == [3, 2, 2, 2, 1]


def test_restarted_writer_opens_the_next_segment(tmp_path):
    write(tmp_path, traffic(5))
    write(tmp_path, traffic(7))
    segs = list_segments(tmp_path)
    assert [s.name for s in segs] == ["events-000001.log", "events-000002.log"]
    assert LogReader(tmp_path).statistics().num_segments == 2
    assert sum(1 for _ in LogReader(tmp_path).records()) == 12


def _visible(path) -> int:
    """Records another process would see on disk right now."""
    return sum(1 for _ in LogReader(path).records()) if list_segments(path) else 0


def test_flush_every_n_records_and_within_the_interval(tmp_path):
    pairs = traffic(30)
    w = LogWriter(tmp_path, RecorderConfig(flush_every_records=10, flush_interval_ms=50))
    for k in range(9):
        w.append(encode(pairs[k][1], pairs[k][0]), k)
    assert _visible(tmp_path) == 0  # small records sit in the file buffer
    w.append(encode(pairs[9][1], pairs[9][0]), 9)
    assert _visible(tmp_path) == 10
    t0 = 1_000_000
    w.append(encode(pairs[10][1], pairs[10][0]), t0)
    w.tick(t0 + 49_999_999)
    assert _visible(tmp_path) == 10
    w.tick(t0 + 50_000_000)
    assert _visible(tmp_path) == 11
    assert w.statistics().num_flushes == 2
    w.close()


def _last_record_offset(directory) -> int:
    return [r.offset for r in LogReader(directory).records()][-1]


def test_torn_tail_truncated_mid_record(tmp_path):
    pairs = traffic(200)
    write(tmp_path, pairs, RecorderConfig(max_segment_bytes=8 << 10))
    last = list_segments(tmp_path)[-1]
    cut = _last_record_offset(tmp_path) + 7  # inside the last record
    last.write_bytes(last.read_bytes()[:cut])
    reader = LogReader(tmp_path)
    with structlog.testing.capture_logs() as logs:
        got = list(reader.messages())
    assert got == pairs[:-1]
    st = reader.statistics()
    assert st.torn and st.num_torn_bytes == 7
    assert st.torn_segments == [f"{last.name}@{cut - 7}"]
    # the warning is a structured event, wherever logging is configured to go
    assert any("torn tail" in e["event"] and e["log_level"] == "warning" for e in logs)


def test_torn_tail_garbage_appended(tmp_path):
    pairs = traffic(50)
    write(tmp_path, pairs)
    seg = list_segments(tmp_path)[-1]
    size = seg.stat().st_size
    garbage = b"\x13\x00\x00\x00garbage that is not a record" * 3
    with open(seg, "ab") as f:
        f.write(garbage)
    reader = LogReader(tmp_path)
    assert list(reader.messages()) == pairs
    st = reader.statistics()
    assert (
        st.torn and st.torn_segments == [f"{seg.name}@{size}"] and st.num_torn_bytes == len(garbage)
    )


def test_torn_segment_followed_by_a_restart_reads_both(tmp_path):
    pairs = traffic(40)
    write(tmp_path, pairs[:20])
    seg = list_segments(tmp_path)[0]
    seg.write_bytes(seg.read_bytes()[:-3])  # the crash
    write(tmp_path, pairs[20:])  # the restarted recorder
    reader = LogReader(tmp_path)
    assert list(reader.messages()) == pairs[:19] + pairs[20:]
    assert reader.statistics().torn_segments[0].startswith("events-000001.log@")


def test_segment_torn_before_its_magic_is_a_torn_tail(tmp_path):
    write(tmp_path, traffic(3))
    (tmp_path / "events-000002.log").write_bytes(MAGIC[:3])
    reader = LogReader(tmp_path)
    assert sum(1 for _ in reader.records()) == 3
    assert reader.statistics().torn_segments == ["events-000002.log@0"]


def test_corruption_in_the_middle_stops_naming_file_and_offset(tmp_path):
    write(tmp_path, traffic(100), RecorderConfig(max_segment_bytes=4 << 10))
    seg = list_segments(tmp_path)[1]
    offsets = [r.offset for r in LogReader(seg).records()]
    data = bytearray(seg.read_bytes())
    data[offsets[2] + 12] ^= 0xFF  # a payload byte of the third record
    seg.write_bytes(bytes(data))
    reader = LogReader(tmp_path)
    with pytest.raises(LogCorrupt) as e:
        list(reader.records())
    assert e.value.path == seg and e.value.offset == offsets[2]
    assert f"{seg.name}: corrupt record at offset {offsets[2]}" in str(e.value)


def test_not_a_log(tmp_path):
    (tmp_path / "events-000001.log").write_bytes(b"PK\x03\x04 a zip file, not a log")
    with pytest.raises(LogCorrupt, match="bad magic"):
        list(LogReader(tmp_path).records())
    with pytest.raises(FileNotFoundError):
        LogReader(tmp_path / "missing")


def test_unknown_message_is_a_clear_decode_error(tmp_path):
    w = LogWriter(tmp_path)
    env = msgspec.msgpack.encode(Envelope("x", 0, 0, 0))
    w.append((b"future.topic", env, msgspec.msgpack.encode(["future.topic", 1])), 0)
    w.close()
    (rec,) = LogReader(tmp_path).records()  # raw reading still works
    with pytest.raises(
        LogDecodeError, match=r"events-000001.log@8: cannot decode a 'future.topic'"
    ):
        decode_record(rec)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_segment_bytes": 10},
        {"max_segment_age_s": -1},
        {"flush_every_records": 0},
        {"flush_interval_ms": 0},
    ],
)
def test_config_is_validated(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        RecorderConfig(**kwargs)


@pytest.mark.anyio
async def test_recorder_on_the_in_process_bus(tmp_path):
    hub = InProcHub()
    sched, recorder_bus = hub.connect("scheduler"), hub.connect("recorder")
    msgs = [Tick(now_ns=k) for k in range(300)] + [StepResult(7, [1, 2], [3, 4])]
    cfg = RecorderConfig(max_segment_bytes=2048, flush_interval_ms=20)
    async with anyio.create_task_group() as tg:
        await tg.start(record, recorder_bus, tmp_path, cfg)  # returns once subscribed
        for m in msgs:
            await sched.publish(m)
        with anyio.fail_after(5):  # the idle tick flushes without a close
            while _visible(tmp_path) < len(msgs):
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    got = list(LogReader(tmp_path).messages())
    assert [m for _, m in got] == msgs
    assert [e.seq for e, _ in got] == list(range(len(msgs)))
    assert {e.publisher_id for e, _ in got} == {"scheduler"}
    assert len(list_segments(tmp_path)) > 1


@pytest.mark.parametrize("size", [0, 1, 255, 256, 65535, 65536, 70000])
def test_record_framing_is_length_crc_and_the_msgpack_array_of_the_frames(size):
    from shunter.bus.log import encode_record

    body = bytes(range(256)) * (size // 256) + bytes(size % 256)
    rec = encode_record(b"sched.batch", b"\x94\xa1p\x01\x02\x03", body)
    payload = msgspec.msgpack.encode((b"sched.batch", b"\x94\xa1p\x01\x02\x03", body))
    assert rec[8:] == payload and int.from_bytes(rec[:4], "little") == len(payload)
    assert int.from_bytes(rec[4:8], "little") == zlib.crc32(payload, zlib.crc32(rec[:4]))


def _one_segment_log(tmp_path_factory, n: int = 40):
    directory = tmp_path_factory.mktemp("log")
    write(directory, traffic(n))
    (seg,) = list_segments(directory)
    offsets = [r.offset for r in LogReader(directory).records()]
    return directory, seg, seg.read_bytes(), offsets


@given(cut=st.integers(min_value=0, max_value=10**6))
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_any_truncation_reads_every_whole_record_before_it(tmp_path_factory, cut):
    directory, seg, data, offsets = _one_segment_log(tmp_path_factory)
    cut = len(MAGIC) + cut % (len(data) - len(MAGIC) + 1)
    seg.write_bytes(data[:cut])
    reader = LogReader(directory)
    got = list(reader.records())
    whole = [o for o, end in zip(offsets, [*offsets[1:], len(data)]) if end <= cut]
    assert [r.offset for r in got] == whole
    at_boundary = cut in (*offsets, len(data))
    assert reader.statistics().torn == (not at_boundary)


@given(pos=st.integers(min_value=0, max_value=10**6), flip=st.integers(min_value=1, max_value=255))
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_any_flipped_byte_is_caught_where_it_lies(tmp_path_factory, pos, flip):
    directory, seg, data, offsets = _one_segment_log(tmp_path_factory)
    pos = len(MAGIC) + pos % (len(data) - len(MAGIC))
    damaged = bytearray(data)
    damaged[pos] ^= flip
    seg.write_bytes(bytes(damaged))
    hit = max(o for o in offsets if o <= pos)  # the record holding the byte
    reader = LogReader(directory)
    if hit == offsets[-1]:  # the last record: indistinguishable from a torn write
        assert [r.offset for r in reader.records()] == offsets[:-1]
        assert reader.statistics().torn_segments == [f"{seg.name}@{hit}"]
    else:
        with pytest.raises(LogCorrupt) as e:
            list(reader.records())
        assert e.value.offset == hit


def test_skip_corrupt_reads_past_the_damage_and_reports_it(tmp_path):
    pairs = traffic(60)
    write(tmp_path, pairs)
    (seg,) = list_segments(tmp_path)
    offsets = [r.offset for r in LogReader(tmp_path).records()]
    data = bytearray(seg.read_bytes())
    data[offsets[10] + 9] ^= 0x55
    data[offsets[30] + 9] ^= 0x55
    seg.write_bytes(bytes(data))
    reader = LogReader(tmp_path, skip_corrupt=True)
    got = list(reader.messages())
    assert got == pairs[:10] + pairs[11:30] + pairs[31:]
    st = reader.statistics()
    assert st.skipped == [f"{seg.name}@{offsets[10]}", f"{seg.name}@{offsets[30]}"]
    assert st.num_skipped_bytes == offsets[11] - offsets[10] + offsets[31] - offsets[30]
    assert not st.torn


@pytest.mark.anyio
async def test_recording_some_topics_reports_no_false_gaps(tmp_path):
    hub = InProcHub()
    sched, recorder_bus = hub.connect("scheduler"), hub.connect("recorder")
    msgs = [Tick(now_ns=k) if k % 3 else StepResult(k, [1], [k]) for k in range(60)]
    async with anyio.create_task_group() as tg:
        cfg = RecorderConfig(flush_interval_ms=10)
        only = functools.partial(record, prefixes=("sched.result",))
        await tg.start(only, recorder_bus, tmp_path, cfg)
        for m in msgs:
            await sched.publish(m)
        with anyio.fail_after(5):
            while _visible(tmp_path) < 20:
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    got = list(LogReader(tmp_path).messages())
    assert [m for _, m in got] == [m for m in msgs if isinstance(m, StepResult)]
    assert [e.seq for e, _ in got] == list(range(0, 60, 3))  # holes, but not losses
    assert recorder_bus.statistics().num_events == 0  # so no BusGap was published


@pytest.mark.heavy
def test_large_log_round_trip(tmp_path):
    pairs = traffic(200_000)
    write(tmp_path, pairs, RecorderConfig(max_segment_bytes=1 << 20))
    assert len(list_segments(tmp_path)) > 10
    reader = LogReader(tmp_path)
    n = 0
    for got, want in zip(reader.messages(), pairs, strict=True):
        assert got == want
        n += 1
    assert n == len(pairs) and not reader.statistics().torn
