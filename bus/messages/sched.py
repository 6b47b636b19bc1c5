"""Scheduler <-> executor: batches with row diffs, step results, tokens out.

The executor mirrors each running request's page table as a "row". A ForwardBatch
carries only diffs (rows opened with their prefix pages, pages appended, rows closed),
so the executor's state is a pure function of the batches it received. Per-entry data
is columnar (parallel lists) to keep a 256-row decode batch cheap to encode.

Overlap: an input id of LAST_SAMPLED means "the token this row sampled in its previous
step", which the executor resolves itself, so step N+1 can be sent before step N's
result is read.
"""

from __future__ import annotations

import msgspec

from shunter.bus.messages.base import Msg
from shunter.bus.messages.request import SamplingParams
from shunter.bus.messages.tokenizer import TopLogprob

LAST_SAMPLED = -1


class RowOpen(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A request enters the executor: its row, cached prefix and sampling state."""

    row_idx: int
    request_id: str
    prefix_pages: list[int]  # pages already holding KV (from the prefix cache)
    num_prefix_tokens: int  # tokens whose KV those pages hold
    sampling: SamplingParams
    seed: int  # resolved per-request seed
    prefix_token_ids: list[int] = []  # cached prompt tokens (for penalties / logprobs)
    # A resumed request (after a retraction): how many of the row's tokens before its
    # first sample (prefix + prefill inputs) are its own earlier outputs. The executor
    # counts them as outputs (penalties, min_new_tokens) and skips that many draws of
    # the row's generator, so a seeded request continues its random stream unchanged.
    num_output_tokens: int = 0


class ForwardBatch(Msg, tag="sched.batch"):
    """One forward step. Entries are the rows that compute this step, in order.
    The executor applies closes first, then opens, then the entries: a row closed here
    may be opened again in the same batch for another request."""

    step_id: int
    opens: list[RowOpen] = []
    closes: list[int] = []  # rows released before this step (their pages are the cache's now)
    rows: list[int] = []  # row of each entry
    num_new_tokens: list[int] = []  # tokens each entry computes (1 for decode)
    start_pos: list[int] = []  # position of each entry's first new token (= KV length before)
    input_ids: list[int] = []  # flattened new tokens of all entries; may hold LAST_SAMPLED
    new_pages: list[int] = []  # flattened pages appended to rows this step
    num_new_pages: list[int] = []  # how many of new_pages belong to each entry
    sample: list[bool] = []  # False for a non-final prefill chunk (no token is sampled)
    version: int = 0  # weights/layout version this batch was planned for (flips)


class StepResult(Msg, tag="sched.result"):
    """What one ForwardBatch produced: one sampled token per sampling entry."""

    step_id: int
    rows: list[int]  # rows that sampled, in batch order
    token_ids: list[int]
    logprobs: list[float] = []  # per sampled token, for rows that asked (NaN elsewhere)
    # per row that asked, else []: its top_logprobs_num top tokens, then the
    # token_ids_logprob ids in the order asked (SamplingParams)
    top_logprobs: list[list[TopLogprob]] = []
    prompt_logprobs: dict[int, list[float]] = {}  # row -> prompt logprobs computed this step
    forward_us: int = 0  # executor's time for the step (for metrics; not used by cores)
    error: str | None = None  # a failed step: every row in it fails
    # row -> the top tokens (then the token_ids_logprob ids) of each prompt position in
    # prompt_logprobs ([] where none was scored), for rows that ask for prompt logprobs
    # and for top tokens or token ids
    prompt_top_logprobs: dict[int, list[list[TopLogprob]]] = {}


class RequestOutput(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """New tokens of one request from one step."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float] = []
    top_logprobs: list[list[TopLogprob]] = []
    prompt_logprobs: list[float] = []
    finish_reason: str | None = None
    matched_stop: int | None = None  # the stop token id that ended it
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_top_logprobs: list[list[TopLogprob]] = []  # one list per prompt_logprobs item


class TokensOut(Msg, tag="sched.tokens"):
    """Scheduler to tokenizer: every request's new tokens from one step."""

    step_id: int
    outputs: list[RequestOutput]


class Tick(Msg, tag="sched.tick"):
    """Time, as a message: the only clock the scheduler core knows (priority aging,
    timeouts). Sent by the scheduler's shell."""

    now_ns: int


class SchedulerStats(Msg, tag="sched.stats"):
    """Periodic load figures for /metrics and /get_server_info."""

    step_id: int
    num_running: int
    num_waiting: int
    num_used_pages: int
    num_total_pages: int
    cache_hit_rate: float
    gen_throughput_tok_s: float = 0.0


class SchedulerConfigured(Msg, tag="sched.config"):
    """The scheduler's configuration, published once by its shell before anything else,
    so a recorded log holds what is needed to rebuild the core and replay its inbox."""

    actor_id: str
    config_json: str  # actors/scheduler/config.py SchedulerConfig, as JSON
