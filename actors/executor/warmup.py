"""Warm-up: the attention paths' first uses, run before the executor says it is ready.

Theory of operation: some kernels are built on first use. flashinfer compiles each
wrapper variant just in time (about a minute and a half on a cold cache for a prefill
variant), and the runner picks the variant from the step's shape (runner.py,
`_flashinfer_context`): "prefill" when every entry's KV is all new, "extend" when
some entry attends cached KV (a chunk after the first, a cached prefix, or a prefill
in the same step as a decode), "decode" when every entry computes one token. A
server that said ready before building them stalls the first request that needs one,
for as long as the build takes: the first mixed step of a lightly loaded server.
The Triton kernels are built per shape class too (kernels/attention_*_triton.py): the
extend kernels by the step's new tokens per entry (at most SPLIT_MAX_NEW_TOKENS: the
GQA-packed split kernel, one split or several with their merge; more: the per-head
kernel), the decode kernel with one split or several (an entry past
MIN_KEYS_PER_SPLIT keys) and with the rope and store inside it or not (all-decode
steps, or decode entries beside extends). Each build takes a second or more, and a
build in a request holds every request in the engine for as long. So row 0's prompt is
LONG tokens: past both bounds, where the pool and the context allow.

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
# Row 0's prompt where room allows: more new tokens than the split extend kernel takes
# (64) and more keys than one split holds (256), so its decodes and extends take the
# kernels' split paths (the module docstring)
LONG = 320
PROMPT = 16  # tokens of row 1's prompt, and the least row 0's may be
EXTEND = 4  # tokens of the extend over a row's cached KV


def warmup_batches(g: Geometry) -> list[ForwardBatch]:
    """The warm-up steps (the last one only closes the rows), or [] when the pool or the
    context is too small for them: 1. row 0's prompt of up to LONG tokens (prefill);
    2. row 1's prompt runs while row 0 decodes (extend, mixed); 3. row 0 extends by
    EXTEND tokens, its sample first, while row 1 decodes (extend, mixed); 4. rows 0 and
    1 decode (decode). The prefill pieces come before the decodes, as the scheduler
    orders them. With one row, steps 2 and 3 are row 0's decode and extend alone."""
    ps = g.page_size
    two = g.max_num_rows >= 2
    pages1 = -(-(PROMPT + 2) // ps) if two else 0  # prompt, two decode inputs
    # row 0: prompt, its sample, an extend, a decode input
    room = min((g.num_pages - pages1) * ps, g.max_context_len) - 2 - EXTEND
    prompt0 = min(LONG, room)
    if prompt0 < PROMPT:
        return []
    ids = [1 + i % (g.vocab_size - 1) for i in range(prompt0 + EXTEND - 1)]
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

    extend0 = (0, [LAST_SAMPLED, *ids[prompt0:]])
    out = [batch(0, [open_(0)], [(0, ids[:prompt0])])]
    if two:
        out.append(batch(1, [open_(1)], [(1, ids[:PROMPT]), (0, [LAST_SAMPLED])]))
        out.append(batch(2, [], [extend0, (1, [LAST_SAMPLED])]))
    else:
        out.append(batch(1, [], [(0, [LAST_SAMPLED])]))
        out.append(batch(2, [], [extend0]))
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
