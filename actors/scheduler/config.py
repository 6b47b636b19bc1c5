"""Scheduler configuration: one frozen Struct, validated on construction.

`SchedulerConfig` is data: the shell receives it, publishes it once as
`SchedulerConfigured` (so a recorded log can rebuild the core for replay), and the core
reads nothing else. `from_server_args` maps `shunter serve`'s options (SGLang's names)
onto it; both spellings of the prefill budget, `--max-prefill-tokens` and
`--max-prefill-num-token`, land in the one field `max_prefill_tokens`.
"""

from __future__ import annotations

from typing import Any

import msgspec

SCHEDULE_POLICIES = ("fcfs", "lpm", "priority", "lof", "random")
RETRACTION_POLICIES = ("length", "priority")


INIT_NEW_TOKEN_RATIO = 0.7  # SGLang's defaults
MIN_NEW_TOKEN_RATIO = 0.1


class SchedulerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything the scheduler core decides with. Defaults follow SGLang where it has one."""

    max_running_requests: int = 256
    """Upper bound on requests holding a row (prefilling or decoding) at once."""
    max_queued_requests: int | None = None
    """Most new requests waiting for admission; one more fails at once with 503 (SGLang's
    --max-queued-requests: shed load rather than queue without end). None: no bound."""
    max_prefill_tokens: int = 16384
    """Token budget of the new (prefill/extend) work admitted in one step. The first
    request of a step is admitted even when it alone exceeds it."""
    chunked_prefill_size: int = 8192
    """Longest prefill piece one request computes in a step; -1 turns chunking off."""
    schedule_policy: str = "fcfs"
    """Waiting-queue order: fcfs, lpm, priority, lof, random."""
    page_size: int = 1
    """Tokens per KV page (must match the cache manager and the executor)."""
    max_context_len: int = 8192
    """Most tokens (prompt + output) one sequence may hold."""
    num_total_pages: int = 0
    """Size of the KV pool in pages, for statistics only (0: unknown)."""
    eos_token_ids: tuple[int, ...] = ()
    """The model's end-of-sequence ids: always stop tokens unless ignore_eos."""

    init_new_token_ratio: float = INIT_NEW_TOKEN_RATIO
    """Share of each running request's remaining max_new_tokens reserved before
    admitting more (SGLang's init_new_token_ratio), also the value after a retraction."""
    min_new_token_ratio: float = MIN_NEW_TOKEN_RATIO
    """Floor the reserve ratio decays to."""
    new_token_ratio_decay_steps: int = 600
    """Steps to decay from init to min after the last retraction."""
    retract_decode_steps: int = 20
    """After a retraction, reserve at least this many more tokens per running request."""
    max_reserve_tokens_per_request: int = 4096
    """Clip of one request's remaining max_new_tokens in the reserve (SGLang's 4096)."""

    lease_lookahead_steps: int = 4
    """Lease ahead enough pages for this many decode steps of the running batch."""
    lease_min_pages: int = 16
    """Smallest lease request (fewer, larger round trips)."""
    lease_max_surplus_pages: int = 256
    """Unused leased pages beyond what is wanted are returned above this surplus."""

    priority_aging_per_s: float = 1.0
    """Priority points a waiting request gains per second of waiting (policy priority).
    Bound: a request is never overtaken by one that arrived more than
    (p_other - p_self) / priority_aging_per_s seconds after it."""
    lpm_max_queue: int = 128
    """lpm sorts by cached prefix only while the queue is at most this long; fcfs beyond."""
    seed: int = 0
    """Seed of the random policy and of per-request seeds the request did not set."""
    max_batches_in_flight: int = 1
    """1: plan a step when the previous result is in. 2: overlap: plan step N+1 as soon
    as step N is sent (decodes feed LAST_SAMPLED), so the executor never waits for the
    scheduler; a request found finished in result N wastes its entry in N+1."""
    refresh_stale_matches: bool = True
    """Re-match a waiting request before admission when the tree grew since its match."""
    in_batch_prefix_sharing: bool = False
    """Requests that arrive together with a shared prefix compute it once (SGLang's
    in-batch prefix caching): a waiting request whose prompt shares at least
    in_batch_prefix_min_tokens uncached tokens (whole pages) with a request that is
    still prefilling, or admitted in the same step, waits; every finished prompt's full
    pages go to the tree as its prefill ends, so the waiting one re-matches them.
    Off in the Struct so logs recorded before it existed replay unchanged;
    `from_server_args` turns it on with the radix cache."""
    in_batch_prefix_min_tokens: int = 32
    """Shortest shared uncached prefix that defers a request (see above)."""
    max_tombstones: int = 4096
    """Recently aborted unknown request ids remembered (an abort that overtook its Matched)."""
    prefill_max_requests: int | None = None
    """Most requests with prefill work in one step (a chunked prefill that continues
    counts); None: bounded by the token budgets only (SGLang's --prefill-max-requests)."""
    retraction_policy: str = "length"
    """Which running requests KV pressure retracts first: "length", fewest output tokens
    then the longest prompt (the least decoding lost); "priority", lowest priority
    first, then as "length"."""
    decode_log_interval: int = 0
    """The shell logs the decode batch every this many steps (0: never); the core does
    not read it."""
    priority_preemption_threshold: int | None = None
    """With the priority policy: a waiting request that finds no free slot retracts the
    lowest-priority running request when its priority is higher by at least this much
    (SGLang's --priority-scheduling-preemption-threshold). None: no preemption."""

    def __post_init__(self) -> None:
        for name in ("max_running_requests", "max_prefill_tokens", "page_size",
                     "max_context_len", "new_token_ratio_decay_steps", "lease_min_pages",
                     "lpm_max_queue", "lease_lookahead_steps", "in_batch_prefix_min_tokens"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests: must be >= 1, got {self.max_queued_requests}")
        for name in ("num_total_pages", "retract_decode_steps", "lease_max_surplus_pages",
                     "max_tombstones"):  # fmt: skip
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.max_reserve_tokens_per_request < 1:
            raise ValueError("max_reserve_tokens_per_request: must be >= 1")
        if self.chunked_prefill_size != -1 and self.chunked_prefill_size < 1:
            raise ValueError(
                f"chunked_prefill_size: must be >= 1, or -1 to disable chunking, "
                f"got {self.chunked_prefill_size}"
            )
        if self.chunked_prefill_size != -1 and self.chunked_prefill_size % self.page_size:
            raise ValueError(
                f"chunked_prefill_size ({self.chunked_prefill_size}) must be a multiple "
                f"of page_size ({self.page_size}) so that chunks end on page boundaries"
            )
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"schedule_policy: {self.schedule_policy!r} is not one of {SCHEDULE_POLICIES}"
            )
        if not 0.0 <= self.min_new_token_ratio <= self.init_new_token_ratio <= 1.0:
            raise ValueError(
                "new token ratios: need 0 <= min_new_token_ratio <= init_new_token_ratio <= 1"
            )
        if self.max_batches_in_flight not in (1, 2):
            raise ValueError(
                f"max_batches_in_flight: must be 1 or 2, got {self.max_batches_in_flight}"
            )
        if self.priority_aging_per_s < 0:
            raise ValueError("priority_aging_per_s: must be >= 0")
        if not 0 <= self.seed < 2**64:
            raise ValueError("seed: must be in [0, 2**64)")
        if self.decode_log_interval < 0:
            raise ValueError(f"decode_log_interval: must be >= 0, got {self.decode_log_interval}")
        if self.prefill_max_requests is not None and self.prefill_max_requests < 1:
            raise ValueError(f"prefill_max_requests: must be >= 1, got {self.prefill_max_requests}")
        if self.retraction_policy not in RETRACTION_POLICIES:
            raise ValueError(
                f"retraction_policy: {self.retraction_policy!r} is not one of {RETRACTION_POLICIES}"
            )
        if (
            self.priority_preemption_threshold is not None
            and self.priority_preemption_threshold < 0
        ):
            raise ValueError("priority_preemption_threshold: must be >= 0")

    @property
    def chunk_tokens(self) -> int | None:
        """Longest prefill piece, or None when chunking is off."""
        return None if self.chunked_prefill_size == -1 else self.chunked_prefill_size

    @property
    def new_token_ratio_decay(self) -> float:
        return (self.init_new_token_ratio - self.min_new_token_ratio) / (
            self.new_token_ratio_decay_steps
        )

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_json(cls, text: str | bytes) -> SchedulerConfig:
        return msgspec.json.decode(text, type=cls)


def from_server_args(
    args: Any,
    *,
    num_total_pages: int,
    max_context_len: int,
    eos_token_ids: tuple[int, ...] = (),
    **overrides: Any,
) -> SchedulerConfig:
    """Map server arguments (`ops.server_args.ServerArgs` or an argparse Namespace with
    the same field names) plus what the executor reported (pool size, context length,
    eos ids) onto a SchedulerConfig.

    Unset (None) options get engine choices: max_running_requests is bounded by the
    pool (SGLang: at most half the total tokens), chunked_prefill_size defaults to 8192
    rounded to the page size, and --context-length may only shorten the model's own.
    Overlap scheduling (two batches in flight) is on unless --disable-overlap-schedule.
    """
    page_size = int(getattr(args, "page_size", 1) or 1)
    context = getattr(args, "context_length", None)
    if context is not None and context > max_context_len:
        raise ValueError(
            f"--context-length {context}: longer than the model's maximum {max_context_len}"
        )
    running = getattr(args, "max_running_requests", None)
    if running is None:
        running = max(1, min(256, (num_total_pages * page_size) // 2 or 256))
    chunk = getattr(args, "chunked_prefill_size", None)
    if chunk is None:
        chunk = max(page_size, 8192 // page_size * page_size)
    seed = getattr(args, "random_seed", None)
    # --schedule-conservativeness scales both new token ratios (as SGLang does)
    scale = float(getattr(args, "schedule_conservativeness", 1.0))
    init_ratio = min(INIT_NEW_TOKEN_RATIO * scale, 1.0)
    min_ratio = min(MIN_NEW_TOKEN_RATIO * scale, init_ratio)
    fields: dict[str, Any] = dict(
        max_running_requests=running,
        max_queued_requests=getattr(args, "max_queued_requests", None),
        max_prefill_tokens=getattr(args, "max_prefill_tokens", 16384),
        chunked_prefill_size=chunk,
        schedule_policy=getattr(args, "schedule_policy", "fcfs"),
        page_size=page_size,
        max_context_len=context if context is not None else max_context_len,
        num_total_pages=num_total_pages,
        eos_token_ids=tuple(eos_token_ids),
        seed=seed if seed is not None else 0,
        refresh_stale_matches=not getattr(args, "disable_radix_cache", False),
        in_batch_prefix_sharing=not getattr(args, "disable_radix_cache", False),
        max_batches_in_flight=1 if getattr(args, "disable_overlap_schedule", False) else 2,
        init_new_token_ratio=init_ratio,
        min_new_token_ratio=min_ratio,
        prefill_max_requests=getattr(args, "prefill_max_requests", None),
        decode_log_interval=getattr(args, "decode_log_interval", 0),
        retraction_policy=getattr(args, "retraction_policy", "length"),
    )
    if getattr(args, "enable_priority_scheduling", False):
        # SGLang's switch: priority order, with preemption past the threshold
        fields["schedule_policy"] = "priority"
        fields["priority_preemption_threshold"] = int(
            getattr(args, "priority_scheduling_preemption_threshold", 10)
        )
    fields.update(overrides)
    return SchedulerConfig(**fields)
