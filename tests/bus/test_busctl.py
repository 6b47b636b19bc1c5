"""busctl as a real subprocess against a live ZMQ broker: tail with filters, record,
dump, stats, and replay (identical, and a divergence that exits 1)."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import anyio
import pytest

from shunter.bus.broker import Broker
from shunter.bus.log import LogReader
from shunter.bus.messages import (
    BusGap,
    Matched,
    RequestOutput,
    SamplingParams,
    SchedulerStats,
    TextDelta,
    TextDeltas,
    Tick,
    Tokenized,
    TokensOut,
)
from shunter.bus.zmq_transport import BusEndpoints, ZmqBus
from shunter.ops.bus_view import Filter, log_statistics
from shunter.ops.busctl import build_parser

HERE = pathlib.Path(__file__).resolve().parent
REPLAY_TESTS = HERE / "test_replay.py"
_spec = importlib.util.spec_from_file_location("replay_tests", REPLAY_TESTS)
rt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rt)

BUSCTL = [sys.executable, "-m", "shunter.ops.busctl"]


@pytest.fixture(scope="module")
def endpoints():
    d = tempfile.mkdtemp(prefix="bc-", dir="/tmp")  # unix socket paths must stay short
    eps = BusEndpoints(f"ipc://{d}/f.sock", f"ipc://{d}/b.sock")
    with Broker(eps.frontend, eps.backend):
        yield eps
    shutil.rmtree(d, ignore_errors=True)


def spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*BUSCTL, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def wait_stderr(proc: subprocess.Popen, needle: str, timeout_s: float = 30.0) -> str:
    deadline = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        seen.append(line)
        if needle in line:
            return line
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"busctl never said {needle!r}; stderr: {''.join(seen)}")


def live(eps: BusEndpoints) -> list[str]:
    return ["--frontend", eps.frontend, "--backend", eps.backend]


def traffic() -> list:
    sp = SamplingParams()
    tok = Tokenized("req-7", [1, 2, 3], sp)
    return [
        Tick(now_ns=1),
        Matched(tok, 0, [], 0),  # req-7 nested in .request
        TokensOut(3, [RequestOutput("req-1", [5]), RequestOutput("req-7", [9])]),
        TokensOut(4, [RequestOutput("req-1", [6])]),
        TextDeltas([TextDelta("req-7-1", "hi", [9])]),  # n > 1 expansion of req-7
        SchedulerStats(4, 2, 0, 10, 100, 0.5),
        TokensOut(5, [RequestOutput("req-7", [10], finish_reason="length")]),
    ]


async def publish_all(eps: BusEndpoints, msgs: list) -> None:
    async with ZmqBus("tester", eps) as bus:
        await bus.wait_connected()
        for m in msgs:
            await bus.publish(m)
        await anyio.sleep(0.2)  # let the PUB socket drain before it closes


def test_tail_filters_by_topic_and_request_id(endpoints):
    proc = spawn("tail", *live(endpoints), "-t", "sched.", "-t", "cache.", "-r", "req-7",
                 "--count", "3", "--duration-s", "30")  # fmt: skip
    wait_stderr(proc, "busctl: tailing")
    anyio.run(publish_all, endpoints, traffic())
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    lines = out.splitlines()
    assert len(lines) == 3, out
    assert " tester#1 cache.matched Matched(request=Tokenized(request_id='req-7'" in lines[0]
    assert " tester#2 sched.tokens TokensOut(step_id=3, " in lines[1]
    assert (
        "tester#6 sched.tokens TokensOut(step_id=5, outputs=[RequestOutput(request_id='req-7'"
        in lines[2]
    )
    assert "\x1b[" not in out  # not a tty: no colors
    assert "tok.deltas" not in out  # the right request, but filtered by topic


def test_tail_json_lines_and_forced_color(endpoints):
    proc = spawn(
        "tail", *live(endpoints), "-r", "req-7", "--json", "--count", "4", "--duration-s", "30"
    )
    wait_stderr(proc, "busctl: tailing")
    anyio.run(publish_all, endpoints, traffic())
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    objs = [json.loads(line) for line in out.splitlines()]
    assert [o["topic"] for o in objs] == [
        "cache.matched",
        "sched.tokens",
        "tok.deltas",
        "sched.tokens",
    ]
    assert [o["seq"] for o in objs] == [1, 2, 4, 6]
    delta = objs[2]["msg"]["deltas"][0]
    assert set(delta) == set(TextDelta.__struct_fields__)  # named fields, not bare arrays
    assert (delta["request_id"], delta["text"], delta["token_ids"]) == ("req-7-1", "hi", [9])
    assert delta["finish_reason"] is None and delta["logprobs"] == []
    assert all(o["publisher_id"] == "tester" and o["wall_ns"] > 0 for o in objs)

    proc = spawn("tail", *live(endpoints), "-t", "sched.tick", "--color", "--count", "1")
    wait_stderr(proc, "busctl: tailing")
    anyio.run(publish_all, endpoints, traffic())
    out, _ = proc.communicate(timeout=30)
    assert "\x1b[1;35msched.tick\x1b[0m Tick(now_ns=1)" in out


def test_tail_unreachable_broker_is_a_clear_error():
    proc = spawn("tail", "--backend", "ipc:///tmp/no-such-dir-x/b.sock", "--frontend",
                 "ipc:///tmp/no-such-dir-x/f.sock", "--connect-timeout-s", "0.5")  # fmt: skip
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "busctl tail:" in err, err


@pytest.fixture(scope="module")
def recorded(endpoints, tmp_path_factory) -> pathlib.Path:
    """The accumulator core run live over ZMQ, recorded by `busctl record`."""
    directory = tmp_path_factory.mktemp("rec") / "log"
    proc = spawn("record", str(directory), *live(endpoints), "--flush-ms", "20")
    wait_stderr(proc, "busctl: recording to")
    msgs = rt.workload(30)
    num_outputs = 30 + 10

    async def scenario() -> None:
        shell_up = anyio.Event()
        async with (
            ZmqBus(rt.ACTOR, endpoints) as shell_bus,
            ZmqBus("driver", endpoints) as driver,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(rt.run_shell, shell_bus, 5, shell_up)
            await shell_up.wait()
            async with driver.subscribe("sched.tokens", "sched.stats") as outs:
                for m in msgs:
                    await driver.publish(m)
                with anyio.fail_after(20):
                    for _ in range(num_outputs):
                        await outs.receive()
            tg.cancel_scope.cancel()

    anyio.run(scenario)
    expected = len(msgs) + num_outputs + 1  # + Ready
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if directory.exists():
            n = sum(1 for r in LogReader(directory).records() if not r.topic.startswith(b"bus."))
            if n >= expected:
                break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    driver = [m for e, m in LogReader(directory).messages() if e.publisher_id == "driver"]
    assert [m for m in driver if not isinstance(m, BusGap)] == msgs
    return directory


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*BUSCTL, *args], capture_output=True, text=True, timeout=60)


def test_dump_renders_the_log_with_filters(recorded):
    res = run("dump", str(recorded), "-t", "sched.stats")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 10 and all(
        " accumulator#" in ln and " sched.stats SchedulerStats(" in ln for ln in lines
    )
    res = run("dump", str(recorded), "-r", "row3", "--json", "--max-items", "2")
    objs = [json.loads(x) for x in res.stdout.splitlines()]
    assert objs and all(o["topic"] == "sched.tokens" for o in objs)
    assert all(any(out["request_id"] == "row3" for out in o["msg"]["outputs"]) for o in objs)


def test_stats_per_topic_and_publisher(recorded):
    res = run("stats", str(recorded), "--json")
    assert res.returncode == 0, res.stderr
    stats = json.loads(res.stdout)
    assert stats["topics"]["sched.result"]["count"] == 30
    assert stats["topics"]["sched.tokens"]["count"] == 30
    assert stats["topics"]["health.ready"]["count"] == 1
    assert (
        stats["publishers"]["driver"]["gaps"] == 0
        and stats["publishers"]["driver"]["first_seq"] == 0
    )
    assert stats["log"]["torn"] is False and stats["duration_s"] > 0
    text = run("stats", str(recorded)).stdout
    assert "sched.result" in text and "torn tail: no" in text and "driver" in text


def test_stats_reports_seq_gaps_and_torn_tails():
    from shunter.bus.codec import encode
    from shunter.bus.log import LogWriter
    from shunter.bus.messages import Envelope

    with tempfile.TemporaryDirectory() as d:
        w = LogWriter(d)
        for seq in (0, 1, 2, 5, 6, 9, 0, 1):  # lost 3-4 and 7-8, then a restart
            w.append(encode(Tick(now_ns=seq), Envelope("p", seq, seq, 1_000_000_000 * seq)), 0)
        w.close()
        seg = next(pathlib.Path(d).iterdir())
        seg.write_bytes(seg.read_bytes() + b"\x01\x02")
        stats = log_statistics(LogReader(d).records())
        assert stats["publishers"]["p"] == {
            "count": 8, "first_seq": 0, "last_seq": 1, "gaps": 2, "lost": 4, "restarts": 1,
        }  # fmt: skip
        res = run("stats", d)
        assert "torn tail: yes, 2 bytes at events-000001.log@" in res.stdout
        dumped = run("dump", d)
        assert dumped.returncode == 0 and len(dumped.stdout.splitlines()) == 8
        assert "torn tail in event log" in dumped.stderr and "num_bytes=2" in dumped.stderr


def test_replay_identical_and_divergent(recorded, tmp_path):
    args = ["replay", str(recorded), "--actor", rt.ACTOR, "--import", str(REPLAY_TESTS)]
    res = run(*args)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "60 inbox, 40 recorded outbox, 40 produced: identical" in res.stdout

    def tamper(k, env, msg):
        if isinstance(msg, TokensOut) and msg.step_id == 12:
            return env, TokensOut(12, msg.outputs[1:])
        return env, msg

    rt.copy_log(recorded, tmp_path / "bad", tamper)
    res = run("replay", str(tmp_path / "bad"), "--actor", rt.ACTOR, "--import", str(REPLAY_TESTS))
    assert res.returncode == 1, res.stdout + res.stderr
    assert "FIRST DIVERGENCE at outbox index 16" in res.stdout
    assert "after inbox #24: sched.result StepResult(step_id=12" in res.stdout


def test_bad_input_exits_2(tmp_path):
    res = run("dump", str(tmp_path / "nope"))
    assert res.returncode == 2 and "no event log at" in res.stderr
    (tmp_path / "events-000001.log").write_bytes(b"not a log at all")
    res = run("stats", str(tmp_path))
    assert res.returncode == 2 and "bad magic" in res.stderr
    res = run("replay", str(tmp_path), "--actor", "nope")
    assert res.returncode == 2 and "no replayable core named 'nope'" in res.stderr


def test_help_lists_every_command():
    exe = shutil.which("busctl", path=os.path.dirname(sys.executable))
    assert exe, "the busctl console script is not installed"
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=30).stdout
    for cmd in ("tail", "record", "dump", "stats", "replay"):
        assert f"    {cmd} " in out


def test_request_id_filter_matches_nested_fields_and_expansions():
    f = Filter(None, ["req-7"])
    msgs = traffic()
    assert [f.wants(m) for m in msgs] == [False, True, True, False, True, False, True]
    assert not f.wants(TokensOut(1, [RequestOutput("req-70", [1])]))
    assert not f.wants(TokensOut(1, [RequestOutput("req-7-x", [1])]))
    assert build_parser().parse_args(["dump", "x", "-r", "a", "-r", "b"]).request_id == ["a", "b"]


def test_replay_a_real_registered_core_by_name(tmp_path):
    """`--actor cache` finds the cache manager's own registration (no --import)."""
    anyio.run(rt.record_cluster, tmp_path / "log")
    res = run("replay", str(tmp_path / "log"), "--actor", "cache")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "replay cache (publisher cache):" in res.stdout and ": identical" in res.stdout


def test_skip_corrupt_in_dump_and_stats(tmp_path):
    from shunter.bus.codec import encode
    from shunter.bus.log import LogWriter
    from shunter.bus.messages import Envelope

    w = LogWriter(tmp_path)
    for seq in range(5):
        w.append(encode(Tick(now_ns=seq), Envelope("p", seq, seq, seq)), 0)
    w.close()
    seg = next(tmp_path.iterdir())
    offsets = [r.offset for r in LogReader(tmp_path).records()]
    data = bytearray(seg.read_bytes())
    data[offsets[2] + 9] ^= 0xFF
    seg.write_bytes(bytes(data))
    res = run("dump", str(tmp_path))
    assert res.returncode == 2 and f"corrupt record at offset {offsets[2]}" in res.stderr
    res = run("dump", str(tmp_path), "--skip-corrupt")
    assert res.returncode == 0 and len(res.stdout.splitlines()) == 4
    assert "skipped corrupt bytes in event log" in res.stderr
    res = run("stats", str(tmp_path), "--skip-corrupt")
    assert (
        f"skipped corrupt: {offsets[3] - offsets[2]} bytes at {seg.name}@{offsets[2]}" in res.stdout
    )
    stats = json.loads(run("stats", str(tmp_path), "--skip-corrupt", "--json").stdout)
    assert (stats["publishers"]["p"]["gaps"], stats["publishers"]["p"]["lost"]) == (1, 1)
    assert stats["log"]["skipped"] == [f"{seg.name}@{offsets[2]}"]


def test_tail_over_curve_tcp(tmp_path):
    from shunter.bus.curve import CurveClient, CurveKeys, CurveServer

    server, client = CurveKeys.generate(), CurveKeys.generate()
    server_secret = server.save(tmp_path / "keys", "broker")
    client_secret = client.save(tmp_path / "keys", "busctl")
    curve = CurveServer(server, allowed_clients=(client.public_key,))
    with Broker("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", curve=curve) as broker:
        eps = broker.endpoints
        keys = [
            "--curve-keys",
            str(client_secret),
            "--server-key",
            str(server_secret.with_suffix(".key")),
        ]
        proc = spawn("tail", *live(eps), *keys, "--count", "1", "--duration-s", "30")
        wait_stderr(proc, "busctl: tailing")

        async def publish() -> None:
            async with ZmqBus("keyed", eps, curve=CurveClient(client, server.public_key)) as bus:
                await bus.wait_connected()
                await bus.publish(Tick(now_ns=42))
                await anyio.sleep(0.2)

        anyio.run(publish)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0 and "keyed#0 sched.tick Tick(now_ns=42)" in out, err
        # without keys, tcp:// is refused outright
        res = run("tail", *live(eps), "--connect-timeout-s", "1")
        assert res.returncode == 2 and "refusing unauthenticated TCP" in res.stderr
