"""Event log: a recorder that appends every bus frame to a rotating log, and its reader.

Theory of operation
-------------------
A log is a directory of segments, `events-000001.log`, `events-000002.log`, ...; the
number gives the order. A segment opens with the 8-byte magic `SHUNTLG1`, then records:

    u32 length (little endian) | u32 crc32(length bytes + payload) | payload

where payload is the msgpack array `[topic, envelope, body]` of the three wire frames,
untouched (bin items): the recorder never decodes, so it costs one copy per message and
a log stays readable by newer code for as long as the messages are (see base.py's
schema rules). `LogWriter` is the synchronous part: it is told the time (`now_ns`) with
every call and never reads a clock, so rotation and flush bounds are testable. `record`
is the async shell that feeds it from `Bus.subscribe_raw` and ticks it while idle.

A writer always starts a new segment (number = highest present + 1) and never appends
to an old one, so a recorder restarted after a crash leaves the torn segment as it was.

Reading and damage
------------------
A record that does not check out (short header, implausible length, payload past the
end of the file, crc mismatch) is handled by looking for any valid record after it in
the same segment:
- none: a torn tail (a crash mid-write, or garbage appended). The reader warns, counts
  it in `statistics()` (`torn`, `torn_segments`, `num_torn_bytes`) and goes on with the
  next segment. Every record before the damage is read.
- some: corruption in the middle. Reading stops with `LogCorrupt`, naming the file and
  the offset of the bad record: silently skipping records would make a replay lie.
  A person inspecting a damaged log can ask to skip it (`skip_corrupt=True`, busctl's
  `--skip-corrupt`); every skip is then warned about and listed in `statistics()`.
A segment still being written reads as torn where its unflushed part begins.

Invariants
----------
- Records come back in the order they were appended, across segments.
- A record is either read whole and checksummed, or reported; never half-read.
- The writer flushes at least every `flush_every_records` records and within
  `flush_interval_ms` of the oldest unflushed record (checked on append and tick).
"""

from __future__ import annotations

import os
import pathlib
import re
import struct
import time
import zlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, BinaryIO, NamedTuple

import anyio
import anyio.abc
import msgspec
import structlog

from shunter.bus.messages import AnyMessage, Envelope, Msg

if TYPE_CHECKING:
    from shunter.bus.codec import Frames
    from shunter.bus.transport import Bus

log = structlog.get_logger("shunter.bus.log")

MAGIC = b"SHUNTLG1"
_HEADER = struct.Struct("<II")  # payload length, crc32
_LENGTH = struct.Struct("<I")
MAX_RECORD_BYTES = 64 << 20  # a longer length field is damage, not a record
SEGMENT_RE = re.compile(r"^events-(\d{6,})\.log$")

_payload_encoder = msgspec.msgpack.Encoder()
_payload_decoder = msgspec.msgpack.Decoder(tuple[bytes, bytes, bytes])
_envelope_decoder = msgspec.msgpack.Decoder(Envelope)
_msg_decoder = msgspec.msgpack.Decoder(AnyMessage)


class LogCorrupt(ValueError):
    """A damaged record with valid records after it: the log cannot be trusted past it."""

    def __init__(self, path: pathlib.Path, offset: int, reason: str):
        super().__init__(f"{path}: corrupt record at offset {offset}: {reason}")
        self.path = path
        self.offset = offset


class LogDecodeError(ValueError):
    """A record is intact but its body is not a message this build knows."""


class RecorderConfig(msgspec.Struct, frozen=True):
    max_segment_bytes: int = 64 << 20
    """Start a new segment once the current one is at least this large."""
    max_segment_age_s: float = 3600.0
    """Start a new segment once the current one is this old (0: never)."""
    flush_every_records: int = 256
    """Flush to the OS after this many unflushed records."""
    flush_interval_ms: float = 200.0
    """Flush when the oldest unflushed record is this old."""
    fsync: bool = False
    """Also fsync a segment when it is closed (rotation, close)."""

    def __post_init__(self):
        if self.max_segment_bytes < 1024:
            raise ValueError(f"max_segment_bytes must be >= 1024, got {self.max_segment_bytes}")
        if self.max_segment_age_s < 0:
            raise ValueError(f"max_segment_age_s must be >= 0, got {self.max_segment_age_s}")
        if self.flush_every_records < 1:
            raise ValueError(f"flush_every_records must be >= 1, got {self.flush_every_records}")
        if self.flush_interval_ms <= 0:
            raise ValueError(f"flush_interval_ms must be > 0, got {self.flush_interval_ms}")


class WriterStatistics(msgspec.Struct, frozen=True):
    num_records: int
    num_bytes: int  # record bytes written, headers included
    num_segments: int  # segments this writer opened
    num_flushes: int
    segment: str | None  # the open segment's file name


class Record(NamedTuple):
    """One recorded frame triple, and where it lies."""

    segment: str  # file name
    offset: int  # byte offset of the record header in its segment
    topic: bytes
    envelope: bytes
    body: bytes


class LogStatistics(msgspec.Struct, frozen=True):
    num_segments: int
    num_records: int
    num_bytes: int  # bytes of intact records, headers included
    torn: bool
    torn_segments: list[str] = []  # "events-000003.log@1234": where each torn tail starts
    num_torn_bytes: int = 0
    skipped: list[str] = []  # where corrupt runs were skipped (skip_corrupt=True only)
    num_skipped_bytes: int = 0


def segment_name(index: int) -> str:
    return f"events-{index:06d}.log"


def list_segments(directory: pathlib.Path) -> list[pathlib.Path]:
    """The directory's segments in log order."""
    found = []
    for p in directory.iterdir():
        m = SEGMENT_RE.match(p.name)
        if m and p.is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def encode_record(topic: bytes, envelope: bytes, body: bytes) -> bytes:
    """One framed record: length, crc32, msgpack [topic, envelope, body]."""
    payload = _payload_encoder.encode((topic, envelope, body))
    head = _LENGTH.pack(len(payload))
    return head + _LENGTH.pack(zlib.crc32(payload, zlib.crc32(head))) + payload


class LogWriter:
    """Appends frame triples to the segments of one directory. Not thread-safe."""

    def __init__(self, directory: str | os.PathLike, config: RecorderConfig | None = None):
        self.directory = pathlib.Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.config = config or RecorderConfig()
        existing = list_segments(self.directory)
        self._next_index = int(SEGMENT_RE.match(existing[-1].name).group(1)) + 1 if existing else 1
        self._file: BinaryIO | None = None
        self._segment: str | None = None
        self._segment_bytes = 0
        self._rotate_at_ns = 0  # the open segment's age limit, as a time
        self._flush_at_ns = 0  # the oldest unflushed record's flush deadline
        self._max_age_ns = int(self.config.max_segment_age_s * 1e9) or (1 << 62)
        self._flush_interval_ns = int(self.config.flush_interval_ms * 1e6)
        self._num_unflushed = 0
        self._num_records = 0
        self._num_bytes = 0
        self._num_segments = 0
        self._num_flushes = 0

    def append(self, frames: Frames | tuple[bytes, bytes, bytes], now_ns: int) -> None:
        """Append one frame triple (bytes-like frames are written as they are)."""
        record = encode_record(*frames)
        f = self._file
        if f is None or now_ns >= self._rotate_at_ns:
            if f is not None:
                self._close_segment()
            f = self._open_segment(now_ns)
        f.write(record)
        self._segment_bytes += len(record)
        self._num_records += 1
        self._num_bytes += len(record)
        if self._num_unflushed == 0:
            self._flush_at_ns = now_ns + self._flush_interval_ns
        self._num_unflushed += 1
        if self._num_unflushed >= self.config.flush_every_records or now_ns >= self._flush_at_ns:
            self.flush()
        if self._segment_bytes >= self.config.max_segment_bytes:
            self._close_segment()

    def tick(self, now_ns: int) -> None:
        """Flush when the interval bound is reached; close an aged segment (the next
        append opens a new one, so an idle recorder leaves no empty segments)."""
        if self._file is None:
            return
        if self._num_unflushed and now_ns >= self._flush_at_ns:
            self.flush()
        if now_ns >= self._rotate_at_ns:
            self._close_segment()

    def flush(self) -> None:
        if self._file is not None and self._num_unflushed:
            self._file.flush()
            self._num_flushes += 1
        self._num_unflushed = 0

    def close(self) -> None:
        self._close_segment()

    def statistics(self) -> WriterStatistics:
        return WriterStatistics(
            num_records=self._num_records,
            num_bytes=self._num_bytes,
            num_segments=self._num_segments,
            num_flushes=self._num_flushes,
            segment=self._segment,
        )

    def _open_segment(self, now_ns: int) -> BinaryIO:
        name = segment_name(self._next_index)
        self._next_index += 1
        # "xb": never overwrite a segment some other writer created meanwhile
        f = self._file = open(self.directory / name, "xb")  # noqa: SIM115
        f.write(MAGIC)
        self._segment = name
        self._segment_bytes = len(MAGIC)
        self._rotate_at_ns = now_ns + self._max_age_ns
        self._num_segments += 1
        log.debug("segment opened", segment=name)
        return f

    def _close_segment(self) -> None:
        if self._file is None:
            return
        self.flush()
        if self.config.fsync:
            os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        self._segment = None


def _valid_record_at(buf: bytes | memoryview, pos: int) -> int:
    """Length of the intact record at pos (header included), or 0 if there is none."""
    end = len(buf)
    if pos + _HEADER.size > end:
        return 0
    length, crc = _HEADER.unpack_from(buf, pos)
    stop = pos + _HEADER.size + length
    if length > MAX_RECORD_BYTES or stop > end:
        return 0
    if zlib.crc32(buf[pos + _HEADER.size : stop], zlib.crc32(buf[pos : pos + 4])) != crc:
        return 0
    return stop - pos


class LogReader:
    """Reads a log (a directory of segments, or one segment file) in order.

    `records()` yields raw `Record`s; `messages()` yields typed `(Envelope, Msg)`.
    `statistics()` describes what the last complete pass found (torn tails included).
    `skip_corrupt=True` reads past corruption in the middle (to the next intact record)
    instead of raising, and reports each skip in `statistics()`: for looking at a
    damaged log, never for replaying one."""

    def __init__(self, path: str | os.PathLike, *, skip_corrupt: bool = False):
        self.path = pathlib.Path(path)
        self.skip_corrupt = skip_corrupt
        if self.path.is_dir():
            self.segments = list_segments(self.path)
        elif self.path.is_file():
            self.segments = [self.path]
        else:
            raise FileNotFoundError(f"no event log at {self.path}")
        self._stats = LogStatistics(len(self.segments), 0, 0, False)

    def records(self) -> Iterator[Record]:
        num_records = num_bytes = num_torn_bytes = num_skipped_bytes = 0
        torn_segments: list[str] = []
        skipped: list[str] = []
        for seg in self.segments:
            buf, name = seg.read_bytes(), seg.name
            if buf[: len(MAGIC)] != MAGIC:
                if MAGIC.startswith(buf):  # created, then the crash came before the magic
                    torn_segments.append(f"{seg.name}@0")
                    num_torn_bytes += len(buf)
                    log.warning("torn event log segment", segment=str(seg), offset=0)
                    continue
                raise LogCorrupt(seg, 0, "not an event log segment (bad magic)")
            view = memoryview(buf)
            pos = len(MAGIC)
            while pos < len(buf):
                size = _valid_record_at(view, pos)
                if size == 0:
                    resume = next(
                        (p for p in range(pos + 1, len(buf)) if _valid_record_at(view, p)), None
                    )
                    if resume is not None:
                        why = f"bad record, {resume - pos} bytes before the next intact one"
                        if not self.skip_corrupt:
                            raise LogCorrupt(seg, pos, why)
                        skipped.append(f"{name}@{pos}")
                        num_skipped_bytes += resume - pos
                        log.warning("skipped corrupt bytes in event log", segment=str(seg),
                                    offset=pos, num_bytes=resume - pos)  # fmt: skip
                        pos = resume
                        continue
                    torn_segments.append(f"{seg.name}@{pos}")
                    num_torn_bytes += len(buf) - pos
                    log.warning(
                        "torn tail in event log",
                        segment=str(seg),
                        offset=pos,
                        num_bytes=len(buf) - pos,
                    )
                    break
                try:
                    topic, envelope, body = _payload_decoder.decode(
                        view[pos + _HEADER.size : pos + size]
                    )
                except msgspec.DecodeError as e:  # checksum passed, so a writer bug
                    raise LogCorrupt(
                        seg, pos, f"payload is not [topic, envelope, body]: {e}"
                    ) from e
                yield Record(name, pos, topic, envelope, body)
                num_records += 1
                num_bytes += size
                pos += size
        self._stats = LogStatistics(
            num_segments=len(self.segments),
            num_records=num_records,
            num_bytes=num_bytes,
            torn=bool(torn_segments),
            torn_segments=torn_segments,
            num_torn_bytes=num_torn_bytes,
            skipped=skipped,
            num_skipped_bytes=num_skipped_bytes,
        )

    def messages(self) -> Iterator[tuple[Envelope, Msg]]:
        for rec in self.records():
            yield decode_record(rec)

    def statistics(self) -> LogStatistics:
        return self._stats


def decode_record(rec: Record) -> tuple[Envelope, Msg]:
    """The typed envelope and message of a record; LogDecodeError names where it lies."""
    try:
        return _envelope_decoder.decode(rec.envelope), _msg_decoder.decode(rec.body)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        topic = rec.topic.decode(errors="replace")
        raise LogDecodeError(
            f"{rec.segment}@{rec.offset}: cannot decode a '{topic}' record: {e}"
        ) from e


async def record(
    bus: Bus,
    directory: str | os.PathLike,
    config: RecorderConfig | None = None,
    *,
    prefixes: tuple[str, ...] = ("",),
    started: anyio.Event | None = None,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Record every frame the bus delivers (topics under `prefixes`) until cancelled.

    Once the subscription is connected, `started` is set and `task_status.started()`
    is called, so `await task_group.start(record, bus, path)` returns only when nothing
    published afterwards can be missed. The segment is flushed and closed on the way
    out, cancellation included."""
    writer = LogWriter(directory, config)
    tick_s = writer.config.flush_interval_ms / 1e3
    log.info("recording", directory=str(writer.directory))

    async def tick_while_idle() -> None:
        while True:
            await anyio.sleep(tick_s)
            writer.tick(time.monotonic_ns())

    try:
        async with bus.subscribe_raw(*prefixes) as sub, anyio.create_task_group() as tg:
            tg.start_soon(tick_while_idle)
            if started is not None:
                started.set()
            task_status.started()
            while True:
                try:  # what is queued comes in one wakeup, not a task switch each
                    batch = await sub.receive_many(1024)
                except (anyio.ClosedResourceError, anyio.EndOfStream):
                    break  # the bus closed
                now_ns = time.monotonic_ns()
                for frames in batch:
                    writer.append(frames, now_ns)
            tg.cancel_scope.cancel()
    finally:
        writer.close()
        log.info("recording stopped", **msgspec.structs.asdict(writer.statistics()))
