"""The scheduler and cache manager cores wired together, with a model-free executor.

`SimExecutor` answers ForwardBatch as an executor would, minus the model: it keeps the
row mirror the batch diffs describe and a KV "content" model (which token each slot
holds), and samples tokens from a deterministic hash of (request, position). It checks
the protocol as it goes: opens/closes of unknown or live rows, start positions that do
not continue the row, LAST_SAMPLED with nothing sampled, tokens written past a row's
pages, a cached prefix whose slots do not hold the prefix's tokens, and a write into a
slot another live row still reads. A violation raises `ProtocolError`. With a host KV
tier it also copies pages (SpillPages / LoadPages, in order with the batches, as the
executor does) between that content model and a host one; a row that computes again
after a load wrote into a page it reads is a violation (a row whose close is still to
come may hold such a page: it reads nothing more).

`Cluster` routes messages between the two real cores and the simulated executor through
queues; `pump_*` methods deliver one queue's next message, so a test can interleave
deliveries in any order (a grant arriving late, an abort racing a step). Used by the
scheduler tests and by `shunter bench scheduler`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from shunter.actors.cache_manager.config import CacheConfig
from shunter.actors.cache_manager.core import CacheManagerCore
from shunter.actors.scheduler.config import SchedulerConfig
from shunter.actors.scheduler.core import SchedulerCore
from shunter.bus.messages import (
    LAST_SAMPLED,
    AbortRequest,
    BlocksErased,
    Census,
    CensusBroken,
    ChunkCached,
    ClearStore,
    EraseBlocks,
    FetchPages,
    ForwardBatch,
    FreeRefused,
    LeaseGranted,
    LeaseRequest,
    LeaseReturned,
    LoadPages,
    Matched,
    Msg,
    PagesEvictable,
    PagesFetched,
    PagesLoaded,
    PagesSpilled,
    PagesStored,
    RefreshMatch,
    RequestFailed,
    RequestOutput,
    SchedulerCensus,
    SequenceReleased,
    SpillPages,
    StepResult,
    StoreCleared,
    StorePages,
    Tokenized,
    TokensOut,
)

_M64 = (1 << 64) - 1


def mix64(*parts: int) -> int:
    """A deterministic 64-bit hash of integers (splitmix64 finalizer over a fold)."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (p & _M64)) * 0xBF58476D1CE4E5B9 & _M64
        h ^= h >> 31
    return h


class ProtocolError(AssertionError):
    pass


class _Row:
    __slots__ = ("last_sampled", "num_tokens", "pages", "request_id", "tokens")

    def __init__(self, request_id: str, pages: list[int], tokens: list[int]) -> None:
        self.request_id = request_id
        self.pages = pages
        self.tokens = tokens  # token at each computed position
        self.num_tokens = len(tokens)
        self.last_sampled: int | None = None


TokenFn = Callable[[str, int], int]  # (request_id, position of the new token) -> token id


class SimExecutor:
    def __init__(
        self, page_size: int, num_pages: int, token_fn: TokenFn, *, check_kv: bool = True
    ) -> None:
        self.page_size = page_size
        self.num_pages = num_pages
        self.token_fn = token_fn
        self.check_kv = check_kv
        self.rows: dict[int, _Row] = {}
        self.kv: dict[int, int] = {}  # slot -> token id written there
        self.readers: dict[int, set[int]] = {}  # page -> live rows whose table holds it
        self.host_kv: dict[int, int | None] = {}  # host slot -> token id a spill put there
        self.store: dict[int, list[int | None]] = {}  # file store: key -> its slots' tokens
        self.block_pages = 0  # pages per file store block (set by Cluster)
        self.fail_copies = 0  # > 0: about one copy in this many fails (changing nothing)
        self.clobbered: dict[int, int] = {}  # row -> a page of its a load wrote into
        self.num_steps = 0
        self.num_copies = 0
        self.num_missing_blocks = 0  # reads of a block the store does not hold

    def _fail(self, why: str) -> None:
        raise ProtocolError(why)

    def copy(self, m: SpillPages | LoadPages | StorePages | FetchPages | EraseBlocks
             ) -> PagesSpilled | PagesLoaded | PagesStored | PagesFetched | BlocksErased:  # fmt: skip
        """A host-tier copy, page for page, every slot of each page; or a file store
        write, read or erase, block by block."""
        self.num_copies += 1
        ps = self.page_size
        if self.fail_copies and mix64(m.copy_id, 7) % self.fail_copies == 0:
            reply = {SpillPages: PagesSpilled, LoadPages: PagesLoaded, StorePages: PagesStored,
                     FetchPages: PagesFetched, EraseBlocks: BlocksErased}[type(m)]  # fmt: skip
            if isinstance(m, LoadPages):  # the device pages it was to write hold garbage
                for d in m.device_pages:
                    for o in range(ps):
                        self.kv.pop(d * ps + o, None)
            return reply(m.copy_id, m.keys, ok=False, error="injected")
        if isinstance(m, StorePages | FetchPages | EraseBlocks):
            return self._store_copy(m)
        if isinstance(m, SpillPages):
            for d, h in zip(m.device_pages, m.host_pages, strict=True):
                for o in range(ps):
                    self.host_kv[h * ps + o] = self.kv.get(d * ps + o)
            return PagesSpilled(m.copy_id, m.keys)
        for h, d in zip(m.host_pages, m.device_pages, strict=True):
            for row in self.readers.get(d, ()):
                self.clobbered.setdefault(row, d)
            for o in range(ps):
                t = self.host_kv.get(h * ps + o)
                if t is None:
                    self.kv.pop(d * ps + o, None)
                else:
                    self.kv[d * ps + o] = t
        return PagesLoaded(m.copy_id, m.keys)

    def _store_copy(self, m: StorePages | FetchPages | EraseBlocks
                    ) -> PagesStored | PagesFetched | BlocksErased:  # fmt: skip
        ps, bp = self.page_size, self.block_pages
        if isinstance(m, EraseBlocks):
            for key in list(self.store) if m.everything else m.keys:
                self.store.pop(key, None)
            return BlocksErased(m.copy_id, m.keys)
        if isinstance(m, StorePages):
            for i, key in enumerate(m.keys):
                pages = m.host_pages[i * bp : (i + 1) * bp]
                self.store.setdefault(key, [self.host_kv.get(h * ps + o)
                                            for h in pages for o in range(ps)])  # fmt: skip
            return PagesStored(m.copy_id, m.keys)
        if any(k not in self.store for k in m.keys):  # (the cache manager knew it held them)
            self.num_missing_blocks += 1
            return PagesFetched(m.copy_id, m.keys, ok=False, error="no such block")
        slots = [t for k in m.keys for t in self.store[k]][m.skip * ps :]
        for i, h in enumerate(m.host_pages):
            for o in range(ps):
                self.host_kv[h * ps + o] = slots[i * ps + o]
        return PagesFetched(m.copy_id, m.keys)

    def handle(self, b: ForwardBatch) -> StepResult:
        self.num_steps += 1
        ps = self.page_size
        for row in b.closes:
            r = self.rows.pop(row, None)
            if r is None:
                self._fail(f"step {b.step_id}: close of row {row}, which is not open")
            self.clobbered.pop(row, None)
            for p in r.pages:
                self.readers[p].discard(row)
        for o in b.opens:
            if o.row_idx in self.rows:
                self._fail(f"step {b.step_id}: open of live row {o.row_idx}")
            if len(o.prefix_pages) * ps < o.num_prefix_tokens:
                self._fail(f"step {b.step_id}: row {o.row_idx} prefix pages too few")
            toks = list(o.prefix_token_ids)
            if len(toks) != o.num_prefix_tokens:
                self._fail(f"step {b.step_id}: prefix_token_ids length != num_prefix_tokens")
            if self.check_kv:
                for i, t in enumerate(toks):
                    slot = o.prefix_pages[i // ps] * ps + i % ps
                    if self.kv.get(slot) != t:
                        self._fail(
                            f"step {b.step_id}: {o.request_id} prefix slot {slot} (pos {i}) "
                            f"holds {self.kv.get(slot)}, expected {t}"
                        )
            self.rows[o.row_idx] = r = _Row(o.request_id, list(o.prefix_pages), toks)
            for p in r.pages:
                self.readers.setdefault(p, set()).add(o.row_idx)
        rows_out: list[int] = []
        tokens_out: list[int] = []
        at = 0
        page_at = 0
        for i, row in enumerate(b.rows):
            r = self.rows.get(row)
            if r is None:
                self._fail(f"step {b.step_id}: entry for row {row}, which is not open")
            if row in self.clobbered:
                self._fail(f"step {b.step_id}: row {row} ({r.request_id}) reads page "
                           f"{self.clobbered[row]}, which a load wrote into")  # fmt: skip
            n = b.num_new_tokens[i]
            if n < 1:
                self._fail(f"step {b.step_id}: row {row} computes {n} tokens")
            if b.start_pos[i] != r.num_tokens:
                self._fail(
                    f"step {b.step_id}: row {row} starts at {b.start_pos[i]}, has {r.num_tokens}"
                )
            new_pages = b.new_pages[page_at : page_at + b.num_new_pages[i]]
            page_at += b.num_new_pages[i]
            for p in new_pages:
                if not 0 <= p < self.num_pages:
                    self._fail(f"step {b.step_id}: page {p} out of range")
                self.readers.setdefault(p, set()).add(row)
            r.pages.extend(new_pages)
            ids = b.input_ids[at : at + n]
            at += n
            if LAST_SAMPLED in ids:
                if n != 1 or r.last_sampled is None:
                    self._fail(f"step {b.step_id}: row {row} LAST_SAMPLED with nothing sampled")
                ids = [r.last_sampled]
            if (r.num_tokens + n) > len(r.pages) * ps:
                self._fail(f"step {b.step_id}: row {row} writes past its pages")
            for t in ids:
                pos = r.num_tokens
                page = r.pages[pos // ps]
                slot = page * ps + pos % ps
                if self.check_kv:
                    for other in self.readers.get(page, ()):
                        if other == row:
                            continue
                        o = self.rows[other]
                        opos = o.pages.index(page) * ps + pos % ps
                        if opos < o.num_tokens:
                            self._fail(
                                f"step {b.step_id}: row {row} ({r.request_id}) overwrites slot "
                                f"{slot} that row {other} ({o.request_id}) reads"
                            )
                self.kv[slot] = t
                r.tokens.append(t)
                r.num_tokens += 1
            if b.sample[i]:
                tok = self.token_fn(r.request_id, r.num_tokens)
                r.last_sampled = tok
                rows_out.append(row)
                tokens_out.append(tok)
        if at != len(b.input_ids) or page_at != len(b.new_pages):
            self._fail(f"step {b.step_id}: columnar lengths disagree")
        return StepResult(step_id=b.step_id, rows=rows_out, token_ids=tokens_out)


TO_CACHE = (LeaseRequest, LeaseReturned, ChunkCached, SequenceReleased, RefreshMatch,
            SchedulerCensus, Tokenized, PagesSpilled, PagesLoaded, PagesStored,
            PagesFetched, ClearStore, BlocksErased)  # fmt: skip
TO_SCHED = (Matched, LeaseGranted, StepResult, PagesEvictable)
TO_EXE = (ForwardBatch, SpillPages, LoadPages, StorePages, FetchPages, EraseBlocks)


class Cluster:
    """Scheduler core + cache manager core + SimExecutor, connected by FIFO queues."""

    def __init__(
        self,
        sched: SchedulerConfig,
        num_pages: int,
        *,
        token_fn: TokenFn | None = None,
        check_kv: bool = True,
        disable_radix_cache: bool = False,
        num_host_pages: int = 0,
        write_policy: str = "write_through",
        store_block_tokens: int = 0,
        store_prefetch_policy: str = "wait_complete",
    ) -> None:
        self.sched = SchedulerCore(sched)
        self.cache = CacheManagerCore(
            CacheConfig(num_pages=num_pages, page_size=sched.page_size,
                        disable_radix_cache=disable_radix_cache, emit_kv_events=False,
                        num_host_pages=num_host_pages, write_policy=write_policy,
                        store_block_tokens=store_block_tokens,
                        store_prefetch_policy=store_prefetch_policy)
        )  # fmt: skip
        self.exe = SimExecutor(
            sched.page_size, num_pages, token_fn or (lambda rid, pos: mix64(pos) % 1000 + 10),
            check_kv=check_kv,
        )  # fmt: skip
        self.exe.block_pages = store_block_tokens // sched.page_size
        self.to_cache: deque[Msg] = deque()
        self.to_sched: deque[Msg] = deque()
        self.to_exe: deque[Msg] = deque()
        self.outputs: dict[str, list[RequestOutput]] = {}
        self.censuses: list[Census] = []
        self.problems: list[Msg] = []  # CensusBroken, FreeRefused
        self.failed: list[RequestFailed] = []
        self.cleared: list[StoreCleared] = []
        self.num_delivered = 0

    def route(self, msgs: list[Msg]) -> None:
        for m in msgs:
            if isinstance(m, TO_CACHE):
                self.to_cache.append(m)
            elif isinstance(m, TO_SCHED):
                self.to_sched.append(m)
            elif isinstance(m, TO_EXE):
                self.to_exe.append(m)
            elif isinstance(m, TokensOut):
                for o in m.outputs:
                    self.outputs.setdefault(o.request_id, []).append(o)
            elif isinstance(m, Census):
                self.censuses.append(m)
            elif isinstance(m, CensusBroken | FreeRefused):
                self.problems.append(m)
            elif isinstance(m, RequestFailed):
                self.failed.append(m)
            elif isinstance(m, StoreCleared):
                self.cleared.append(m)

    def submit(self, t: Tokenized) -> None:
        self.route(self.cache.handle(t))

    def abort(self, request_id: str, reason: str = "client") -> None:
        self.route(self.sched.handle(AbortRequest(request_id, reason)))

    def send_sched(self, msg: Msg) -> None:
        self.route(self.sched.handle(msg))

    def pump_cache(self) -> bool:
        if not self.to_cache:
            return False
        self.num_delivered += 1
        self.route(self.cache.handle(self.to_cache.popleft()))
        return True

    def pump_sched(self) -> bool:
        if not self.to_sched:
            return False
        self.num_delivered += 1
        self.route(self.sched.handle(self.to_sched.popleft()))
        return True

    def pump_exe(self) -> bool:
        if not self.to_exe:
            return False
        self.num_delivered += 1
        m = self.to_exe.popleft()
        if isinstance(m, ForwardBatch):
            self.to_sched.append(self.exe.handle(m))
        else:
            self.to_cache.append(self.exe.copy(m))
        return True

    def run(self, max_deliveries: int = 1_000_000) -> int:
        """Deliver until every queue is empty; returns the number delivered."""
        start = self.num_delivered
        while self.num_delivered - start < max_deliveries:
            if not (self.pump_cache() or self.pump_sched() or self.pump_exe()):
                break
        return self.num_delivered - start

    def finished(self, request_id: str) -> RequestOutput | None:
        outs = self.outputs.get(request_id, [])
        return outs[-1] if outs and outs[-1].finish_reason is not None else None

    def tokens(self, request_id: str) -> list[int]:
        return [t for o in self.outputs.get(request_id, []) for t in o.token_ids]
