"""Structured logging for every shunter process: structlog, console or JSON lines.

`configure(level, fmt)` is called once per process (the server's main process and each
actor process under --multi-process) before anything logs. Console lines are for a
person at a terminal; JSON lines (one object per line: timestamp, level, event, and
the bound fields such as actor and request_id) are for log collectors, and are the
default when stderr is not a terminal. Standard-library logging (aiohttp, asyncio) is
routed to the same level and stream.
"""

from __future__ import annotations

import logging
import sys

import structlog

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "error": logging.ERROR, "critical": logging.CRITICAL}  # fmt: skip


def configure(level: str = "info", fmt: str = "auto", *, stream=None) -> None:
    """Set up structlog (and stdlib logging) for this process."""
    if level not in LEVELS:
        raise ValueError(f"log level {level!r}: must be one of {', '.join(LEVELS)}")
    if fmt not in ("auto", "console", "json"):
        raise ValueError(f"log format {fmt!r}: must be auto, console or json")
    stream = stream if stream is not None else sys.stderr
    if fmt == "auto":
        fmt = "console" if getattr(stream, "isatty", lambda: False)() else "json"
    renderer = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(
            colors=getattr(stream, "isatty", lambda: False)(),
            exception_formatter=structlog.dev.plain_traceback,
        )
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        # One write per line (message and newline together): actor processes share the
        # server's stderr, and under PYTHONUNBUFFERED print()'s two writes let another
        # process's line land between a message and its newline.
        logger_factory=structlog.WriteLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(LEVELS[level])
