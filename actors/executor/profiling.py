"""Profiling the executor on request: a torch.profiler trace of its next steps.

Theory of operation: the gateway's /start_profile publishes ProfileStart; the shell
(actor.py) hands it to `Profiler.start`, which starts one torch.profiler session (CPU
ops, and device kernels on a GPU; shapes and Python stacks on request) and answers
ProfileStatus "started". The session records every thread of the process (the
shell runs the model in worker threads), where this torch can: otherwise the CPU ops
of the starting thread only, while device kernels are recorded either way. It ends
after `num_steps` more step results (`step_done`, as the shell publishes each), or at
ProfileStop, whichever comes first: `stop` writes the trace in Chrome's format,
gzipped, to <output_dir>/<session id>-<actor id>.trace.json.gz (Perfetto and
chrome://tracing open it) and answers "stopped" with the path. One session at a
time: a second start is answered "busy", a stop with none running "refused".

Invariants: `start` and `stop` run off the event loop (they take the profiler's own
time, and writing a trace of many steps takes seconds); a session that cannot write
its trace says so when it stops, and the next session may start all the same.
"""

from __future__ import annotations

import os
import re

import structlog
import torch

from shunter.bus.messages import ProfileStart, ProfileStatus, ProfileStop

log = structlog.get_logger(actor="executor")

ACTIVITIES = ("CPU", "GPU")
_SAFE = re.compile(r"[^A-Za-z0-9._-]")


class Profiler:
    def __init__(self, actor_id: str, device: torch.device) -> None:
        self.actor_id = actor_id
        self.device = device
        self._prof = None  # the running torch.profiler.profile
        self._start: ProfileStart | None = None
        self._steps = 0

    @property
    def running(self) -> bool:
        return self._start is not None

    def trace_path(self, msg: ProfileStart) -> str:
        name = _SAFE.sub("_", f"{msg.request_id}-{self.actor_id}")
        return os.path.join(msg.output_dir, f"{name}.trace.json.gz")

    def handle(self, msg: ProfileStart | ProfileStop) -> ProfileStatus:
        return self.start(msg) if isinstance(msg, ProfileStart) else self.stop(msg.request_id)

    def start(self, msg: ProfileStart) -> ProfileStatus:
        def refuse(why: str, state: str = "refused") -> ProfileStatus:
            return ProfileStatus(msg.request_id, self.actor_id, False, state, why,
                                 profile_id=msg.request_id)  # fmt: skip

        if self._start is not None:
            return refuse(f"profile {self._start.request_id} is already running", "busy")
        unknown = sorted(set(msg.activities) - set(ACTIVITIES))
        if unknown:
            return refuse(f"unknown activities {unknown}; known: {list(ACTIVITIES)}")
        if msg.num_steps < 0:
            return refuse(f"num_steps must be >= 0, got {msg.num_steps}")
        try:
            os.makedirs(msg.output_dir, exist_ok=True)
        except OSError as e:
            return refuse(f"cannot create output_dir {msg.output_dir!r}: {e}")
        if not os.access(msg.output_dir, os.W_OK):
            return refuse(f"output_dir {msg.output_dir!r} is not writable")
        from torch.profiler import ProfilerActivity, profile

        wanted = set(msg.activities or ACTIVITIES)
        activities = [ProfilerActivity.CPU] if "CPU" in wanted else []
        if "GPU" in wanted and self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        if not activities:
            return refuse("nothing to record: GPU activities asked for on a CPU executor")
        prof = profile(activities=activities, record_shapes=msg.record_shapes,
                       with_stack=msg.with_stack, **_all_threads())  # fmt: skip
        prof.start()
        self._prof, self._start, self._steps = prof, msg, 0
        path = self.trace_path(msg)
        names = [a.name for a in activities]
        log.info("profile started", profile_id=msg.request_id, activities=names,
                 num_steps=msg.num_steps, trace_path=path)  # fmt: skip
        return ProfileStatus(msg.request_id, self.actor_id, True, "started",
                             f"recording {', '.join(names)}", msg.request_id, path)  # fmt: skip

    def step_done(self) -> bool:
        """Count one published step; True when the session asked for no more."""
        if self._start is None:
            return False
        self._steps += 1
        return 0 < self._start.num_steps <= self._steps

    def stop(self, request_id: str | None = None) -> ProfileStatus:
        """End the session and write its trace; `request_id` None: it ended by itself
        after its steps (the status then answers its ProfileStart)."""
        if self._start is None or self._prof is None:
            return ProfileStatus(request_id or "", self.actor_id, False, "refused",
                                 "no profile is running; start one with /start_profile")  # fmt: skip
        prof, start, steps = self._prof, self._start, self._steps
        path = self.trace_path(start)
        self._prof, self._start = None, None
        ok, message = True, f"{steps} steps recorded"
        try:
            prof.stop()
            prof.export_chrome_trace(path)
        except Exception as e:  # the session is over either way
            ok, message = False, f"the trace was not written: {type(e).__name__}: {e}"
        log.info(
            "profile stopped", profile_id=start.request_id, ok=ok, steps=steps, trace_path=path
        )
        rid = start.request_id if request_id is None else request_id
        return ProfileStatus(rid, self.actor_id, ok, "stopped", message, start.request_id,
                             path, steps)  # fmt: skip


def _all_threads() -> dict:
    """torch.profiler's option to record every thread, where this torch has it."""
    try:
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):
        return {}
    return {"experimental_config": config}
