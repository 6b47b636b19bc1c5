"""Profiling on request: the gateway asks the executor for a torch.profiler trace of
its next steps (/start_profile, /stop_profile), and the executor says what it did."""

from __future__ import annotations

from shunter.bus.messages.base import Msg


class ProfileStart(Msg, tag="prof.start"):
    """Start recording. Answered by ProfileStatus (state "started", or ok false)."""

    request_id: str  # this request's id; also the session's (the trace file's name)
    output_dir: str
    num_steps: int = 0  # end by itself after this many steps; 0: at ProfileStop
    activities: list[str] = []  # "CPU", "GPU" (device kernels); empty: both
    record_shapes: bool = False
    with_stack: bool = False


class ProfileStop(Msg, tag="prof.stop"):
    """End the running session and write its trace. Answered by ProfileStatus."""

    request_id: str


class ProfileStatus(Msg, tag="prof.status"):
    """A session started, ended (its trace written) or a start/stop refused."""

    request_id: str  # the ProfileStart/ProfileStop answered; a session that ended by
    # itself after num_steps answers its ProfileStart a second time
    actor_id: str
    ok: bool
    state: str  # "started" | "stopped" | "refused" | "busy" (another session runs)
    message: str = ""
    profile_id: str = ""  # the session's (its ProfileStart's request_id)
    trace_path: str = ""  # where the trace is (to be) written
    num_steps: int = 0  # steps recorded, once stopped
