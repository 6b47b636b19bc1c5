"""busctl: watch, record, inspect and replay the bus.

    busctl tail [-t PREFIX]... [-r REQUEST_ID]... [--json]   live stream from a broker
    busctl record DIR                                          record a live broker to DIR
    busctl dump LOG [-t ...] [-r ...] [--json]                 a recorded log, rendered
    busctl stats LOG [--json]                                  per topic / per publisher
    busctl replay LOG --actor NAME                             exit 0 identical, 1 diverged

A line is `time publisher#seq topic Type(fields)`: UTC wall time of the envelope, then
the message without the fields still at their defaults. `-r ID` keeps messages with a
field named request_id equal to ID (or to ID-<n>, the gateway's expansion of n > 1)
anywhere inside them: TextDeltas.deltas, TokensOut.outputs, Matched.request included.
Exit codes: 0 fine, 1 replay diverged, 2 bad input (a missing or corrupt log, an
unknown actor, a broker that cannot be reached).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import msgspec

from shunter.bus.log import LogCorrupt, LogDecodeError, LogReader, decode_record
from shunter.bus.messages import AnyMessage, Envelope
from shunter.bus.replay import get_core, import_registrations, replay
from shunter.ops.bus_view import Filter, Renderer, log_statistics

_envelope_decoder = msgspec.msgpack.Decoder(Envelope)
_json = msgspec.json.Encoder()


def _renderer(args: argparse.Namespace) -> Renderer:
    color = (
        not args.no_color
        and sys.stdout.isatty()
        and "NO_COLOR" not in os.environ
        and os.environ.get("TERM") != "dumb"
    ) or args.color
    max_items = None if args.max_items <= 0 else args.max_items
    return Renderer(sys.stdout, as_json=args.json, color=color, max_items=max_items)


# --- live commands (tail, record) --------------------------------------------------


def _connect(args: argparse.Namespace, role: str):
    from shunter.bus.curve import CurveClient, CurveKeys
    from shunter.bus.zmq_transport import BusEndpoints, ZmqBus, default_endpoints

    defaults = default_endpoints(args.runtime_dir)
    endpoints = BusEndpoints(args.frontend or defaults.frontend, args.backend or defaults.backend)
    curve = None
    if args.curve_keys or args.server_key:
        if not (args.curve_keys and args.server_key):
            raise ValueError("--curve-keys and --server-key go together")
        server = CurveKeys.load(args.server_key).public_key
        curve = CurveClient(CurveKeys.load(args.curve_keys), server)
    return ZmqBus(
        f"busctl.{role}.{os.getpid()}",
        endpoints,
        curve=curve,
        allow_insecure_tcp=args.allow_insecure_tcp,
    )


async def _wait_connected(waiting, bus, args: argparse.Namespace) -> None:
    import anyio

    try:
        with anyio.fail_after(args.connect_timeout_s):
            await waiting
    except TimeoutError:
        raise TimeoutError(
            f"no broker answered at {bus.endpoints.backend} within {args.connect_timeout_s} s "
            "(is it running? --frontend/--backend/--runtime-dir pick it)"
        ) from None


async def _tail(args: argparse.Namespace) -> int:
    import anyio

    renderer, flt = _renderer(args), Filter(args.topic, args.request_id)
    decoder = msgspec.msgpack.Decoder(AnyMessage)
    bus = _connect(args, "tail")
    num_shown = 0
    async with bus:
        sub = bus.subscribe_raw(*(args.topic or ()))  # the broker filters topics
        await _wait_connected(sub.wait_connected(args.connect_timeout_s), bus, args)
        print(f"busctl: tailing {bus.endpoints.backend}", file=sys.stderr, flush=True)
        with anyio.move_on_after(args.duration_s if args.duration_s > 0 else None):
            async for frames in sub:
                topic = frames.topic.decode("ascii", "replace")
                if not flt.wants_topic(topic):
                    continue
                env = _envelope_decoder.decode(frames.envelope)
                try:
                    msg, error = decoder.decode(frames.body), ""
                except (msgspec.DecodeError, msgspec.ValidationError) as e:
                    msg, error = None, str(e)
                if msg is not None and not flt.wants(msg):
                    continue
                if msg is None and flt.rids:
                    continue
                renderer.emit(renderer.line(topic, env, msg, error))
                sys.stdout.flush()
                num_shown += 1
                if args.count and num_shown >= args.count:
                    break
    return 0


async def _record(args: argparse.Namespace) -> int:
    import anyio

    from shunter.bus.log import RecorderConfig, record

    config = RecorderConfig(
        max_segment_bytes=int(args.max_segment_mb * (1 << 20)),
        max_segment_age_s=args.max_segment_age_s,
        flush_every_records=args.flush_every,
        flush_interval_ms=args.flush_ms,
        fsync=args.fsync,
    )
    bus = _connect(args, "record")
    started = anyio.Event()
    async with bus, anyio.create_task_group() as tg:
        prefixes = tuple(args.topic or ("",))
        tg.start_soon(
            lambda: record(bus, args.directory, config, prefixes=prefixes, started=started)
        )
        await _wait_connected(started.wait(), bus, args)
        print(f"busctl: recording to {args.directory}", file=sys.stderr, flush=True)
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            with anyio.move_on_after(args.duration_s if args.duration_s > 0 else None):
                async for _ in signals:
                    break
        tg.cancel_scope.cancel()
    return 0


# --- log commands (dump, stats, replay) --------------------------------------------


def _dump(args: argparse.Namespace) -> int:
    renderer, flt = _renderer(args), Filter(args.topic, args.request_id)
    reader = LogReader(args.log, skip_corrupt=args.skip_corrupt)
    for rec in reader.records():
        topic = rec.topic.decode("ascii", "replace")
        if not flt.wants_topic(topic):
            continue
        try:
            env, msg = decode_record(rec)
            error = ""
        except LogDecodeError as e:
            env, msg, error = _envelope_decoder.decode(rec.envelope), None, str(e)
            if flt.rids:
                continue
        if msg is not None and not flt.wants(msg):
            continue
        renderer.emit(renderer.line(topic, env, msg, error))
    return 0  # a torn tail was logged as a warning on stderr


def _stats(args: argparse.Namespace) -> int:
    reader = LogReader(args.log, skip_corrupt=args.skip_corrupt)
    stats = log_statistics(reader.records())
    st = reader.statistics()
    stats["log"] = msgspec.structs.asdict(st)
    if args.json:
        print(_json.encode(stats).decode())
        return 0
    print(
        f"{args.log}: {st.num_records} records in {st.num_segments} segments, "
        f"{st.num_bytes} bytes, {stats['duration_s']:.3f} s"
    )
    print(f"{'topic':<24} {'msgs':>8} {'bytes':>10} {'msgs/s':>10}")
    for name, t in sorted(stats["topics"].items()):
        rate = f"{t['msgs_per_s']:.1f}" if t["msgs_per_s"] is not None else "-"
        print(f"{name:<24} {t['count']:>8} {t['bytes']:>10} {rate:>10}")
    print(f"{'publisher':<24} {'msgs':>8} {'seq':>15} {'gaps':>5} {'lost':>6} {'restarts':>8}")
    for name, p in sorted(stats["publishers"].items()):
        seq = f"{p['first_seq']}..{p['last_seq']}"
        print(
            f"{name:<24} {p['count']:>8} {seq:>15} {p['gaps']:>5} {p['lost']:>6} {p['restarts']:>8}"
        )
    torn = f"yes, {st.num_torn_bytes} bytes at {', '.join(st.torn_segments)}" if st.torn else "no"
    print(f"torn tail: {torn}")
    if st.skipped:
        print(f"skipped corrupt: {st.num_skipped_bytes} bytes at {', '.join(st.skipped)}")
    return 0


def _replay(args: argparse.Namespace) -> int:
    for target in args.imports or ():
        import_registrations(target)
    spec = get_core(args.actor)
    result = replay(
        args.log,
        spec,
        actor_id=args.actor_id,
        allow_short_recording=args.allow_short_recording,
        run=args.run_index,
    )
    print(_json.encode(result).decode() if args.json else result.report())
    return 0 if result.identical else 1


# --- command line ------------------------------------------------------------------


def _live_options(p: argparse.ArgumentParser) -> None:
    where = "default: the broker's ipc:// endpoint under the runtime dir"
    p.add_argument("--frontend", help=f"where publishers connect ({where})")
    p.add_argument("--backend", help=f"where subscribers connect ({where})")
    p.add_argument("--runtime-dir", help="directory of the default ipc:// endpoints")
    p.add_argument("--curve-keys", help="this client's CURVE key file (*.key_secret), for tcp://")
    p.add_argument("--server-key", help="the broker's public CURVE key file (*.key)")
    p.add_argument("--allow-insecure-tcp", action="store_true", help="tcp:// without CURVE")
    p.add_argument("--connect-timeout-s", type=float, default=10.0)
    p.add_argument("--duration-s", type=float, default=0.0, help="stop after this long (0: never)")


def _view_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-t", "--topic", action="append", metavar="PREFIX", help="topic prefix (repeatable)"
    )
    p.add_argument(
        "-r", "--request-id", action="append", metavar="ID", help="request id (repeatable)"
    )
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument(
        "--no-color", action="store_true", help="no ANSI colors (default off unless a tty)"
    )
    p.add_argument("--color", action="store_true", help="ANSI colors even when not a tty")
    p.add_argument("--max-items", type=int, default=16, help="shorten longer lists (0: never)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="busctl", description=__doc__.splitlines()[0], allow_abbrev=False
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"),
                        help="structured log lines on stderr (default warning)")  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help_: str, run, is_async: bool = False) -> argparse.ArgumentParser:
        p = sub.add_parser(
            name, parents=[common], help=help_, description=help_, allow_abbrev=False
        )
        p.set_defaults(run=run, is_async=is_async)
        return p

    p = command("tail", "show the live stream of a broker", _tail, is_async=True)
    _live_options(p)
    _view_options(p)
    p.add_argument("--count", type=int, default=0, help="exit after this many lines (0: never)")

    p = command("record", "record a live broker to a log directory", _record, is_async=True)
    p.add_argument("directory")
    _live_options(p)
    p.add_argument("-t", "--topic", action="append", metavar="PREFIX", help="record only these")
    p.add_argument("--max-segment-mb", type=float, default=64.0)
    p.add_argument("--max-segment-age-s", type=float, default=3600.0)
    p.add_argument("--flush-every", type=int, default=256, help="records between flushes")
    p.add_argument("--flush-ms", type=float, default=200.0, help="flush within this many ms")
    p.add_argument("--fsync", action="store_true", help="fsync each segment when it closes")

    skip_help = "read past corruption in the middle, reporting it (default: stop, exit 2)"
    p = command("dump", "render a recorded log", _dump)
    p.add_argument("log", help="log directory or segment file")
    p.add_argument("--skip-corrupt", action="store_true", help=skip_help)
    _view_options(p)

    p = command("stats", "messages and rates per topic, gaps per publisher", _stats)
    p.add_argument("log", help="log directory or segment file")
    p.add_argument("--skip-corrupt", action="store_true", help=skip_help)
    p.add_argument("--json", action="store_true")

    p = command("replay", "replay an actor core against a log", _replay)
    p.add_argument("log", help="log directory or segment file")
    p.add_argument("--actor", required=True, help="registered core name (scheduler, cache, ...)")
    p.add_argument("--actor-id", help="the actor's publisher id, if not its name")
    p.add_argument("--run", dest="run_index", type=int, default=0,
                   help="which run of a restarted actor (0: the first)")  # fmt: skip
    p.add_argument("--import", dest="imports", action="append", metavar="MODULE_OR_FILE",
                   help="import this first for its register_core calls (repeatable)")  # fmt: skip
    p.add_argument("--allow-short-recording", action="store_true",
                   help="accept outputs produced after the recording ended")  # fmt: skip
    p.add_argument("--json", action="store_true")
    return parser


def _single(e: BaseException) -> BaseException:
    """The one error inside (nested) single-member exception groups from task groups."""
    while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
        e = e.exceptions[0]
    return e


def main(argv: list[str] | None = None) -> int:
    from shunter.ops.logging import configure

    args = build_parser().parse_args(argv)
    configure(args.log_level, "console", stream=sys.stderr)
    try:
        try:
            if args.is_async:
                import anyio

                return anyio.run(args.run, args, backend="asyncio")
            return args.run(args)
        except BaseExceptionGroup as group:
            raise _single(group) from None
    except (FileNotFoundError, LogCorrupt, LogDecodeError, KeyError, LookupError, ValueError,
            TimeoutError) as e:  # fmt: skip
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"busctl {args.command}: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `busctl dump LOG | head`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
