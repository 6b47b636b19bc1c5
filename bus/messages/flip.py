"""Flip cutover: a coordinated change of what the engine serves while it runs
(new weights, released/resumed memory, a new KV layout). Each step is an event."""

from __future__ import annotations

from shunter.bus.messages.base import Msg


class FlipBegin(Msg, tag="flip.begin"):
    flip_id: str
    kind: str  # "update_weights", "release_memory", "resume_memory", "kv_layout"
    params: dict[str, str] = {}  # e.g. {"model_path": ...}
    retract: bool = False  # retract running requests instead of draining them


class AdmissionPaused(Msg, tag="flip.paused"):
    flip_id: str
    num_running: int
    num_waiting: int


class FlipCutover(Msg, tag="flip.cutover"):
    """Reconfiguration done; batches from now on carry this version."""

    flip_id: str
    version: int


class FlipDone(Msg, tag="flip.done"):
    flip_id: str
    version: int
    ok: bool
    message: str = ""


class FlipQuiesced(Msg, tag="flip.quiesced"):
    """Scheduler: while this flip holds admission, nothing runs and no batch is in
    flight any more (its running requests finished, or were retracted). Sent once."""

    flip_id: str
    num_waiting: int


class UpdateWeights(Msg, tag="flip.weights"):
    """To the executor, once quiesced: load this checkpoint (same architecture and
    shapes) into the live weights. Answered by WeightsUpdated."""

    flip_id: str
    model_path: str
    load_format: str = "auto"


class WeightsUpdated(Msg, tag="flip.weights.done"):
    flip_id: str
    ok: bool
    message: str = ""  # why it failed (the old weights are still served), or what loaded


class ReleaseMemory(Msg, tag="flip.release"):
    """To the executor, once quiesced: give up the device memory of `tags` ("weights":
    kept on the host meanwhile; "kv_cache": its contents are lost). Answered by
    MemoryState."""

    flip_id: str
    tags: list[str]


class ResumeMemory(Msg, tag="flip.resume"):
    """To the executor: take back the memory of `tags` (weights as they were; an empty
    KV cache). Answered by MemoryState."""

    flip_id: str
    tags: list[str]


class MemoryState(Msg, tag="flip.memory"):
    flip_id: str
    ok: bool
    released: list[str]  # what is released now
    message: str = ""  # what was freed or taken back, or why not


class WeightsQuery(Msg, tag="flip.weights.query"):
    """Gateway to executor (/get_weights_by_name): the first `truncate_size` rows of the
    tensor HF's checkpoint name `name` loads into. Answered by WeightsSlice."""

    query_id: str
    name: str
    truncate_size: int = 100


class WeightsSlice(Msg, tag="flip.weights.slice"):
    query_id: str
    values: list[float] = []  # the rows, flattened, as float32
    shape: list[int] = []  # of the rows returned
    error: str = ""  # non-empty: no such tensor, or it cannot be read now
