"""The executor's profiler (actors/executor/profiling.py) on the CPU: one session at a
time, ended by a stop or after its steps, its trace a gzipped Chrome trace holding the
ops of the threads that ran them; every refusal says why."""

from __future__ import annotations

import gzip
import json
import threading

import pytest
import torch

from shunter.actors.executor.profiling import Profiler
from shunter.bus.messages import ProfileStart


def _ops(path) -> set[str]:
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    return {e.get("name", "") for e in events if e.get("name", "").startswith("aten::")}


def _work() -> None:
    a = torch.randn(32, 32)
    (a @ a).relu_()


def test_a_session_records_ops_of_other_threads_and_writes_its_trace(tmp_path):
    prof = Profiler("executor.0", torch.device("cpu"))
    started = prof.start(ProfileStart("prof-1", str(tmp_path / "traces"), record_shapes=True))
    assert started.ok and started.state == "started" and prof.running
    assert started.trace_path == str(tmp_path / "traces" / "prof-1-executor.0.trace.json.gz")
    busy = prof.start(ProfileStart("prof-2", str(tmp_path)))
    assert (busy.ok, busy.state, busy.request_id) == (False, "busy", "prof-2")
    assert "prof-1" in busy.message
    t = threading.Thread(target=_work)  # the shell runs the model in worker threads
    t.start()
    t.join()
    assert not prof.step_done()  # no step count asked for: only a stop ends it
    stopped = prof.stop("stop-1")
    assert (stopped.ok, stopped.state, stopped.request_id, stopped.profile_id) == (
        True, "stopped", "stop-1", "prof-1")  # fmt: skip
    assert stopped.num_steps == 1 and not prof.running
    assert {"aten::mm", "aten::relu_"} <= _ops(stopped.trace_path)
    again = prof.stop("stop-2")
    assert (again.ok, again.state) == (False, "refused") and "no profile" in again.message


def test_a_session_of_n_steps_asks_to_end_after_the_nth(tmp_path):
    prof = Profiler("executor.0", torch.device("cpu"))
    assert prof.start(ProfileStart("prof-n", str(tmp_path), num_steps=3, activities=["CPU"])).ok
    _work()
    assert [prof.step_done() for _ in range(3)] == [False, False, True]
    done = prof.stop()  # as the shell ends it: answering the start
    assert (done.ok, done.request_id, done.num_steps) == (True, "prof-n", 3)
    assert "aten::mm" in _ops(done.trace_path)
    assert not prof.step_done()  # nothing runs any more


def test_refusals_say_why_and_leave_nothing_running(tmp_path):
    prof = Profiler("executor.0", torch.device("cpu"))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cases = [
        (ProfileStart("p", str(tmp_path), activities=["MEM"]), "unknown activities"),
        (ProfileStart("p", str(tmp_path), activities=["GPU"]), "on a CPU executor"),
        (ProfileStart("p", str(tmp_path), num_steps=-1), "num_steps"),
        (ProfileStart("p", str(blocker / "sub")), "cannot create output_dir"),
    ]
    for msg, why in cases:
        got = prof.start(msg)
        assert (got.ok, got.state) == (False, "refused") and why in got.message, got
        assert not prof.running
    assert prof.start(ProfileStart("p", str(tmp_path))).ok  # and a good one still starts
    assert prof.stop().ok


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_session_on_a_gpu_records_its_kernels(tmp_path):
    prof = Profiler("executor.0", torch.device("cuda"))
    assert prof.start(ProfileStart("prof-gpu", str(tmp_path))).ok

    def work() -> None:
        a = torch.randn(256, 256, device="cuda")
        (a @ a).relu_()
        torch.cuda.synchronize()

    t = threading.Thread(target=work)
    t.start()
    t.join()
    done = prof.stop("stop")
    assert done.ok, done
    with gzip.open(done.trace_path) as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)  # device kernels: any thread's
