"""Logging setup: JSON lines that parse, console lines for people, level filtering."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys

import pytest
import structlog

from shunter.ops import logging as shunter_logging


@pytest.fixture(autouse=True)
def _restore_structlog():
    yield
    structlog.reset_defaults()
    logging.getLogger().handlers.clear()


def test_json_lines_carry_level_event_and_bound_fields():
    out = io.StringIO()
    shunter_logging.configure("info", "json", stream=out)
    log = structlog.get_logger().bind(actor="scheduler")
    log.debug("hidden")
    log.info("step", request_id="r1", num_running=3)
    log.warning("slow", step_ms=12.5)
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [x["event"] for x in lines] == ["step", "slow"]
    assert lines[0]["actor"] == "scheduler" and lines[0]["request_id"] == "r1"
    assert lines[0]["level"] == "info" and lines[0]["timestamp"].endswith("Z")
    logging.getLogger("aiohttp.access").info("stdlib line")
    assert "stdlib line" in out.getvalue()


def test_console_format_and_level_filter():
    out = io.StringIO()
    shunter_logging.configure("warning", "console", stream=out)
    structlog.get_logger().info("quiet")
    structlog.get_logger().error("loud", code=7)
    text = out.getvalue()
    assert "quiet" not in text and "loud" in text and "code=7" in text
    with pytest.raises(ValueError):
        json.loads(text.splitlines()[0])


def test_auto_is_json_when_not_a_terminal_and_bad_values_are_refused():
    out = io.StringIO()
    shunter_logging.configure("info", "auto", stream=out)
    structlog.get_logger().info("x")
    assert json.loads(out.getvalue())["event"] == "x"
    with pytest.raises(ValueError, match="log level 'loud'"):
        shunter_logging.configure("loud")
    with pytest.raises(ValueError, match="log format 'xml'"):
        shunter_logging.configure("info", "xml")


_WRITER = """
import os, sys, structlog
from shunter.ops import logging as shunter_logging
shunter_logging.configure("info", "json")
log = structlog.get_logger().bind(actor=sys.argv[1])
for i in range(int(sys.argv[2])):
    log.info("line", i=i, pad="x" * 150)
"""


def test_processes_sharing_unbuffered_stderr_never_split_a_line(tmp_path):
    """Actor processes inherit the server's stderr; with PYTHONUNBUFFERED each line must
    still reach it in one write, or another process's line lands inside it."""
    n = 3000
    path = tmp_path / "shared.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(path, "wb") as f:
        procs = [
            subprocess.Popen([sys.executable, "-c", _WRITER, name, str(n)],
                             stderr=f, stdout=subprocess.DEVNULL, env=env)
            for name in ("a", "b", "c")
        ]  # fmt: skip
        assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    lines = path.read_text().splitlines()
    parsed = [json.loads(x) for x in lines]  # a split or joined line fails to parse
    assert sorted((x["actor"], x["i"]) for x in parsed) == sorted(
        (a, i) for a in "abc" for i in range(n)
    )
