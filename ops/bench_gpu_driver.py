"""Driving an ExecutorCore without a scheduler: rows, pages and an offline batcher.

Theory of operation: `Driver` plays the scheduler's part for benchmarks. It keeps free
lists of rows and KV pages, turns entries (a row and its new tokens, or LAST_SAMPLED
for a decode) into ForwardBatch messages with the row opens, page appends and closes
the core expects, and returns each sampling row's token. `offline_run` is a continuous
batcher on top: prefill first (within a token budget per step, long prompts chunked),
else decode every running request; finished requests close and free their rows.

Invariants
    - A page is held by at most one open row; a closed row's pages return to the free
      list and its close reaches the core in the next batch, before any entry that
      reuses them (the core applies closes first).
    - offline_run admits a request only when pages for its whole prompt + output are
      free beyond those promised to admitted requests, so nothing is ever retracted;
      every request ends with exactly `output_len` tokens.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from shunter.actors.executor.core import ExecutorCore
from shunter.bus.messages import LAST_SAMPLED, ForwardBatch, RowOpen, SamplingParams, StepResult

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=1 << 30)


@dataclass
class Entry:
    row: int
    input_ids: list[int]  # new tokens, or [LAST_SAMPLED] for a decode
    sample: bool = True


@dataclass
class Driver:
    """Hands ForwardBatches to an ExecutorCore with rows and pages from free lists."""

    core: ExecutorCore
    params: SamplingParams = GREEDY  # every row's
    step_id: int = 0
    row_len: dict[int, int] = field(default_factory=dict)  # open row -> tokens with KV
    row_pages: dict[int, list[int]] = field(default_factory=dict)
    free_pages: list[int] = field(default_factory=list)
    free_rows: list[int] = field(default_factory=list)
    pending_closes: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.free_pages = list(range(self.core.num_pages - 1, -1, -1))  # pop() gives 0 first
        self.free_rows = list(range(self.core.max_num_rows - 1, -1, -1))
        self.page_size = self.core.page_size

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def open_row(self) -> int:
        row = self.free_rows.pop()
        self.row_len[row], self.row_pages[row] = 0, []
        return row

    def close(self, rows: list[int]) -> None:
        for r in rows:
            self.free_pages += reversed(self.row_pages.pop(r))
            del self.row_len[r]
            self.free_rows.append(r)
        self.pending_closes += rows

    def close_all(self) -> None:
        self.close(list(self.row_len))

    def step(self, entries: list[Entry]) -> dict[int, int]:
        """Run one batch; returns row -> sampled token for the sampling entries."""
        res = self.core.step(self._batch(entries))
        return _tokens(res)

    def decode_overlapped(self, rows: list[int], steps: int) -> list[list[int]]:
        """`steps` decode steps of `rows` submitted back to back as the overlap scheduler
        sends them (step N+1 goes in before step N's tokens are read); per row, its
        tokens."""
        out: list[list[int]] = [[] for _ in rows]
        results = []
        for _ in range(steps):
            results += self.core.submit(self._batch([Entry(r, [LAST_SAMPLED]) for r in rows]))
        results += self.core.flush()
        for res in results:
            got = _tokens(res)
            for seq, r in zip(out, rows, strict=True):
                seq.append(got[r])
        return out

    def _take_pages(self, n: int) -> list[int]:
        """The next n free pages, in pop() order (a slice: an 8k-token prompt at page
        size 1 takes 8192 of them, and the prefill's clock runs meanwhile)."""
        free = self.free_pages
        if n > len(free):
            raise RuntimeError(f"bench driver: {n} pages needed, {len(free)} free")
        cut = len(free) - n
        pages = free[cut:][::-1]
        del free[cut:]
        return pages

    def _batch(self, entries: list[Entry]) -> ForwardBatch:
        opens, rows, nums, starts, ids, new_pages, num_new_pages = [], [], [], [], [], [], []
        for e in entries:
            start = self.row_len[e.row]
            if start == 0:
                opens.append(RowOpen(e.row, f"bench-{e.row}", [], 0, self.params, e.row))
            need = self.pages_needed(start + len(e.input_ids)) - len(self.row_pages[e.row])
            pages = self._take_pages(need)
            self.row_pages[e.row] += pages
            self.row_len[e.row] = start + len(e.input_ids)
            rows.append(e.row), nums.append(len(e.input_ids)), starts.append(start)
            ids += e.input_ids
            new_pages += pages
            num_new_pages.append(need)
        batch = ForwardBatch(
            step_id=self.step_id, opens=opens, closes=self.pending_closes, rows=rows,
            num_new_tokens=nums, start_pos=starts, input_ids=ids, new_pages=new_pages,
            num_new_pages=num_new_pages, sample=[e.sample for e in entries],
        )  # fmt: skip
        self.pending_closes = []
        self.step_id += 1
        return batch

    def prefill(self, prompts: list[list[int]], token_budget: int) -> tuple[list[int], list[int]]:
        """Open a row per prompt and compute the prompts in batches of at most
        `token_budget` tokens (a long prompt in chunks); (rows, first sampled tokens)."""
        rows = [self.open_row() for _ in prompts]
        todo = deque(zip(rows, prompts, strict=True))
        first: dict[int, int] = {}
        while todo:
            entries, budget = [], token_budget
            while todo and budget > 0:
                row, prompt = todo[0]
                done = self.row_len[row]
                chunk = prompt[done : done + budget]
                last = done + len(chunk) == len(prompt)
                entries.append(Entry(row, chunk, sample=last))
                budget -= len(chunk)
                if last:
                    todo.popleft()
                else:
                    break  # the rest of this prompt goes in the next batch
            first.update(self.step(entries))
        return rows, [first[r] for r in rows]

    def decode(self, rows: list[int]) -> list[int]:
        out = self.step([Entry(r, [LAST_SAMPLED]) for r in rows])
        return [out[r] for r in rows]


def _tokens(res: StepResult) -> dict[int, int]:
    if res.error is not None:
        raise RuntimeError(f"benchmark batch {res.step_id} failed: {res.error}")
    return dict(zip(res.rows, res.token_ids, strict=True))


@dataclass
class OfflineResult:
    outputs: list[list[int]]  # per request, its generated tokens
    num_steps: int
    elapsed_s: float


def offline_run(
    driver: Driver, prompts: list[list[int]], output_len: int, token_budget: int,
    max_running: int, progress: bool = False,
) -> OfflineResult:  # fmt: skip
    """Generate `output_len` greedy tokens for every prompt with continuous batching:
    each step is a prefill of admitted requests (up to `token_budget` tokens; a request
    is admitted while a row and pages for its prompt + output are free) or else a decode
    of every running request; a request's first token comes from its prefill."""
    waiting = deque(range(len(prompts)))
    prefilling: deque[tuple[int, int]] = deque()  # (request, row), prompt not all computed
    running: dict[int, int] = {}  # row -> request
    reserve: dict[int, int] = {}  # admitted row -> pages its prompt + output need in all
    outputs: list[list[int]] = [[] for _ in prompts]
    bar = tqdm(total=len(prompts) * output_len, desc="offline", unit="tok", disable=not progress,
               file=sys.stderr, leave=False)  # fmt: skip
    num_steps = 0
    sync(driver)
    t0 = time.perf_counter()
    while waiting or prefilling or running:
        promised = sum(n - len(driver.row_pages[r]) for r, n in reserve.items())
        while waiting and len(reserve) < max_running and driver.free_rows:
            need = driver.pages_needed(len(prompts[waiting[0]]) + output_len)
            if len(driver.free_pages) - promised < need:
                break
            row = driver.open_row()
            reserve[row], promised = need, promised + need
            prefilling.append((waiting.popleft(), row))
        if not prefilling and not running:
            raise RuntimeError("offline: a request needs more pages than the KV pool holds")
        new = _prefill_step(driver, prompts, prefilling, running, token_budget, outputs)
        if new is None:  # nothing to prefill: decode every running request
            rows = list(running)
            for row, tok in zip(rows, driver.decode(rows), strict=True):
                outputs[running[row]].append(tok)
            new = len(rows)
        num_steps += 1
        bar.update(new)
        finished = [r for r, q in running.items() if len(outputs[q]) >= output_len]
        for row in finished:
            del running[row], reserve[row]
        driver.close(finished)
    sync(driver)
    bar.close()
    return OfflineResult(outputs, num_steps, time.perf_counter() - t0)


def _prefill_step(
    driver: Driver, prompts: list[list[int]], prefilling: deque[tuple[int, int]],
    running: dict[int, int], token_budget: int, outputs: list[list[int]],
) -> int | None:  # fmt: skip
    """One prefill batch of the requests in `prefilling` (in order, within the budget);
    finished prompts move to `running` with their first token. Returns the number of
    tokens sampled, or None when nothing was prefilling (no batch ran)."""
    if not prefilling:
        return None
    entries, budget, done = [], token_budget, []
    for req, row in prefilling:
        have = driver.row_len[row]
        chunk = prompts[req][have : have + budget]
        last = have + len(chunk) == len(prompts[req])
        entries.append(Entry(row, chunk, sample=last))
        if last:
            done.append((req, row))
        budget -= len(chunk)
        if budget <= 0:
            break
    sampled = driver.step(entries)
    for req, row in done:
        prefilling.remove((req, row))
        running[row] = req
        outputs[req].append(sampled[row])
    return len(done)


def sync(driver: Driver) -> None:
    dev = driver.core.runner.device
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()
