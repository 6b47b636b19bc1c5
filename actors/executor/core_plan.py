"""Planning a ForwardBatch against the executor's row mirror, without changing it.

Theory of operation: `plan_batch` checks a whole batch before anything is applied
(see core.py, step 1) and returns the entries to run, with their input ids resolved
(LAST_SAMPLED -> the row's pending sample), and the rows the batch opens (not yet in
the mirror). Any inconsistency raises StepFailed naming the entry and the reason, so
a malformed batch fails its step and leaves the mirror as it was.

Invariants: plan_batch reads `rows` and never mutates it or the Row objects in it.
"""

from __future__ import annotations

import msgspec
import torch

from shunter.actors.executor.sampling import RowSampling, validate_params
from shunter.bus.messages import LAST_SAMPLED, ForwardBatch


class Geometry(msgspec.Struct, frozen=True):
    """What the executor's pool and model allow."""

    page_size: int
    num_pages: int
    vocab_size: int
    max_context_len: int
    max_num_rows: int
    eos_token_ids: tuple[int, ...]

    @property
    def max_pages_per_row(self) -> int:
        return -(-self.max_context_len // self.page_size)


class Row:
    """The executor's mirror of one scheduler row (mutated only by ExecutorCore)."""

    __slots__ = ("has_sampled", "num_pages", "num_resumed", "num_tokens", "pending", "prompt_lp",
                 "resume_ids", "sampling")  # fmt: skip

    def __init__(self, num_tokens: int, num_pages: int, sampling: RowSampling) -> None:
        self.num_tokens = num_tokens  # tokens with KV
        self.num_pages = num_pages
        self.sampling = sampling
        self.pending: int | None = None  # sampled, not yet fed back: what LAST_SAMPLED means
        self.has_sampled = False
        # [V] float32 logprobs at the last computed prompt position, kept between prefill
        # chunks for rows that want prompt logprobs (they score the next chunk's first token).
        self.prompt_lp: torch.Tensor | None = None
        # A resumed request: its ids before the first sample, to find its earlier outputs
        # (the last RowOpen.num_output_tokens of them) when it samples again.
        self.resume_ids: list[int] | None = None
        self.num_resumed = 0


class Entry(msgspec.Struct):
    """One entry of a planned batch."""

    row_idx: int
    start: int
    ids: list[int]  # resolved input ids
    base_pages: int  # pages the row holds before this entry's new ones
    sample: bool
    prompt_lp_from: int  # first position whose prompt logprob this entry reports; -1: none


class StepFailed(ValueError):
    """A ForwardBatch that cannot run; the message says why."""


def plan_batch(
    b: ForwardBatch, rows: dict[int, Row], g: Geometry
) -> tuple[list[Entry], dict[int, Row]]:
    """(entries to run, rows this batch opens) or StepFailed; see the module docstring."""
    n = len(b.rows)
    for name in ("num_new_tokens", "start_pos", "num_new_pages", "sample"):
        if len(getattr(b, name)) != n:
            raise StepFailed(f"{name} has {len(getattr(b, name))} items for {n} entries")
    if sum(b.num_new_tokens) != len(b.input_ids):
        raise StepFailed(f"{len(b.input_ids)} input ids for {sum(b.num_new_tokens)} new tokens")
    if sum(b.num_new_pages) != len(b.new_pages):
        raise StepFailed(f"{len(b.new_pages)} new pages for {sum(b.num_new_pages)} declared")
    if b.new_pages and (min(b.new_pages) < 0 or max(b.new_pages) >= g.num_pages):
        raise StepFailed(f"a new page is outside [0, {g.num_pages})")
    closed = set(b.closes)
    opened: dict[int, Row] = {}
    for o in b.opens:
        if not 0 <= o.row_idx < g.max_num_rows:
            raise StepFailed(f"open of row {o.row_idx} outside [0, {g.max_num_rows})")
        if o.row_idx in opened or (o.row_idx in rows and o.row_idx not in closed):
            raise StepFailed(f"open of row {o.row_idx}, which is already open")
        if not 0 <= o.num_prefix_tokens <= len(o.prefix_pages) * g.page_size:
            raise StepFailed(
                f"row {o.row_idx}: {o.num_prefix_tokens} prefix tokens in "
                f"{len(o.prefix_pages)} pages of {g.page_size}"
            )
        if len(o.prefix_pages) > g.max_pages_per_row:
            raise StepFailed(f"row {o.row_idx}: prefix longer than the context")
        if o.prefix_pages and (min(o.prefix_pages) < 0 or max(o.prefix_pages) >= g.num_pages):
            raise StepFailed(f"row {o.row_idx}: a prefix page is outside [0, {g.num_pages})")
        if o.num_output_tokens < 0:
            raise StepFailed(f"row {o.row_idx}: num_output_tokens {o.num_output_tokens} < 0")
        if len(o.prefix_token_ids) > o.num_prefix_tokens:
            raise StepFailed(f"row {o.row_idx}: more prefix token ids than prefix tokens")
        if (why := validate_params(o.sampling, g.vocab_size)) is not None:
            raise StepFailed(f"row {o.row_idx} ({o.request_id}): {why}")
        sampling = RowSampling(o.sampling, o.seed, g.eos_token_ids)
        opened[o.row_idx] = Row(o.num_prefix_tokens, len(o.prefix_pages), sampling)

    entries: list[Entry] = []
    seen_rows: set[int] = set()
    pos = 0
    for i, row_idx in enumerate(b.rows):
        num_new = b.num_new_tokens[i]
        ids = b.input_ids[pos : pos + num_new]
        num_new_pages = b.num_new_pages[i]
        pos += num_new
        row = opened.get(row_idx)
        if row is None:
            row = rows.get(row_idx) if row_idx not in closed else None
        if row is None:
            raise StepFailed(f"entry {i}: row {row_idx} is not open")
        if row_idx in seen_rows:
            raise StepFailed(f"entry {i}: row {row_idx} appears twice")
        seen_rows.add(row_idx)
        if num_new < 1 or num_new_pages < 0:
            raise StepFailed(f"entry {i}: {num_new} new tokens, {num_new_pages} new pages")
        if b.start_pos[i] != row.num_tokens:
            raise StepFailed(
                f"entry {i}: row {row_idx} starts at {b.start_pos[i]} but holds KV for "
                f"{row.num_tokens} tokens"
            )
        end = row.num_tokens + num_new
        if end > g.max_context_len:
            raise StepFailed(
                f"entry {i}: row {row_idx} reaches {end} > context {g.max_context_len}"
            )
        if row.num_pages + num_new_pages > g.max_pages_per_row:
            raise StepFailed(f"entry {i}: row {row_idx} would hold more pages than the context")
        if end > (row.num_pages + num_new_pages) * g.page_size:
            raise StepFailed(
                f"entry {i}: page overflow: row {row_idx} needs {end} slots in "
                f"{row.num_pages + num_new_pages} pages of {g.page_size}"
            )
        if ids[0] == LAST_SAMPLED:
            if row.pending is None:
                raise StepFailed(
                    f"entry {i}: LAST_SAMPLED for row {row_idx}, which has no pending sample"
                )
            ids = [row.pending, *ids[1:]]
        if min(ids) < 0 or max(ids) >= g.vocab_size:
            raise StepFailed(
                f"entry {i}: input id outside [0, {g.vocab_size})"
                + (" (LAST_SAMPLED is only valid first)" if LAST_SAMPLED in ids else "")
            )
        start_lp = row.sampling.params.logprob_start_len
        lp_from = max(start_lp, row.num_tokens) if start_lp >= 0 and not row.has_sampled else -1
        entries.append(
            Entry(row_idx, row.num_tokens, ids, row.num_pages, b.sample[i], lp_from)
        )  # fmt: skip
    return entries, opened
