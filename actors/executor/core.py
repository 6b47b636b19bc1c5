"""ExecutorCore: the executor's row mirror, one forward and one sample per ForwardBatch,
with the next step's forward launched before the previous step's tokens are read.

Theory of operation
-------------------
The scheduler owns rows (its running slots) and KV pages; the executor mirrors, per
row, what it needs to run a step: the row's pages, how many tokens have KV, the last
sampled token, and the row's sampling state (parameters, generator, penalty counts).
A ForwardBatch carries only diffs: `closes` (rows released before this step), `opens`
(rows entering with their cached prefix pages), then columnar entries (row, new
tokens, start position, input ids, pages appended, whether to sample). So the
mirror is a pure function of the batches received, and a recorded log replays it.

`submit(batch)` does, in order:
1. plan (core_plan.py): check the whole batch against the mirror WITHOUT changing it
   (unknown row, start_pos != KV length, page overflow, page or token id out of
   range, LAST_SAMPLED without a pending sample, bad sampling parameters, ...). A
   malformed batch, or a forward that raises, answers `StepResult(error=...)`; only
   its closes apply (closing is idempotent: closing an unknown row is counted, not an
   error). A batch with no entries (row diffs only) runs no forward.
2. stage: write the new pages' slots into the row tables (positions past each row's
   KV length, which nothing reads yet) and build the runner's ForwardInput. An input
   LAST_SAMPLED whose token is still on the device is gathered there from
   `_last_tokens` (one int64 per row, on the model's device).
3. forward: launch the logits for the last token of every sampling entry (and for
   every token of entries that asked for prompt logprobs).
4. commit: apply closes and opens, advance KV lengths and page counts.
5. finish the previously submitted step: wait for its tokens on the host (pinned
   copies and a CUDA event; on the CPU they are already there), then record each
   token as its row's pending LAST_SAMPLED (unless the row fed it back in step 4),
   feed it to the penalty counts, and build that step's StepResult.
6. launch this step's sample (sampling.sample_on_device), scatter its tokens into
   `_last_tokens`, mark its rows in flight, and start the copies to the host.
So on a GPU step N+1's forward is queued behind step N's sample before step N's
tokens reach the host, and step N+1's sample sees every host state step N changed
(penalty and min_new_tokens counts, generators) exactly as the one-step-at-a-time
order would: the results are the same, token for token. `flush()` finishes the step
in flight; `step(batch)` is submit then flush; `handle` calls `step`.

`copies` (copies.py) runs the copies between KV tiers that the cache manager asks for
(host pool, file store) between batches; a device copy is queued behind the forwards
on a copy stream, so no step in flight needs finishing first.

Row tables (row_tables.py): every row's page ids and the KV slot of every token
position; each entry's slot table handed to the runner is a view of a row, so a
decode step allocates nothing per row.

Invariants
----------
- For every row: num_tokens <= num_pages * page_size <= max_context_len rounded up to
  a page, and tables.slots[row, :num_tokens] are the slots of its tokens.
- A row has a pending sample iff it sampled since its last fed token; LAST_SAMPLED is
  accepted only as the first input of such a row's entry. The sample's value is on
  the host (row.pending) or, while its step is in flight, only in _last_tokens
  (row.inflight); at most one step is in flight, so finishing it leaves none.
- Every submitted batch gets exactly one StepResult, in submission order. A step whose
  input gathered a token of a step that then failed to finish fails too.
- The core reads no clock, environment or randomness of its own (seeds come in RowOpen).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import torch

from shunter.actors.executor.copies import Copies
from shunter.actors.executor.core_plan import (
    Entry,
    Geometry,
    LogitsLayout,
    Plan,
    PromptScores,
    Row,
    StepFailed,
    logits_layout,
    plan_batch,
    prompt_logprobs,
    scores_to_host,
    top_lists,
)
from shunter.actors.executor.row_tables import RowTables
from shunter.actors.executor.runner import ForwardInput
from shunter.actors.executor.sampling import (
    DeviceSample,
    sample_on_device,
    sample_results,
)
from shunter.actors.executor.slot_table import SLICE_MAX_ENTRIES, device_tensor, long_tensor
from shunter.bus.messages import (
    ForwardBatch,
    Msg,
    StepResult,
    TopLogprob,
)
from shunter.kernels.page_layout import to_device

if TYPE_CHECKING:
    from shunter.actors.executor.file_store import FileStore
    from shunter.actors.executor.host_pool import HostKVPool
    from shunter.actors.grammar.token_fsm import TokenFsm

Inbox = ForwardBatch


class ExecutorStats(msgspec.Struct, frozen=True):
    num_steps: int  # batches answered, failed ones included
    num_failed_steps: int
    num_rows: int  # rows open now
    num_tokens_computed: int  # new tokens run through the model
    num_sampled: int
    num_unknown_closes: int  # closes of rows that were not open (idempotent no-ops)
    last_error: str | None


@dataclass(slots=True)
class _InFlight:
    """A submitted step whose result is not out yet."""

    step_id: int
    done: StepResult | None = None  # its result, when nothing is left to wait for
    rows: list[Row] = field(default_factory=list)  # rows that sampled, in batch order
    row_ids: list[int] = field(default_factory=list)
    sample: DeviceSample | None = None  # host copies; valid once `event` completed
    prompt_lp: dict[int, PromptScores] = field(default_factory=dict)  # row -> host copies
    event: torch.cuda.Event | None = None  # recorded after the copies (CUDA only)


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
        grammars: Callable[[str], TokenFsm] | None = None,
        host_pool: HostKVPool | None = None,
        file_store: FileStore | None = None,
    ) -> None:
        self.runner = runner
        self.host_pool = host_pool  # the host KV tier; None: off
        self.file_store = file_store  # the file store below it; None: off
        self.copies = Copies(lambda: self.runner.kv_pool, host_pool, file_store)
        # pattern -> its token automaton (constrained decoding); None: regex refused
        self.grammars = grammars
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
        # rows opened that have run no entry yet (the runner copies their whole slot table)
        self._unsynced: set[int] = set()
        self._tables = RowTables(self.page_size, self.max_pages_per_row, self.max_context_len)
        device = torch.device(getattr(runner, "device", "cpu"))
        self._last_tokens = torch.zeros(max_num_rows, dtype=torch.int64, device=device)
        self._inflight: _InFlight | None = None
        self._last_error: str | None = None
        self.reset_statistics()

    # ---- the loop -------------------------------------------------------------------

    def handle(self, msg: Msg) -> list[Msg]:
        match msg:
            case ForwardBatch():
                return [self.step(msg)]
        return []

    def step(self, batch: ForwardBatch) -> StepResult:
        """Run `batch` to its result (submit, then flush)."""
        if self._inflight is not None:
            raise RuntimeError("step() while a submitted step is unfinished: flush() first")
        (result,) = self.submit(batch) + self.flush()
        return result

    def submit(self, batch: ForwardBatch) -> list[StepResult]:
        """Launch `batch` (steps 1-4 and 6), finishing the step submitted before it in
        between (step 5); returns that step's result, [] if there was none."""
        self._num_steps += 1
        prev, self._inflight = self._inflight, None
        launched = self._forward(batch)
        out = [] if prev is None else [self._finish(prev)]
        if isinstance(launched, StepResult):
            self._inflight = _InFlight(batch.step_id, done=launched)
            return out
        entries, layout, logits = launched
        if out and out[0].error is not None and any(e.from_device for e in entries):
            why = StepFailed(f"LAST_SAMPLED of a row whose step {out[0].step_id} failed")
            self._inflight = _InFlight(batch.step_id, done=self._fail(batch.step_id, why))
            return out
        try:
            self._inflight = self._sample(batch.step_id, layout, logits)
        except Exception as e:  # the rows of this step fail; the mirror stays consistent
            self._inflight = _InFlight(batch.step_id, done=self._fail(batch.step_id, e))
        return out

    def flush(self) -> list[StepResult]:
        """Finish the step in flight: its result, or [] if none was submitted."""
        prev, self._inflight = self._inflight, None
        return [] if prev is None else [self._finish(prev)]

    def step_ready(self) -> bool:
        """Whether flush() would return without waiting for the device."""
        f = self._inflight
        return f is None or f.event is None or f.event.query()

    def wait_step_ready(self) -> None:
        """Block until flush() would not wait for the device. Changes nothing, so it
        may run in another thread while the core is idle (and be left running)."""
        f = self._inflight
        if f is not None and f.event is not None:
            f.event.synchronize()

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

    def reset_statistics(self) -> None:
        """Zero the counters (after warm-up steps, which are not the server's)."""
        self._num_steps = self._num_failed = self._num_tokens = self._num_sampled = 0
        self._num_unknown_closes = 0
        self._last_error = None

    def open_rows(self) -> dict[int, tuple[int, int]]:
        """row -> (num_tokens, num_pages), for tests and debugging."""
        return {i: (r.num_tokens, r.num_pages) for i, r in self._rows.items()}

    def _forward(
        self, batch: ForwardBatch
    ) -> StepResult | tuple[list[Entry], LogitsLayout, torch.Tensor]:
        """Steps 1-4: (entries, logits being computed), or the step's final result."""
        try:
            plan = plan_batch(batch, self._rows, self.geometry, self.grammars)
            entries, opened = plan.entries, plan.opened
            if not entries:  # only row diffs (e.g. closes while nothing runs): no forward
                self._commit(batch, entries, opened)
                return StepResult(step_id=batch.step_id, rows=[], token_ids=[])
            layout = logits_layout(entries)
            inp = self._stage(batch, plan, layout.indices)
            logits = self.runner.forward(inp)  # [num_logits, V] float32
        except Exception as e:  # malformed batch or a failed forward: the step fails
            self._close(batch.closes)
            return self._fail(batch.step_id, e)
        self._commit(batch, entries, opened)
        return entries, layout, logits

    def _fail(self, step_id: int, e: Exception) -> StepResult:
        self._num_failed += 1
        kind = (
            "malformed batch"
            if isinstance(e, StepFailed)
            else f"forward failed ({type(e).__name__})"
        )
        self._last_error = f"step {step_id}: {kind}: {e}"
        return StepResult(step_id=step_id, rows=[], token_ids=[], error=self._last_error)

    # ---- 2. stage -------------------------------------------------------------------

    def _stage(self, b: ForwardBatch, plan: Plan, logits_idx: list[int]) -> ForwardInput:
        entries, opened = plan.entries, plan.opened
        tables = self._tables
        tables.ensure(max(max(b.rows), max(opened, default=0)))
        for o in b.opens:  # prefix pages and their tokens' slots
            tables.open(o.row_idx, plan.prefix_pages.get(o.row_idx), o.num_prefix_tokens)
        if b.new_pages:
            tables.append_pages([e.row_idx for e in entries], [e.base_pages for e in entries],
                                b.num_new_pages, plan.new_pages)  # fmt: skip

        num_tokens = len(b.input_ids)
        if num_tokens == len(entries):  # all decode: one token per entry
            positions = long_tensor(b.start_pos)
            token_rows = long_tensor(b.rows)
        elif len(entries) <= SLICE_MAX_ENTRIES:  # a long prefill: a run per entry, no expansion
            spans = list(zip(b.rows, b.start_pos, b.num_new_tokens, strict=True))
            positions = torch.cat([torch.arange(s, s + n) for _, s, n in spans])
            token_rows = torch.cat([torch.full((n,), r, dtype=torch.int64) for r, _, n in spans])
        else:
            counts, starts = long_tensor(b.num_new_tokens), long_tensor(b.start_pos)  # [E]
            first = torch.cumsum(counts, 0) - counts  # [E] offset of each entry's first token
            positions = torch.repeat_interleave(starts - first, counts) + torch.arange(num_tokens)
            token_rows = torch.repeat_interleave(long_tensor(b.rows), counts)  # [T]
        tables.write_slots(token_rows, positions)

        seq_lens = [e.start + len(e.ids) for e in entries]
        slots = tables.slots
        return ForwardInput(
            input_ids=self._input_ids(entries, plan.input_ids),
            positions=positions,
            num_new_tokens=list(b.num_new_tokens),
            seq_lens=seq_lens,
            slot_tables=[slots[e.row_idx, :sl] for e, sl in zip(entries, seq_lens)],
            logits_indices=long_tensor(logits_idx),
            checked=True,  # plan_batch checked the batch against the row mirror
            row_ids=[e.row_idx for e in entries],
            fresh=[e.row_idx in opened or e.row_idx in self._unsynced for e in entries],
        )  # fmt: skip

    def _input_ids(self, entries: list[Entry], ids: torch.Tensor) -> torch.Tensor:
        """The plan's [num_tokens] int64 input ids; on the model's device when an entry's
        first token is a sample still there (gathered from _last_tokens, no host read)."""
        if len(ids) == len(entries) and all(e.from_device for e in entries):
            # all decode, every input a sample in flight
            rows = device_tensor([e.row_idx for e in entries], self._last_tokens.device)
            return self._last_tokens[rows]
        gather, off = [], 0
        for e in entries:
            if e.from_device:
                gather.append((off, e.row_idx))
            off += len(e.ids)
        if not gather:
            return ids
        dev = self._last_tokens.device
        ids = to_device(ids, dev)
        at = device_tensor([f for f, _ in gather], dev)
        ids[at] = self._last_tokens[device_tensor([r for _, r in gather], dev)]
        return ids

    # ---- 4. commit ------------------------------------------------------------------

    def _close(self, closes: list[int]) -> None:
        for row_idx in closes:
            self._unsynced.discard(row_idx)
            if self._rows.pop(row_idx, None) is None:
                self._num_unknown_closes += 1

    def _commit(self, b: ForwardBatch, entries: list[Entry], opened: dict[int, Row]) -> None:
        self._close(b.closes)
        for o in b.opens:
            row = opened[o.row_idx]
            self._rows[o.row_idx] = row
            self._unsynced.add(o.row_idx)
            row.sampling.observe_prompt(o.prefix_token_ids)
            if o.num_output_tokens:
                row.resume_ids = list(o.prefix_token_ids)
                row.num_resumed = o.num_output_tokens
        for e, k in zip(entries, b.num_new_pages):
            row = self._rows[e.row_idx]
            self._unsynced.discard(e.row_idx)
            row.num_tokens += len(e.ids)
            row.num_pages += k
            if row.sampling.params.repetition_penalty != 1.0:
                # The pending sample is observed as output when its step finishes.
                fed_back = row.pending is not None or row.inflight
                row.sampling.observe_prompt(e.ids[1:] if fed_back else e.ids)
            row.pending = None
            row.inflight = False
            if row.resume_ids is not None:
                row.resume_ids += e.ids
        self._num_tokens += len(b.input_ids)

    # ---- 5. finish the previous step, 6. sample ---------------------------------------

    def _sample(self, step_id: int, layout: LogitsLayout, logits: torch.Tensor) -> _InFlight:
        """Step 6: launch the sample of every sampling entry, and the prompt logprobs."""
        prompt_lp = {
            e.row_idx: prompt_logprobs(e, self._rows[e.row_idx], logits[lo:hi])
            for e, lo, hi in layout.prompt_at
        }
        sample_rows, sample_logit_idx = layout.sample_rows, layout.sample_at
        rows = [self._rows[r] for r in sample_rows]
        ds: DeviceSample | None = None
        if rows:
            for row in rows:
                if row.resume_ids is not None:  # first sample of a resumed request
                    row.sampling.resume(row.resume_ids[len(row.resume_ids) - row.num_resumed :])
                    row.resume_ids = None
            dev = logits.device
            picked = (
                logits
                if len(sample_logit_idx) == logits.shape[0]
                else logits[device_tensor(sample_logit_idx, dev)]
            )
            ds = sample_on_device(picked, [r.sampling for r in rows])
            self._last_tokens[device_tensor(sample_rows, dev)] = ds.tokens
            for row in rows:
                row.pending = None
                row.inflight = True
                row.has_sampled = True
                row.prompt_lp = None
            self._num_sampled += len(rows)
        # Start the copies to the host now: the stream reaches them before the next
        # step's forward, whose launch overlaps the wait for them.
        nb = logits.device.type == "cuda"
        f = _InFlight(step_id, rows=rows, row_ids=sample_rows,
                      sample=None if ds is None else ds.to_host(non_blocking=nb),
                      prompt_lp={r: scores_to_host(t, nb) for r, t in prompt_lp.items()})  # fmt: skip
        if nb:
            f.event = torch.cuda.Event()
            f.event.record()
        return f

    def _finish(self, f: _InFlight) -> StepResult:
        """Step 5: wait for f's tokens and apply what the host keeps of them."""
        if f.done is not None:
            return f.done
        try:
            if f.event is not None:
                f.event.synchronize()
            samplings = [r.sampling for r in f.rows]
            out = sample_results(f.sample, samplings) if f.sample is not None else None
            prompt_logprobs = {r: t.chosen.tolist() for r, t in f.prompt_lp.items()}
            tops = {r: top_lists(t) for r, t in f.prompt_lp.items()}
            prompt_top = {r: t for r, t in tops.items() if t is not None}
        except Exception as e:  # a device error surfaces here: its rows have no sample
            for row in f.rows:
                row.inflight = False
            return self._fail(f.step_id, e)
        if out is None:
            return StepResult(f.step_id, [], [], prompt_logprobs=prompt_logprobs,
                              prompt_top_logprobs=prompt_top)  # fmt: skip
        for row, t in zip(f.rows, out.token_ids):
            if row.inflight:  # not fed back yet by the step submitted after it
                row.pending = t
                row.inflight = False
            row.sampling.observe_output(t)
        return StepResult(
            step_id=f.step_id,
            rows=f.row_ids,
            token_ids=out.token_ids,
            logprobs=out.logprobs,
            top_logprobs=[[TopLogprob(t, lp) for t, lp in top] for top in out.top_logprobs],
            prompt_logprobs=prompt_logprobs,
            prompt_top_logprobs=prompt_top,
        )
