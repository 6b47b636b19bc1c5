"""`busctl tail` watches a running server: the embedded deployment's bus tap and the
multi-process broker both serve it from --bus-dir (default <tmp>/shunter-<uid>/<port>)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request


def test_busctl_tail_sees_a_request_go_through_the_engine(server):
    if server.mode == "attached":
        return
    bus_dir = os.path.join(tempfile.gettempdir(), f"shunter-{os.getuid()}", str(server.port))
    rid = f"tail-{time.monotonic_ns()}"
    tail = subprocess.Popen(
        [sys.executable, "-m", "shunter.ops.busctl", "tail", "--runtime-dir", bus_dir,
         "-r", rid, "--json", "--duration-s", "120"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        time.sleep(3.0)  # let tail connect and pass its probe barrier
        body = json.dumps({"text": "Hi", "rid": rid,
                           "sampling_params": {"max_new_tokens": 3, "temperature": 0}})  # fmt: skip
        req = urllib.request.Request(server.base_url + "/generate", data=body.encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=300) as r:
            assert r.status == 200
        seen: list[str] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "sched.tokens" not in seen:
            line = tail.stdout.readline()
            if not line:
                break
            seen.append(json.loads(line)["topic"])
    finally:
        tail.terminate()
        tail.wait(timeout=30)
    # the request's life on the bus, in order of its first appearance
    for topic in ("req.generate", "tok.tokenized", "cache.matched", "sched.batch", "sched.tokens"):
        assert topic in seen, (topic, seen, tail.stderr.read() if tail.stderr else "")
