"""ExecutorCore: the executor's row mirror, one forward and one sample per ForwardBatch.

Theory of operation
-------------------
The scheduler owns rows (its running slots) and KV pages; the executor mirrors, per
row, what it needs to run a step: the row's pages, how many tokens have KV, the last
sampled token, and the row's sampling state (parameters, generator, penalty counts).
A ForwardBatch carries only diffs: `closes` (rows released before this step), `opens`
(rows entering with their cached prefix pages), then columnar entries (row, new
tokens, start position, input ids, pages appended, whether to sample). So the
mirror is a pure function of the batches received, and a recorded log replays it.

`handle(batch)` does, in order:
1. plan (core_plan.py): check the whole batch against the mirror WITHOUT changing it
   (unknown row, start_pos != KV length, page overflow, page or token id out of
   range, LAST_SAMPLED without a pending sample, bad sampling parameters, ...). A
   malformed batch, or a forward that raises, answers `StepResult(error=...)`; only
   its closes apply (closing is idempotent: closing an unknown row is counted, not an
   error). A batch with no entries (row diffs only) runs no forward.
2. stage: write the new pages' slots into the row tables (positions past each row's
   KV length, which nothing reads yet) and build the runner's ForwardInput.
3. forward: logits for the last token of every sampling entry (and for every token of
   entries that asked for prompt logprobs).
4. commit: apply closes and opens, advance KV lengths and page counts.
5. sample every sampling entry (see sampling.py) and record its token as the row's
   pending LAST_SAMPLED.

Row tables: `_pages` [max_rows, max_pages_per_row] int64 holds page ids and `_slots`
[max_rows, max_context_len] int64 the flat KV slot of every token position
(slot = page * page_size + position % page_size); with page_size 1 they are the same
tensor. Each entry's slot table handed to the runner is a view `_slots[row, :seq_len]`,
so a decode step allocates nothing per row.

Invariants
----------
- For every row: num_tokens <= num_pages * page_size <= max_context_len rounded up to
  a page, and _slots[row, :num_tokens] are the slots of its tokens.
- A row has a pending sample iff it sampled since its last fed token; LAST_SAMPLED is
  accepted only as the first input of such a row's entry.
- The core reads no clock, environment or randomness of its own (seeds come in RowOpen).
"""

from __future__ import annotations

import math

import msgspec
import torch

from shunter.actors.executor.core_plan import Entry, Geometry, Row, StepFailed, plan_batch
from shunter.actors.executor.runner import ForwardInput
from shunter.actors.executor.sampling import sample, token_logprobs
from shunter.bus.messages import ForwardBatch, Msg, StepResult, TopLogprob

Inbox = ForwardBatch
_ROW_CHUNK = 64  # row tables grow by at least this many rows


class ExecutorStats(msgspec.Struct, frozen=True):
    num_steps: int  # batches answered, failed ones included
    num_failed_steps: int
    num_rows: int  # rows open now
    num_tokens_computed: int  # new tokens run through the model
    num_sampled: int
    num_unknown_closes: int  # closes of rows that were not open (idempotent no-ops)
    last_error: str | None


class ExecutorCore:
    """See the module docstring. `runner` is a ModelRunner (or anything with its
    `forward`, `kv_pool` and `config`)."""

    def __init__(
        self,
        runner,
        *,
        eos_token_ids: tuple[int, ...] | list[int] = (),
        max_context_len: int | None = None,
        max_num_rows: int = 4096,
    ) -> None:
        self.runner = runner
        self.page_size: int = runner.kv_pool.page_size
        self.num_pages: int = runner.kv_pool.num_pages
        self.vocab_size: int = runner.config.vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_context_len = max_context_len or runner.config.max_position_embeddings
        self.max_num_rows = max_num_rows
        self.geometry = Geometry(self.page_size, self.num_pages, self.vocab_size,
                                 self.max_context_len, max_num_rows, self.eos_token_ids)  # fmt: skip
        self.max_pages_per_row = self.geometry.max_pages_per_row
        self._rows: dict[int, Row] = {}
        self._pages = torch.zeros(0, self.max_pages_per_row, dtype=torch.int64)
        self._slots = (
            self._pages
            if self.page_size == 1
            else torch.zeros(0, self.max_context_len, dtype=torch.int64)
        )
        self._num_steps = self._num_failed = self._num_tokens = self._num_sampled = 0
        self._num_unknown_closes = 0
        self._last_error: str | None = None

    # ---- the loop -------------------------------------------------------------------

    def handle(self, msg: Msg) -> list[Msg]:
        match msg:
            case ForwardBatch():
                return [self.step(msg)]
        return []

    def step(self, batch: ForwardBatch) -> StepResult:
        self._num_steps += 1
        try:
            entries, opened = plan_batch(batch, self._rows, self.geometry)
            if not entries:  # only row diffs (e.g. closes while nothing runs): no forward
                self._commit(batch, entries, opened)
                return StepResult(step_id=batch.step_id, rows=[], token_ids=[])
            inp = self._stage(batch, entries, opened)
            logits = self.runner.forward(inp)  # [num_logits, V] float32
        except Exception as e:  # malformed batch or a failed forward: the step fails
            self._close(batch.closes)
            return self._fail(batch, e)
        self._commit(batch, entries, opened)
        try:
            return self._sample(batch, entries, logits)
        except Exception as e:  # the rows of this step fail; the mirror stays consistent
            return self._fail(batch, e)

    def statistics(self) -> ExecutorStats:
        return ExecutorStats(
            num_steps=self._num_steps,
            num_failed_steps=self._num_failed,
            num_rows=len(self._rows),
            num_tokens_computed=self._num_tokens,
            num_sampled=self._num_sampled,
            num_unknown_closes=self._num_unknown_closes,
            last_error=self._last_error,
        )

    def open_rows(self) -> dict[int, tuple[int, int]]:
        """row -> (num_tokens, num_pages), for tests and debugging."""
        return {i: (r.num_tokens, r.num_pages) for i, r in self._rows.items()}

    def _fail(self, batch: ForwardBatch, e: Exception) -> StepResult:
        self._num_failed += 1
        kind = (
            "malformed batch"
            if isinstance(e, StepFailed)
            else f"forward failed ({type(e).__name__})"
        )
        self._last_error = f"step {batch.step_id}: {kind}: {e}"
        return StepResult(step_id=batch.step_id, rows=[], token_ids=[], error=self._last_error)

    # ---- 2. stage -------------------------------------------------------------------

    def _ensure_rows(self, max_row_idx: int) -> None:
        have = self._pages.shape[0]
        if max_row_idx < have:
            return
        grow = max(max_row_idx + 1 - have, have, _ROW_CHUNK)
        self._pages = torch.cat([self._pages, self._pages.new_zeros(grow, self._pages.shape[1])])
        if self.page_size == 1:
            self._slots = self._pages
        else:
            self._slots = torch.cat(
                [self._slots, self._slots.new_zeros(grow, self._slots.shape[1])]
            )

    def _stage(self, b: ForwardBatch, entries: list[Entry], opened: dict[int, Row]) -> ForwardInput:
        self._ensure_rows(max(max(b.rows), max(opened, default=0)))
        ps = self.page_size
        for o in b.opens:  # prefix pages and their tokens' slots
            if o.prefix_pages:
                self._pages[o.row_idx, : len(o.prefix_pages)] = torch.tensor(o.prefix_pages)
                if ps > 1 and o.num_prefix_tokens:
                    p = torch.arange(o.num_prefix_tokens)
                    self._slots[o.row_idx, : o.num_prefix_tokens] = (
                        self._pages[o.row_idx, p // ps] * ps + p % ps
                    )
        if b.new_pages:
            page_rows: list[int] = []
            page_idx: list[int] = []
            for e, k in zip(entries, b.num_new_pages):
                if k:
                    page_rows += [e.row_idx] * k
                    page_idx += range(e.base_pages, e.base_pages + k)
            self._pages[torch.tensor(page_rows), torch.tensor(page_idx)] = torch.tensor(b.new_pages)

        counts = torch.tensor(b.num_new_tokens)  # [E]
        starts = torch.tensor(b.start_pos)  # [E]
        num_tokens = len(b.input_ids)
        if num_tokens == len(entries):  # all decode: one token per entry
            positions = starts
            token_rows = torch.tensor(b.rows)
        else:
            first = torch.cumsum(counts, 0) - counts  # [E] offset of each entry's first token
            positions = torch.repeat_interleave(starts - first, counts) + torch.arange(num_tokens)
            token_rows = torch.repeat_interleave(torch.tensor(b.rows), counts)  # [T]
        if ps > 1:
            self._slots[token_rows, positions] = (
                self._pages[token_rows, positions // ps] * ps + positions % ps
            )

        logits_idx: list[int] = []
        off = 0
        for e in entries:
            if e.prompt_lp_from >= 0:
                logits_idx += range(off + _first_lp_pos(e) - e.start, off + len(e.ids))
            elif e.sample:
                logits_idx.append(off + len(e.ids) - 1)
            off += len(e.ids)
        seq_lens = [e.start + len(e.ids) for e in entries]
        slots = self._slots
        return ForwardInput(
            input_ids=torch.tensor([t for e in entries for t in e.ids]) if num_tokens > len(entries)
            else torch.tensor([e.ids[0] for e in entries]),
            positions=positions,
            num_new_tokens=list(b.num_new_tokens),
            seq_lens=seq_lens,
            slot_tables=[slots[e.row_idx, :sl] for e, sl in zip(entries, seq_lens)],
            logits_indices=torch.tensor(logits_idx, dtype=torch.int64),
            checked=True,  # plan_batch checked the batch against the row mirror
        )  # fmt: skip

    # ---- 4. commit ------------------------------------------------------------------

    def _close(self, closes: list[int]) -> None:
        for row_idx in closes:
            if self._rows.pop(row_idx, None) is None:
                self._num_unknown_closes += 1

    def _commit(self, b: ForwardBatch, entries: list[Entry], opened: dict[int, Row]) -> None:
        self._close(b.closes)
        for o in b.opens:
            row = opened[o.row_idx]
            self._rows[o.row_idx] = row
            row.sampling.observe_prompt(o.prefix_token_ids)
            if o.num_output_tokens:
                row.resume_ids = list(o.prefix_token_ids)
                row.num_resumed = o.num_output_tokens
        for e, k in zip(entries, b.num_new_pages):
            row = self._rows[e.row_idx]
            row.num_tokens += len(e.ids)
            row.num_pages += k
            if row.sampling.params.repetition_penalty != 1.0:
                # The pending sample was observed as output when it was drawn.
                row.sampling.observe_prompt(e.ids[1:] if row.pending is not None else e.ids)
            row.pending = None
            if row.resume_ids is not None:
                row.resume_ids += e.ids
        self._num_tokens += len(b.input_ids)

    # ---- 5. sample ------------------------------------------------------------------

    def _sample(self, b: ForwardBatch, entries: list[Entry], logits: torch.Tensor) -> StepResult:
        sample_rows: list[int] = []
        sample_logit_idx: list[int] = []
        prompt_logprobs: dict[int, list[float]] = {}
        off = 0
        for e in entries:
            n = len(e.ids)
            if e.prompt_lp_from >= 0:
                k = e.start + n - _first_lp_pos(e)
                prompt_logprobs[e.row_idx] = self._prompt_logprobs(e, logits[off : off + k])
                off += k
                if e.sample:
                    sample_rows.append(e.row_idx)
                    sample_logit_idx.append(off - 1)
            elif e.sample:
                sample_rows.append(e.row_idx)
                sample_logit_idx.append(off)
                off += 1
        if not sample_rows:
            return StepResult(b.step_id, [], [], prompt_logprobs=prompt_logprobs)
        rows = [self._rows[r] for r in sample_rows]
        for row in rows:
            if row.resume_ids is not None:  # first sample of a resumed request
                row.sampling.resume(row.resume_ids[len(row.resume_ids) - row.num_resumed :])
                row.resume_ids = None
        picked = (
            logits
            if len(sample_logit_idx) == logits.shape[0]
            else logits[torch.tensor(sample_logit_idx)]
        )
        out = sample(picked, [r.sampling for r in rows])
        for row, t in zip(rows, out.token_ids):
            row.pending = t
            row.has_sampled = True
            row.prompt_lp = None
            row.sampling.observe_output(t)
        self._num_sampled += len(rows)
        return StepResult(
            step_id=b.step_id,
            rows=sample_rows,
            token_ids=out.token_ids,
            logprobs=out.logprobs,
            top_logprobs=[[TopLogprob(t, lp) for t, lp in top] for top in out.top_logprobs],
            prompt_logprobs=prompt_logprobs,
        )

    def _prompt_logprobs(self, e: Entry, logits: torch.Tensor) -> list[float]:
        """Logprobs of this entry's prompt tokens at positions max(prompt_lp_from, start)
        .. end - 1.

        logits: [k, V] float32 at positions _first_lp_pos(e) .. end - 1; logits at
        position p score the token at p + 1. The entry's first token is scored by the
        previous chunk's last logits when this row computed them (kept in row.prompt_lp),
        else NaN (position 0, or a prefix that came from the cache)."""
        row = self._rows[e.row_idx]
        end = e.start + len(e.ids)
        lo = max(e.prompt_lp_from, e.start)
        values: list[float] = []
        if lo == e.start < end:
            values.append(math.nan if row.prompt_lp is None else float(row.prompt_lp[e.ids[0]]))
        q0 = max(lo, e.start + 1)  # first position scored by this entry's own logits
        if q0 < end:
            first = _first_lp_pos(e)
            scored = logits[q0 - 1 - first : end - 1 - first]  # [end - q0, V]
            values += token_logprobs(scored, torch.tensor(e.ids[q0 - e.start :]))
        # Keep the last position's distribution for the next chunk (a sample ends the prompt).
        row.prompt_lp = None if e.sample else torch.log_softmax(logits[-1], dim=-1)
        return values


def _first_lp_pos(e: Entry) -> int:
    """First position whose logits a prompt-logprob entry needs (the last one always)."""
    return min(max(e.start, e.prompt_lp_from - 1), e.start + len(e.ids) - 1)
