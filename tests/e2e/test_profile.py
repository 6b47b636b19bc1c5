"""/start_profile and /stop_profile against the real server: a trace of the executor's
steps, ended by a stop or after the steps asked for, and every misuse answered with
a 4xx that says why (the server goes on serving)."""

from __future__ import annotations

import gzip
import json
import pathlib
import time

import pytest


def generate(call, server, n=4):
    status, out = call(server, "/generate", {
        "text": "Profile me", "sampling_params": {"max_new_tokens": n, "temperature": 0}})  # fmt: skip
    assert status == 200 and out["meta_info"]["completion_tokens"] == n, out


def trace_ops(path: str) -> set[str]:
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    return {e.get("name", "") for e in events}


@pytest.fixture
def local(server):
    if server.mode == "attached":
        pytest.skip("the trace is written where the attached server runs")
    return server


def test_a_profile_of_n_steps_ends_by_itself(local, call, tmp_path):
    status, out = call(local, "/start_profile", {"output_dir": str(tmp_path), "num_steps": 2,
                                                 "record_shapes": True})  # fmt: skip
    assert status == 200 and out["success"] and out["message"] == "Start profiling.", out
    path = pathlib.Path(out["trace_path"])
    assert path.parent == tmp_path and out["profile_id"] in path.name
    status, busy = call(local, "/start_profile", {"output_dir": str(tmp_path)})
    assert status == 409 and "already running" in busy["error"]["message"], busy
    generate(call, local)  # five steps: a prefill and four decodes
    deadline, ops = time.monotonic() + 60, set()
    while not ops and time.monotonic() < deadline:  # until the whole file is there
        try:
            ops = trace_ops(str(path))
        except (OSError, EOFError, ValueError):
            time.sleep(0.1)
    assert "aten::mm" in ops or "aten::addmm" in ops, sorted(ops)[:20]
    status, none = call(local, "/stop_profile")  # it already ended
    assert status == 400 and "no profile" in none["error"]["message"], none


def test_a_profile_runs_until_stopped(local, call, tmp_path):
    status, out = call(local, "/start_profile", {"output_dir": str(tmp_path)}, method="POST")
    assert status == 200, out
    generate(call, local, 3)
    status, done = call(local, "/stop_profile", method="GET")
    assert status == 200 and done["success"] and done["num_steps"] >= 2, done
    assert done["profile_id"] == out["profile_id"] and done["trace_path"] == out["trace_path"]
    assert any(name.startswith("aten::") for name in trace_ops(done["trace_path"]))
    generate(call, local, 2)  # and the server serves on


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"activities": ["MEM"]}, "activities"),
        ({"activities": []}, "activities"),
        ({"num_steps": 0}, "num_steps"),
        ({"start_step": 3}, "start_step"),
        ({"profile_by_stage": True}, "profile_by_stage"),
        ({"num_steps": "two"}, "num_steps"),
        ({"output_dir": ""}, "output_dir"),
    ],
)  # fmt: skip
def test_bad_profile_requests_are_400(server, call, body, fragment):
    status, out = call(server, "/start_profile", body)
    assert status == 400 and fragment in json.dumps(out["error"]), out
