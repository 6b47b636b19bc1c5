"""Planning a ForwardBatch against the executor's row mirror, without changing it, and
the layout of the logits its forward returns.

Theory of operation: `plan_batch` checks a whole batch before anything is applied
(see core.py, step 1) and returns a Plan: the entries to run, with their input ids
resolved (LAST_SAMPLED -> the row's pending sample when the host knows it; when that
sample is still in flight on the device, the id stays LAST_SAMPLED and the entry is
marked `from_device`: the core gathers it there), the rows the batch opens (not yet
in the mirror), and as int64 tensors the batch's input ids (so resolved), its new
pages and each opened row's prefix pages. Each tensor is built once, here: a long list
is range-checked on it (torch.aminmax) rather than by Python's min and max, and the
core stages the same tensors, so an 8k-token prefill converts each list once. Any
inconsistency raises StepFailed naming the entry and the reason, so a malformed batch
fails its step and leaves the mirror as it was. `logits_layout`
says which token positions the forward returns logits for and which entry reads
each; `prompt_logprobs` turns a prompt-logprob entry's logits into its scores (the
logprob of each prompt token, and its position's top tokens when asked).

Invariants: plan_batch reads `rows` and never mutates it or the Row objects in it.
An entry's ids hold LAST_SAMPLED only as ids[0], and only when it is `from_device`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import msgspec
import torch

from shunter.actors.executor.sampling import RowSampling, validate_params, with_ids
from shunter.actors.executor.slot_table import long_tensor
from shunter.bus.messages import LAST_SAMPLED, ForwardBatch, TopLogprob
from shunter.kernels.page_layout import to_device

if TYPE_CHECKING:
    from shunter.actors.grammar.token_fsm import TokenFsm


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

    __slots__ = ("has_sampled", "inflight", "num_pages", "num_resumed", "num_tokens", "pending",
                 "prompt_lp", "resume_ids", "sampling")  # fmt: skip

    def __init__(self, num_tokens: int, num_pages: int, sampling: RowSampling) -> None:
        self.num_tokens = num_tokens  # tokens with KV
        self.num_pages = num_pages
        self.sampling = sampling
        self.pending: int | None = None  # sampled, not yet fed back: what LAST_SAMPLED means
        # Sampled, not yet fed back, and the token is still on the device (its step is
        # launched, not finished): LAST_SAMPLED is valid, its value is in the core's
        # device table of last tokens. At most one of pending / inflight is set.
        self.inflight = False
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
    from_device: bool = False  # ids[0] is LAST_SAMPLED of a sample still on the device


class Plan(NamedTuple):
    """A checked batch (plan_batch's result)."""

    entries: list[Entry]
    opened: dict[int, Row]  # rows this batch opens
    input_ids: torch.Tensor  # [T] int64, host: the entries' resolved ids, flattened
    new_pages: torch.Tensor  # [P] int64, host: the batch's new_pages
    prefix_pages: dict[int, torch.Tensor]  # opened row -> its prefix pages (int64, host)


VECTOR_MIN_LEN = 64  # lists at least this long are range-checked on their tensor


def _outside(values: list[int], t: torch.Tensor, hi: int) -> bool:
    """Whether an item of `values` (whose int64 tensor is `t`) lies outside [0, hi):
    Python's min and max for a short list; torch.aminmax for a long one (8k items:
    ~10 us against ~0.4 ms)."""
    if len(values) < VECTOR_MIN_LEN:
        return bool(values) and (min(values) < 0 or max(values) >= hi)
    lo, up = torch.aminmax(t)
    return int(lo) < 0 or int(up) >= hi


class StepFailed(ValueError):
    """A ForwardBatch that cannot run; the message says why."""


def plan_batch(b: ForwardBatch, rows: dict[int, Row], g: Geometry,
               grammars: Callable[[str], TokenFsm] | None = None) -> Plan:  # fmt: skip
    """The batch's Plan, or StepFailed; see the module docstring."""
    n = len(b.rows)
    for name in ("num_new_tokens", "start_pos", "num_new_pages", "sample"):
        if len(getattr(b, name)) != n:
            raise StepFailed(f"{name} has {len(getattr(b, name))} items for {n} entries")
    if sum(b.num_new_tokens) != len(b.input_ids):
        raise StepFailed(f"{len(b.input_ids)} input ids for {sum(b.num_new_tokens)} new tokens")
    if sum(b.num_new_pages) != len(b.new_pages):
        raise StepFailed(f"{len(b.new_pages)} new pages for {sum(b.num_new_pages)} declared")
    new_pages = long_tensor(b.new_pages)
    if _outside(b.new_pages, new_pages, g.num_pages):
        raise StepFailed(f"a new page is outside [0, {g.num_pages})")
    closed = set(b.closes)
    opened: dict[int, Row] = {}
    prefix_pages: dict[int, torch.Tensor] = {}
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
        if o.prefix_pages:
            prefix_pages[o.row_idx] = long_tensor(o.prefix_pages)
        if o.prefix_pages and _outside(o.prefix_pages, prefix_pages[o.row_idx], g.num_pages):
            raise StepFailed(f"row {o.row_idx}: a prefix page is outside [0, {g.num_pages})")
        if o.num_output_tokens < 0:
            raise StepFailed(f"row {o.row_idx}: num_output_tokens {o.num_output_tokens} < 0")
        if len(o.prefix_token_ids) > o.num_prefix_tokens:
            raise StepFailed(f"row {o.row_idx}: more prefix token ids than prefix tokens")
        if (why := validate_params(o.sampling, g.vocab_size)) is not None:
            raise StepFailed(f"row {o.row_idx} ({o.request_id}): {why}")
        grammar = None
        if o.sampling.regex:
            if grammars is None:
                raise StepFailed(f"row {o.row_idx} ({o.request_id}): no token texts here for "
                                 "a regex constraint")  # fmt: skip
            try:
                grammar = grammars(o.sampling.regex)
            except ValueError as e:
                raise StepFailed(f"row {o.row_idx} ({o.request_id}): {e}") from None
        sampling = RowSampling(o.sampling, o.seed, g.eos_token_ids, grammar)
        opened[o.row_idx] = Row(o.num_prefix_tokens, len(o.prefix_pages), sampling)

    input_ids = long_tensor(b.input_ids)
    resolved: list[tuple[int, int]] = []  # (token index, pending sample) for LAST_SAMPLED
    entries: list[Entry] = []
    seen_rows: set[int] = set()
    pos = 0
    for i, row_idx in enumerate(b.rows):
        num_new = b.num_new_tokens[i]
        at = pos
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
        from_device = False
        skip = int(ids[0] == LAST_SAMPLED)  # range-checked below as what it resolves to
        if skip:
            if row.pending is not None:
                ids = [row.pending, *ids[1:]]
                resolved.append((at, row.pending))
            elif row.inflight:
                from_device = True
            else:
                raise StepFailed(
                    f"entry {i}: LAST_SAMPLED for row {row_idx}, which has no pending sample"
                )
        known = ids[skip:]
        if _outside(known, input_ids[at + skip : at + num_new], g.vocab_size) or (
            skip and not from_device and not 0 <= ids[0] < g.vocab_size
        ):
            raise StepFailed(
                f"entry {i}: input id outside [0, {g.vocab_size})"
                + (" (LAST_SAMPLED is only valid first)" if LAST_SAMPLED in known else "")
            )
        start_lp = row.sampling.params.logprob_start_len
        lp_from = max(start_lp, row.num_tokens) if start_lp >= 0 and not row.has_sampled else -1
        entries.append(
            Entry(row_idx, row.num_tokens, ids, row.num_pages, b.sample[i], lp_from, from_device)
        )  # fmt: skip
    if resolved:
        at, pending = zip(*resolved, strict=True)
        input_ids[long_tensor(at)] = long_tensor(pending)
    return Plan(entries, opened, input_ids, new_pages, prefix_pages)


def first_lp_pos(e: Entry) -> int:
    """First position whose logits a prompt-logprob entry needs (the last one always)."""
    return min(max(e.start, e.prompt_lp_from - 1), e.start + len(e.ids) - 1)


class LogitsLayout(NamedTuple):
    """Which logits a planned batch's forward returns, and who reads them."""

    indices: list[int]  # token-axis rows (of the flat new tokens) to compute logits for
    sample_rows: list[int]  # rows that sample, in batch order
    sample_at: list[int]  # each sampling row's row in the returned logits
    prompt_at: list[tuple[Entry, int, int]]  # prompt-logprob entries: [lo, hi) of logits


def logits_layout(entries: list[Entry]) -> LogitsLayout:
    """The last token of every sampling entry; every token from first_lp_pos on for
    entries that report prompt logprobs (their last one also serves the sample)."""
    out = LogitsLayout([], [], [], [])
    tok = 0  # offset of the entry's first new token
    for e in entries:
        n = len(e.ids)
        if e.prompt_lp_from >= 0:
            lo = len(out.indices)
            out.indices.extend(range(tok + first_lp_pos(e) - e.start, tok + n))
            out.prompt_at.append((e, lo, len(out.indices)))
        elif e.sample:
            out.indices.append(tok + n - 1)
        if e.sample:
            out.sample_rows.append(e.row_idx)
            out.sample_at.append(len(out.indices) - 1)
        tok += n
    return out


class PromptScores(NamedTuple):
    """One entry's prompt logprobs on the logits' device: `chosen` [n] float32; when
    the row asks for top_logprobs_num k > 0 the k most likely tokens of each position,
    `top_vals` [n, k] float32 and `top_ids` [n, k] int64; when it names
    token_ids_logprob, those L ids (`id_list` [L] int64, on the host) and their
    logprobs at each position (`id_vals` [n, L]). A position nothing scored (position
    0, a prefix that came from the cache) is NaN throughout."""

    chosen: torch.Tensor
    top_vals: torch.Tensor | None
    top_ids: torch.Tensor | None
    id_list: torch.Tensor | None = None
    id_vals: torch.Tensor | None = None


def prompt_logprobs(e: Entry, row: Row, logits: torch.Tensor) -> PromptScores:
    """The prompt scores of this entry's tokens at positions max(prompt_lp_from,
    start) .. end - 1.

    logits: [k, V] float32 at positions first_lp_pos(e) .. end - 1; logits at
    position p score the token at p + 1. The entry's first token is scored by the
    previous chunk's last logits when this row computed them (kept in row.prompt_lp),
    else NaN (position 0, or a prefix that came from the cache). Updates row.prompt_lp."""
    end = e.start + len(e.ids)
    lo = max(e.prompt_lp_from, e.start)
    k = min(row.sampling.params.top_logprobs_num, logits.shape[-1])
    parts: list[tuple[torch.Tensor, list[int]]] = []  # ([m, V] logprobs, the m next ids)
    if lo == e.start < end:
        first = row.prompt_lp
        if first is None:
            first = torch.full((logits.shape[-1],), math.nan, device=logits.device)
        parts.append((first.unsqueeze(0), e.ids[:1]))
    q0 = max(lo, e.start + 1)  # first position scored by this entry's own logits
    if q0 < end:
        first_pos = first_lp_pos(e)
        scored = logits[q0 - 1 - first_pos : end - 1 - first_pos]  # [end - q0, V]
        parts.append((torch.log_softmax(scored, dim=-1), e.ids[q0 - e.start :]))
    # Keep the last position's distribution for the next chunk (a sample ends the prompt).
    row.prompt_lp = None if e.sample else torch.log_softmax(logits[-1], dim=-1)
    asked = row.sampling.params.token_ids_logprob
    id_list = torch.tensor(asked, dtype=torch.int64) if asked else None
    id_dev = None if id_list is None else to_device(id_list, logits.device)
    chosen, vals, ids, id_vals = [], [], [], []
    for lp, nxt in parts:
        idx = to_device(torch.tensor(nxt, dtype=torch.int64), lp.device)  # no device wait
        chosen.append(lp.gather(1, idx.unsqueeze(1)).squeeze(1))
        if k > 0:
            v, i = lp.topk(k, dim=-1)
            vals.append(v), ids.append(i)
        if id_dev is not None:
            id_vals.append(lp.index_select(1, id_dev))
    if not parts:
        return PromptScores(logits.new_empty(0), None, None)
    return PromptScores(torch.cat(chosen), torch.cat(vals) if k > 0 else None,
                        torch.cat(ids) if k > 0 else None, id_list,
                        torch.cat(id_vals) if id_vals else None)  # fmt: skip


def scores_to_host(s: PromptScores, non_blocking: bool) -> PromptScores:
    return PromptScores(*(None if t is None else t.to("cpu", non_blocking=non_blocking)
                          for t in s))  # fmt: skip


def top_lists(s: PromptScores) -> list[list[TopLogprob]] | None:
    """Host PromptScores -> each position's top tokens, then its token_ids_logprob ids
    ([] where nothing scored it); None when the row asked for neither."""
    if s.top_ids is None and s.id_vals is None:
        return None
    n = len(s.chosen)
    tops = (zip(s.top_ids.tolist(), s.top_vals.tolist()) if s.top_ids is not None
            else [((), ())] * n)  # fmt: skip
    asked = [] if s.id_list is None else s.id_list.tolist()
    id_vals = [[]] * n if s.id_vals is None else s.id_vals.tolist()
    return [[] if c != c else [TopLogprob(t, v) for t, v in with_ids(list(zip(*top)), asked, r)]
            for c, top, r in zip(s.chosen.tolist(), tops, id_vals)]  # fmt: skip
