"""The real server process on loopback, shared by the end-to-end tests.

`python -m shunter serve` runs as a subprocess with the default model, a small KV pool,
and the bus recorder on (so tests can check what the engine did, e.g. the KV census).
Its log goes to a file whose tail is shown whenever the server fails to start or a
test needs to explain itself. The shared server is session-scoped: the model loads
once per deployment; tests that end a server (SIGTERM, kill) start their own.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

START_TIMEOUT_S = float(os.environ.get("SHUNTER_E2E_START_TIMEOUT_S", "400"))
MODES = ["embedded", pytest.param("multi-process", marks=pytest.mark.heavy)]
BASE_ARGS = ["--log-format", "json", "--shutdown-timeout", "20", "--enable-metrics"]
# Given through --config, so the file path is exercised end to end (keys in both spellings).
CONFIG_FILE = "max-total-tokens: 32768\nheartbeat_interval: 0.5\nwatchdog-timeout: 60\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `shunter serve` process."""

    def __init__(self, workdir: pathlib.Path, mode: str, *extra: str) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.mode = mode
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.events_dir = workdir / "events"
        self.log_path = workdir / "server.log"
        config = workdir / "serve.yaml"
        config.write_text(CONFIG_FILE)
        argv = [sys.executable, "-m", "shunter", "serve", "--port", str(self.port),
                "--record-events", str(self.events_dir), "--config", str(config),
                *BASE_ARGS, *extra]  # fmt: skip
        if mode == "multi-process":
            argv.append("--multi-process")
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)  # fmt: skip

    def log_tail(self, num_lines: int = 40) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-num_lines:])

    def log_events(self) -> list[dict]:
        """The server's JSON log lines (actor processes included). Progress bars share
        the stream and may precede a line without a newline, so parsing starts at '{'."""
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                obj = json.loads(line[line.find("{") :])
                if isinstance(obj, dict):
                    out.append(obj)
        return out

    def get(self, path: str, timeout_s: float = 10.0) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.base_url + path, timeout=timeout_s) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"server exited with {self.proc.returncode} while starting:\n{self.log_tail()}"
                )
            with contextlib.suppress(OSError):
                if self.get("/health", timeout_s=5.0)[0] == 200:
                    return
            time.sleep(0.25)
        self.stop(signal.SIGKILL)
        raise AssertionError(f"server not ready after {timeout_s} s:\n{self.log_tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@contextlib.contextmanager
def running_server(workdir: pathlib.Path, mode: str, *extra: str):
    server = Server(workdir, mode, *extra)
    try:
        try:
            server.wait_ready()
        except AssertionError:
            # free_port() closes the port before the server binds it: another process
            # may take it meanwhile. Only that is retried (once, on a new port).
            if "address already in use" not in server.log_tail(400).lower():
                raise
            server = Server(workdir / "retry", mode, *extra)
            server.wait_ready()
        yield server
    finally:
        server.stop()


class AttachedServer(Server):
    """A server someone else started (SHUNTER_E2E_ATTACH=port:events_dir:log_path), for
    running the shared-server tests against a long-lived or remote-device process."""

    def __init__(self, spec: str) -> None:
        port, events_dir, log_path = spec.split(":")
        self.mode = "attached"
        self.port = int(port)
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.events_dir = pathlib.Path(events_dir)
        self.log_path = pathlib.Path(log_path)


@pytest.fixture(scope="session", params=MODES)
def server(request, tmp_path_factory):
    """A shared server per deployment mode; tests must leave it serving."""
    attach = os.environ.get("SHUNTER_E2E_ATTACH")
    if attach:
        yield AttachedServer(attach)
        return
    with running_server(tmp_path_factory.mktemp(f"server-{request.param}"), request.param) as s:
        yield s
    assert s.proc.returncode == 0, f"server exit {s.proc.returncode}:\n{s.log_tail()}"
    # Everything the session did replays: the scheduler's and the cache manager's
    # decisions come back identical from their recorded inboxes. The log ends where
    # SIGTERM stopped the recorder, which can be after an actor's last input (its own
    # tick) reached it and before that input's outputs did: those trailing outputs
    # alone may be missing (every recorded one must still match, in order).
    for actor in ("scheduler", "cache"):
        r = subprocess.run(
            [sys.executable, "-m", "shunter.ops.busctl", "replay", str(s.events_dir),
             "--actor", actor, "--allow-short-recording"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert r.returncode == 0 and "identical" in r.stdout, r.stdout + r.stderr


@pytest.fixture(params=MODES)
def mode(request):
    """A deployment mode, for tests that start their own server."""
    return request.param


@pytest.fixture
def start_server():
    """`with start_server(workdir, mode, *extra_args) as server:` a server of one's own."""
    return running_server


@pytest.fixture(scope="session")
def reference():
    """HF transformers' greedy outputs on the default model (tests/data/)."""
    return json.loads(
        (pathlib.Path(__file__).parents[1] / "data" / "smollm2_greedy_reference.json").read_text()
    )


def call_json(server, path: str, body=None, method: str = "POST") -> tuple[int, dict]:
    """One JSON request to `server`: (status, decoded body), error statuses included."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(server.base_url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture
def call():
    """`call(server, path, body=None, method="POST")`: `call_json`."""
    return call_json
