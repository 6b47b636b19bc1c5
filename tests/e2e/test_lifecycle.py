"""End to end: what happens to requests when the server is told to stop (SIGTERM drain)
or loses an actor (a killed process under --multi-process). Each test owns its server."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest


def _stream_generate(server, body: dict, on_first=None, timeout_s=300.0) -> list[dict]:
    """POST /generate with stream=True; returns every `data:` payload ([DONE] excluded)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout_s)
    conn.request("POST", "/generate", json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json"})  # fmt: skip
    resp = conn.getresponse()
    if resp.status != 200:
        return [{"status": resp.status, "body": resp.read().decode()}]
    payloads: list[dict] = []
    buf = b""
    while True:
        chunk = resp.read1(65536)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            data = event.decode().removeprefix("data: ")
            if data == "[DONE]":
                conn.close()
                return payloads
            payloads.append(json.loads(data))
            if len(payloads) == 1 and on_first is not None:
                on_first()
    conn.close()
    return payloads


def _post_status(server, path: str, body: dict) -> int | str:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        status = conn.getresponse().status
        conn.close()
        return status
    except OSError as e:  # the port may already be closed: also a refusal
        return type(e).__name__


LONG = {"text": "Count slowly from one to one hundred:",
        "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}  # fmt: skip


@pytest.mark.heavy
def test_sigterm_drains_in_flight_requests_then_exits_0(tmp_path, mode, start_server):
    with start_server(tmp_path / "srv", mode, "--shutdown-timeout", "300") as server:
        started = threading.Event()
        result: dict = {}

        def client():
            result["payloads"] = _stream_generate(server, LONG, on_first=started.set)

        t = threading.Thread(target=client)
        t.start()
        assert started.wait(120), server.log_tail()
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        refused = _post_status(
            server, "/generate", {"text": "late", "sampling_params": {"max_new_tokens": 2}}
        )
        assert refused in (503, "ConnectionRefusedError", "RemoteDisconnected"), refused
        t.join(300)
        assert server.proc.wait(60) == 0, server.log_tail()
        exits = [e for e in server.log_events() if e.get("event") == "supervisor exit"]
        assert exits[-1]["reason"] == "drained: no request in flight"
    last = result["payloads"][-1]
    assert last["meta_info"]["finish_reason"]["type"] == "length", last  # finished, not cut
    assert len(last["output_ids"]) == 16
    # The recording of the whole run replays: the cache manager's decisions reproduce.
    replay = subprocess.run(
        [sys.executable, "-m", "shunter.ops.busctl", "replay", str(server.events_dir),
         "--actor", "cache"], capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert "identical" in replay.stdout


def _actor_pids(server) -> dict[str, int]:
    return {
        e["actor"]: e["pid"]
        for e in server.log_events()
        if e.get("event") == "actor process started"
    }


@pytest.mark.heavy
def test_killed_actor_process_fails_requests_cleanly_and_reports_unhealthy(tmp_path, start_server):
    with start_server(tmp_path / "srv", "multi-process") as server:
        pids = _actor_pids(server)
        assert set(pids) == {"executor.0", "tokenizer", "cache", "scheduler", "gateway"}
        assert len(set(pids.values())) == 5 and server.proc.pid not in pids.values()
        started = threading.Event()
        result: dict = {}

        def client():
            body = {**LONG, "sampling_params": {**LONG["sampling_params"], "max_new_tokens": 2000}}
            result["payloads"] = _stream_generate(server, body, on_first=started.set, timeout_s=60)

        t = threading.Thread(target=client)
        t.start()
        assert started.wait(120), server.log_tail()
        os.kill(pids["executor.0"], signal.SIGKILL)
        t.join(60)
        assert not t.is_alive(), "the in-flight request hung after its executor died"
        last = result["payloads"][-1]
        assert "error" in last and "executor.0" in json.dumps(last["error"]), (
            f"{last}\n{server.log_tail()}"
        )
        status, body = server.get("/health")
        assert status == 503, body
        status, body = server.get("/health_generate")
        assert status == 503
        t0 = time.monotonic()
        new = _post_status(
            server, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
        )
        assert new == 503 and time.monotonic() - t0 < 10, new  # refused at once, not hung
        assert server.proc.poll() is None  # the server stays up and says what is wrong
        died = [
            e
            for e in server.log_events()
            if e.get("event") == "health" and e.get("state") == "unhealthy"
        ]
        assert died and "executor.0 stopped: killed by SIGKILL" in died[0]["reason"], (
            server.log_tail()
        )
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0, server.log_tail()
