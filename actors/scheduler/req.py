"""One request as the scheduler sees it, and the stop conditions that need token ids.

A request's tokens are `all_ids` (prompt, then output). KV exists for the first
`num_computed` of them, in `pages` (page j holds positions [j*page_size, (j+1)*page_size)).
The first `num_tree_pages` pages belong to the cache manager (the matched prefix, and
whatever a ChunkCached handed over); the rest were drawn from the scheduler's lease pool
and count as "held by requests" in the census.

Invariants
    - len(pages) * page_size >= num_planned >= num_computed (every position computed,
      or planned in a batch in flight, has a page).
    - num_cached <= num_computed <= len(all_ids); a running request whose row sampled
      (`row_sampled`) has num_computed == len(all_ids) - 1: the last sampled token has
      no KV yet, the next decode step computes it from LAST_SAMPLED.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shunter.bus.messages import Matched, SamplingParams

if TYPE_CHECKING:
    from shunter.actors.scheduler.config import SchedulerConfig

WAITING = "waiting"  # in the waiting queue, holding only its matched prefix
RUNNING = "running"  # holds a row; prefilling (its row has not sampled yet) or decoding
RETRACTED = "retracted"  # released for lack of KV; waits for the cache manager's new Matched
PARKED = "parked"  # waiting, but its match released under KV pressure (unlocked, so the
# tree may evict it); sent to the cache manager again (Tokenized) when pressure eases


class Req:
    __slots__ = (
        "abort_reason",
        "all_ids",
        "arrival_ns",
        "awaiting_match",
        "end_reason",
        "enqueue_seq",
        "enqueued_ns",
        "extra_key",
        "inflight_samples",
        "num_cached",
        "num_cached_reported",
        "num_computed",
        "num_inflight",
        "num_planned",
        "num_prompt",
        "num_retractions",
        "num_tree_pages",
        "pages",
        "priority",
        "refresh_version",
        "request_id",
        "row",
        "row_sampled",
        "sample_planned",
        "sampling",
        "seed",
        "state",
        "stop_ids",
        "stream",
        "tree_version",
        "wants_extras",
    )  # fmt: skip

    def __init__(
        self,
        m: Matched,
        *,
        page_size: int,
        enqueue_seq: int,
        enqueued_ns: int,
        seed: int,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        r = m.request
        self.request_id: str = r.request_id
        self.sampling: SamplingParams = r.sampling
        self.priority = r.priority
        self.extra_key = r.extra_key
        self.stream = r.stream
        self.arrival_ns = r.arrival_ns
        self.all_ids: list[int] = list(r.input_ids)
        self.num_prompt = len(r.input_ids)
        self.num_cached_reported = m.num_cached_tokens
        self.state = WAITING
        self.row = -1
        self.row_sampled = False  # its row sampled a token (results seen)
        # A sampling entry is planned for its row: from then on it decodes (LAST_SAMPLED);
        # until then it is prefilling (a first prefill, or a re-prefill after a
        # retraction, possibly in chunks).
        self.sample_planned = False
        self.num_inflight = 0  # entries of it in batches sent, results not yet seen
        self.inflight_samples = 0  # of those, entries that sample
        self.end_reason: str | None = None  # ended; released when num_inflight reaches 0
        self.enqueue_seq = enqueue_seq
        self.enqueued_ns = enqueued_ns
        self.seed = seed
        self.abort_reason: str | None = None  # set while an abort waits for a step/match
        self.awaiting_match = False  # a RefreshMatch or retraction is unanswered
        self.refresh_version = -1  # tree version estimate when last refreshed
        self.num_retractions = 0
        sp = r.sampling
        # outputs that need more than the token (logprobs): the slow path in results.py
        self.wants_extras = (
            sp.return_logprob or sp.top_logprobs_num > 0 or sp.logprob_start_len >= 0
        )
        stop = set(r.sampling.stop_token_ids)
        eos = set(eos_token_ids)
        self.stop_ids = frozenset(stop - eos if r.sampling.ignore_eos else stop | eos)
        self.pages: list[int] = []
        self.num_tree_pages = 0
        self.num_cached = 0
        self.num_computed = 0
        self.num_planned = 0
        self.tree_version = 0
        self.apply_match(m, page_size)

    def apply_match(self, m: Matched, page_size: int) -> None:
        """Take a (new) match as the prefix; the request must hold no pages of its own."""
        pages = list(m.prefix_pages)
        num_cached = min(m.num_cached_tokens, len(pages) * page_size)
        # Keep at least one token to compute (its logits give the next token). The cache
        # manager promises this; trimming whole pages keeps us safe if it did not.
        while num_cached >= len(self.all_ids) and pages:
            pages.pop()
            num_cached = min(num_cached, len(pages) * page_size)
        del pages[-(-num_cached // page_size) :]  # drop pages beyond the match
        self.pages = pages
        self.num_tree_pages = len(pages)
        self.num_cached = num_cached
        self.num_computed = num_cached
        self.num_planned = num_cached
        self.tree_version = m.tree_version

    @property
    def num_output(self) -> int:
        return len(self.all_ids) - self.num_prompt

    @property
    def num_held_pages(self) -> int:
        return len(self.pages) - self.num_tree_pages

    def remaining_new_tokens(self) -> int:
        return max(0, self.sampling.max_new_tokens - self.num_output)


def refusal(req: Req, cfg: SchedulerConfig, num_waiting: int) -> tuple[str, str, int] | None:
    """(code, message, HTTP status) when a new request cannot be taken: an empty or too
    long prompt (400), or a full queue (503, with num_waiting others waiting)."""
    n = len(req.all_ids)
    if n == 0:
        return "invalid_request", "the prompt is empty", 400
    if n >= cfg.max_context_len:
        return "context_length_exceeded", (
            f"the prompt has {n} tokens; the context length is {cfg.max_context_len} "
            "and at least one token must be generated"
        ), 400  # fmt: skip
    if cfg.num_total_pages and -(-(n + 1) // cfg.page_size) > cfg.num_total_pages:
        return "context_length_exceeded", (
            f"the prompt needs more KV pages than the pool has ({cfg.num_total_pages})"
        ), 400  # fmt: skip
    limit = cfg.max_queued_requests
    if limit is not None and num_waiting >= limit:
        return "queue_full", f"the request queue is full ({limit} waiting); retry later", 503
    return None
