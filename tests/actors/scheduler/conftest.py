"""Shared helpers for the scheduler core tests (test_core_*.py): the core on its own,
messages in, messages out, no event loop.

The cache manager's side is played by hand here (Matched, LeaseGranted built in the
test), which is what the core's contract is written against; test_cluster.py runs it
with the real cache manager core. The test modules import these helpers by name.
"""

from __future__ import annotations

from shunter.actors.scheduler.config import SchedulerConfig
from shunter.actors.scheduler.core import SchedulerCore
from shunter.bus.messages import (
    ForwardBatch,
    LeaseGranted,
    LeaseRequest,
    Matched,
    SamplingParams,
    StepResult,
    Tokenized,
    TokensOut,
)


def matched(rid, ids, *, cached=0, pages=(), version=0, max_new=4, priority=0, **sp):
    sampling = SamplingParams(max_new_tokens=max_new, **sp)
    t = Tokenized(rid, list(ids), sampling, priority=priority)
    return Matched(t, cached, list(pages), version)


class Feeder:
    """Drives a SchedulerCore by hand: grants every lease from a page counter (unless
    told to grant fewer) and answers batches with chosen tokens."""

    def __init__(self, **cfg):
        cfg.setdefault("lease_min_pages", 1)
        self.core = SchedulerCore(SchedulerConfig(**cfg))
        self.next_page = 1000
        self.grant_queue: list[int] = []  # sizes of the next grants; then in full
        self.short_awaits_backup = False  # short grants say a backup to the host holds pages
        self.log: list = []

    def send(self, msg):
        out = self.core.handle(msg)
        self.log.extend(out)
        for m in list(out):
            if isinstance(m, LeaseRequest):
                n = min(m.num_pages, self.grant_queue.pop(0)) if self.grant_queue else m.num_pages
                pages = list(range(self.next_page, self.next_page + n))
                self.next_page += n
                short = self.short_awaits_backup and n < m.num_pages
                out += self.send(LeaseGranted(m.lease_seq, pages, 0, short))
        return out

    @staticmethod
    def batch(out) -> ForwardBatch | None:
        bs = [m for m in out if isinstance(m, ForwardBatch)]
        assert len(bs) <= 1
        return bs[0] if bs else None

    def step(self, batch: ForwardBatch, token=7, tokens=None):
        rows = [r for r, s in zip(batch.rows, batch.sample) if s]
        toks = tokens if tokens is not None else [token] * len(rows)
        return self.send(StepResult(batch.step_id, rows, toks))


def outputs(out):
    return [o for m in out if isinstance(m, TokensOut) for o in m.outputs]


def of(out, cls):
    return [m for m in out if isinstance(m, cls)]


def admitted(batch: ForwardBatch) -> list[str]:
    return [o.request_id for o in batch.opens]
