"""Building one ForwardBatch: row opens plus columnar entries, and what the core keeps
of it until its StepResult arrives.

An entry is one running request's work in a step: `num_new` tokens starting at KV
position `start_pos`, the pages appended for them, and whether a token is sampled
(False only for a non-final prefill chunk). Decode entries feed LAST_SAMPLED: the
executor substitutes the token the row sampled last, so a decode step's plan does not
depend on the previous step's result (what overlap scheduling needs).
"""

from __future__ import annotations

from shunter.actors.scheduler.req import Req
from shunter.bus.messages import LAST_SAMPLED, ForwardBatch, RowOpen


class InFlight:
    """A sent batch awaiting its StepResult: (request, num_new, sample) per prefill
    entry, the decoding requests (entries after those, one sampled token each), and the
    rows that sample, in order (what the result's rows must be)."""

    __slots__ = ("decodes", "entries", "num_sampling", "sampling_rows", "step_id")

    def __init__(
        self, step_id: int, batch: ForwardBatch, entries: list, decodes: list[Req]
    ) -> None:
        self.step_id = step_id
        self.entries = entries
        self.decodes = decodes
        self.sampling_rows = [r for r, s in zip(batch.rows, batch.sample) if s]
        self.num_sampling = len(self.sampling_rows)


class BatchBuilder:
    __slots__ = ("decodes", "entries", "input_ids", "new_pages", "num_new_pages", "num_new_tokens",
                 "opens", "rows", "sample", "start_pos")  # fmt: skip

    def __init__(self) -> None:
        self.opens: list[RowOpen] = []
        self.rows: list[int] = []
        self.num_new_tokens: list[int] = []
        self.start_pos: list[int] = []
        self.input_ids: list[int] = []
        self.new_pages: list[int] = []
        self.num_new_pages: list[int] = []
        self.sample: list[bool] = []
        self.entries: list[tuple[Req, int, bool]] = []  # prefill pieces
        self.decodes: list[Req] = []  # decode entries, after the prefill pieces

    def __len__(self) -> int:
        return len(self.entries) + len(self.decodes)

    def add_extend(self, req: Req, num_new: int, new_pages: list[int], sample: bool) -> None:
        """Prefill (or re-prefill after retraction) of all_ids[num_planned : +num_new]."""
        start = req.num_planned
        req.num_planned = start + num_new
        req.num_inflight += 1
        if sample:
            req.sample_planned = True
            req.inflight_samples += 1
        self.rows.append(req.row)
        self.num_new_tokens.append(num_new)
        self.start_pos.append(start)
        self.input_ids.extend(req.all_ids[start : start + num_new])
        self.new_pages.extend(new_pages)
        self.num_new_pages.append(len(new_pages))
        self.sample.append(sample)
        self.entries.append((req, num_new, sample))

    def add_decodes(self, reqs: list[Req], pool_pages: list[int], page_size: int) -> int:
        """One token for each request, from LAST_SAMPLED; a request whose next position
        starts a page gets one from the end of pool_pages. Returns pages drawn."""
        n = len(reqs)
        starts = [r.num_planned for r in reqs]
        self.rows += [r.row for r in reqs]
        self.num_new_tokens += [1] * n
        self.start_pos += starts
        self.input_ids += [LAST_SAMPLED] * n
        self.sample += [True] * n
        self.decodes += reqs
        new_pages = self.new_pages
        counts = self.num_new_pages
        if page_size == 1:  # every decode starts a page: draw them in one slice
            taken = pool_pages[len(pool_pages) - n :]
            del pool_pages[len(pool_pages) - n :]
            for r, page in zip(reqs, taken):
                r.pages.append(page)
                r.num_planned += 1
                r.num_inflight += 1
                r.inflight_samples += 1
            new_pages += taken
            counts += [1] * n
            return n
        drawn = 0
        for r, start in zip(reqs, starts):
            r.num_planned += 1
            r.num_inflight += 1
            r.inflight_samples += 1
            pages = r.pages
            if start >= len(pages) * page_size:
                page = pool_pages.pop()
                pages.append(page)
                new_pages.append(page)
                counts.append(1)
                drawn += 1
            else:
                counts.append(0)
        return drawn

    def build(self, step_id: int, closes: list[int], version: int) -> ForwardBatch:
        return ForwardBatch(
            step_id=step_id,
            opens=self.opens,
            closes=closes,
            rows=self.rows,
            num_new_tokens=self.num_new_tokens,
            start_pos=self.start_pos,
            input_ids=self.input_ids,
            new_pages=self.new_pages,
            num_new_pages=self.num_new_pages,
            sample=self.sample,
            version=version,
        )
