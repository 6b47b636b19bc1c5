"""Warm-up: the attention paths' first uses, run before the executor says it is ready.

Theory of operation: some kernels are built on first use. flashinfer compiles each
wrapper variant just in time (about a minute and a half on a cold cache for a prefill
variant), and the runner picks the variant from the step's shape (runner.py,
`_flashinfer_context`): "prefill" when every entry's KV is all new, "extend" when
some entry attends cached KV (a chunk after the first, a cached prefix, or a prefill
in the same step as a decode), "decode" when every entry computes one token. A
server that said ready before building them stalls the first request that needs one,
for as long as the build takes: the first mixed step of a lightly loaded server.
`warmup_batches` is the script that takes every path once through the real core,
on two rows and the first pages of the pool; `warm_up` runs it, closes the rows and
zeroes the core's counters. Decode batches wider than the captured graphs take
flashinfer's decode wrapper, which this script does not reach (it would take that
many rows); a cold cache builds it on the first such batch.

Invariants: the core ends with no open row and no step in flight; the pages written
hold garbage that nothing reads (the cache manager owns every page, and a row's KV
is written before it is read). Pure batch construction (no clock, env or RNG).
"""

from __future__ import annotations

from shunter.actors.executor.core import ExecutorCore
from shunter.actors.executor.core_plan import Geometry
from shunter.bus.messages import LAST_SAMPLED, ForwardBatch, RowOpen, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=1 << 20)
PROMPT = 16  # tokens of each warm-up prompt
EXTEND = 4  # tokens of the extend over a row's cached KV


def warmup_batches(g: Geometry) -> list[ForwardBatch]:
    """The warm-up steps (the last one only closes the rows), or [] when the pool or the
    context is too small for them: 1. row 0's prompt (prefill); 2. row 0 decodes
    while row 1's prompt runs (extend, mixed); 3. row 0 extends by EXTEND tokens, its
    sample first (extend); 4. rows 0 and 1 decode (decode). With one row, step 2 is
    row 0's decode alone."""
    ps = g.page_size
    two = g.max_num_rows >= 2
    row0_len = PROMPT + 2 + EXTEND  # prompt, its sample, an extend, a decode input
    pages0 = -(-row0_len // ps)
    pages1 = -(-(PROMPT + 1) // ps) if two else 0
    if row0_len > g.max_context_len or pages0 + pages1 > g.num_pages:
        return []
    ids = [1 + i % (g.vocab_size - 1) for i in range(PROMPT + EXTEND - 1)]
    free = iter(range(g.num_pages))
    lens = {0: 0, 1: 0}  # tokens each row holds so far

    def grow(row: int, new: int) -> list[int]:  # pages the row needs for `new` more tokens
        held = -(-lens[row] // ps)
        lens[row] += new
        return [next(free) for _ in range(-(-lens[row] // ps) - held)]

    def batch(step: int, opens: list[RowOpen], entries: list[tuple[int, list[int]]]):
        rows, nums, starts, flat, pages, num_pages_ = [], [], [], [], [], []
        for row, inp in entries:
            starts.append(lens[row])
            new = grow(row, len(inp))
            rows.append(row), nums.append(len(inp)), flat.extend(inp)
            pages += new
            num_pages_.append(len(new))
        return ForwardBatch(step_id=step, opens=opens, rows=rows, num_new_tokens=nums,
                            start_pos=starts, input_ids=flat, new_pages=pages,
                            num_new_pages=num_pages_, sample=[True] * len(rows))  # fmt: skip

    def open_(row: int) -> RowOpen:
        return RowOpen(row, f"warmup-{row}", [], 0, GREEDY, 0)

    out = [batch(0, [open_(0)], [(0, ids[:PROMPT])])]
    if two:
        out.append(batch(1, [open_(1)], [(0, [LAST_SAMPLED]), (1, ids[:PROMPT])]))
    else:
        out.append(batch(1, [], [(0, [LAST_SAMPLED])]))
    out.append(batch(2, [], [(0, [LAST_SAMPLED, *ids[PROMPT:]])]))
    out.append(batch(3, [], [(0, [LAST_SAMPLED])] + ([(1, [LAST_SAMPLED])] if two else [])))
    out.append(ForwardBatch(step_id=4, closes=[0, 1] if two else [0]))
    return out


def warm_up(core: ExecutorCore) -> int:
    """Run the warm-up steps on `core` (which must have no open row); returns how many
    ran. RuntimeError if one failed: the paths a server needs do not work."""
    if core.open_rows():
        raise RuntimeError("warm-up needs an executor with no open row")
    batches = warmup_batches(core.geometry)
    for b in batches:
        res = core.step(b)
        if res.error is not None:
            raise RuntimeError(f"warm-up step {b.step_id} failed: {res.error}")
    core.reset_statistics()
    return len(batches)
