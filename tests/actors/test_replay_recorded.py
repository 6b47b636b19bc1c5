"""Replay of a recorded real run (tests/data/replay/multi_request, see its README): the
scheduler and cache manager cores, rebuilt from their recorded config messages and fed
their recorded inboxes, reproduce their recorded outboxes exactly, through the real
`busctl replay` command; a log with one decision changed is caught."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import msgspec
import pytest

from shunter.bus.log import LogReader, LogWriter
from shunter.bus.messages import ForwardBatch, Matched

LOG = pathlib.Path(__file__).resolve().parents[1] / "data" / "replay" / "multi_request"


def busctl_replay(log: pathlib.Path, actor: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shunter.ops.busctl", "replay", str(log), "--actor", actor],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_the_recording_is_a_multi_request_run_with_prefix_hits():
    msgs = [m for _, m in LogReader(LOG).messages()]
    matched = [m for m in msgs if isinstance(m, Matched)]
    assert len({m.request.request_id for m in matched}) >= 10
    assert any(m.num_cached_tokens >= 64 for m in matched)  # shared system prompts hit
    assert any(len(b.opens) > 1 for b in msgs if isinstance(b, ForwardBatch))


@pytest.mark.parametrize("actor", ["scheduler", "cache", "tokenizer"])
def test_recorded_run_replays_identically(actor):
    r = busctl_replay(LOG, actor)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "identical" in r.stdout


def _tampered_copy(dst: pathlib.Path, publisher: str, msg_type, change) -> None:
    """Copy the log, changing the first `msg_type` message `publisher` recorded."""
    writer = LogWriter(dst)
    done = False
    for i, rec in enumerate(LogReader(LOG).records()):
        body = rec.body
        if not done and rec.topic.decode() == msgspec.inspect.type_info(msg_type).tag:
            env = msgspec.msgpack.decode(rec.envelope)
            if env[0] == publisher:
                msg = msgspec.msgpack.decode(rec.body, type=msg_type)
                body = msgspec.msgpack.encode(change(msg))
                done = True
        writer.append((rec.topic, rec.envelope, body), now_ns=i)
    writer.close()
    assert done


@pytest.mark.parametrize(
    ("actor", "msg_type", "change"),
    [
        ("scheduler", ForwardBatch,
         lambda b: msgspec.structs.replace(b, input_ids=[*b.input_ids[:-1], 0])),
        ("cache", Matched,
         lambda m: msgspec.structs.replace(m, num_cached_tokens=m.num_cached_tokens + 1)),
    ],
)  # fmt: skip
def test_a_changed_decision_is_caught(tmp_path, actor, msg_type, change):
    _tampered_copy(tmp_path / "log", actor, msg_type, change)
    r = busctl_replay(tmp_path / "log", actor)
    assert r.returncode == 1, r.stdout + r.stderr
    assert msg_type.__name__ in r.stdout
