"""The file store's size cap: the real cache manager core over the executor's real
copies (a CPU KV pool, a host pool, block files in tmp_path). After every write the
directory holds at most the cap; the least recently used block goes first; a block a
fetch is reading stays; a restart trims what an earlier run left, oldest first; and a
capped run replays identically from its log."""

from __future__ import annotations

import os

import pytest

import shunter.actors.cache_manager.actor  # noqa: F401 - registers the cache core for replay
from shunter.actors.cache_manager.config import CacheConfig
from shunter.actors.cache_manager.core import CacheManagerCore
from shunter.actors.cache_manager.store_tier import block_keys
from shunter.actors.executor.block_files import list_keys
from shunter.actors.executor.copies import Copies
from shunter.actors.executor.file_store import FileStore
from shunter.actors.executor.host_pool import HostKVPool
from shunter.actors.executor.kv_pool import KVPool
from shunter.bus.codec import encode
from shunter.bus.log import LogWriter
from shunter.bus.messages import (
    BlocksErased,
    DropTree,
    EraseBlocks,
    FetchPages,
    LeaseGranted,
    LeaseRequest,
    LoadPages,
    Matched,
    Msg,
    PagesSpilled,
    PagesStored,
    Ready,
    SamplingParams,
    SequenceReleased,
    SpillPages,
    StoreListed,
    StorePages,
    Tokenized,
)
from shunter.bus.messages.base import Envelope
from shunter.bus.replay import replay
from tests.actors.cache_manager.test_host_tier import Seq, of
from tests.actors.cache_manager.test_store_tier import make, serve, stored
from tests.actors.executor.test_host_pool import CFG

BLOCK = 4  # tokens (and pages: page_size 1) per block
FILE_BYTES = 64 + 2 * 3 * BLOCK * 2 * 4 * 4  # header, then K and V: [3, 4, 2, 4] float32
FP = "tiny-llama/cap"
SP = SamplingParams()
COPIES = (SpillPages, LoadPages, StorePages, FetchPages, EraseBlocks)


def prompt(i: int, num_blocks: int = 1) -> list[int]:
    """A prompt of num_blocks whole blocks no other i shares, and one token more."""
    return [1000 * (i + 1) + t for t in range(BLOCK * num_blocks)] + [7]


class Engine:
    """The core and the executor's copies over real pools and files. Every copy the core
    asks for is run and answered at once, except a fetch while `hold_fetches` (its reply
    waits in `held`). `on_stored` is called after each write has landed on disk. What
    goes in and out of the core is kept in `log` as (publisher, message)."""

    def __init__(self, root, max_blocks: int | None, num_pages: int = 24,
                 num_host_pages: int = 48) -> None:  # fmt: skip
        device = KVPool(CFG, num_pages)
        host = HostKVPool(num_host_pages, like=device)
        max_bytes = 0 if max_blocks is None else max_blocks * FILE_BYTES + FILE_BYTES // 2
        self.files = FileStore(root, host, BLOCK, FP, max_bytes=max_bytes)
        assert self.files.max_blocks == (max_blocks or 0)
        self.copies = Copies(lambda: device, host, self.files)
        self.config = CacheConfig(num_pages=num_pages, num_host_pages=num_host_pages,
                                  store_block_tokens=BLOCK, store_max_blocks=max_blocks or 0,
                                  store_path=str(self.files.path))  # fmt: skip
        self.core = CacheManagerCore(self.config)
        self.hold_fetches = False
        self.held: list[Msg] = []
        self.on_stored = lambda: None
        self.log: list[tuple[str, Msg]] = []
        self._lease_seq = 0

    def on_disk(self) -> list[int]:
        return list_keys(self.files.path, FILE_BYTES)

    def send(self, msg: Msg, publisher: str = "sched") -> list[Msg]:
        """Feed msg to the core, run the copies it asks for and feed their replies back,
        until none is left; the core's other outputs, in order."""
        inbox, others = [(publisher, msg)], []
        while inbox:
            pub, m = inbox.pop(0)
            self.log.append((pub, m))
            for out in self.core.handle(m):
                self.log.append(("cache", out))
                if not isinstance(out, COPIES):
                    others.append(out)
                    continue
                reply = self.copies.copy(out)
                for r in [reply] if reply is not None else self.copies.done(wait=True):
                    assert r.ok, r
                    if isinstance(r, PagesStored):
                        self.on_stored()
                    if self.hold_fetches and isinstance(out, FetchPages):
                        self.held.append(r)
                    else:
                        inbox.append(("executor", r))
        return others

    def release_held(self) -> list[Msg]:
        held, self.held = self.held, []
        return [o for r in held for o in self.send(r, "executor")]

    def serve(self, rid: str, ids: list[int]) -> Matched:
        """Match, lease, compute and finish one request (its backup and store write run
        as it finishes); its Matched."""
        (m,) = of(self.send(Tokenized(rid, ids, SP)), Matched)
        self._lease_seq += 1
        need = len(ids) - len(m.prefix_pages)
        (g,) = of(self.send(LeaseRequest(self._lease_seq, need)), LeaseGranted)
        self.send(SequenceReleased(rid, ids, m.prefix_pages + g.pages))
        return m

    def erased(self) -> list[list[int]]:
        """The keys of every EraseBlocks the core sent, in order."""
        return [m.keys for pub, m in self.log if isinstance(m, EraseBlocks)]


def key(i: int, num_blocks: int = 1) -> list[int]:
    return block_keys(0, "", prompt(i, num_blocks), BLOCK)


@pytest.fixture
def engines(tmp_path):
    made: list[Engine] = []

    def make(max_blocks: int | None, **kw) -> Engine:
        made.append(Engine(tmp_path, max_blocks, **kw))
        return made[-1]

    yield make
    for e in made:
        e.files.close()


def test_the_store_never_holds_more_than_its_cap_after_any_write(engines):
    e = engines(3)
    sizes: list[int] = []

    def check() -> None:
        files = [f for f in os.scandir(e.files.path) if f.name.endswith(".kv")]
        sizes.append(len(files))
        assert len(files) <= 3 and sum(f.stat().st_size for f in files) <= 3.5 * FILE_BYTES

    e.on_stored = check
    for i in range(8):  # two blocks each: 16 written in all
        e.serve(f"r{i}", prompt(i, 2))
    s = e.core.statistics()
    assert sizes and max(sizes) == 3  # (the cap was reached, and every write checked)
    assert (s.num_stored_blocks, s.num_store_blocks, s.num_store_blocks_evicted) == (16, 3, 13)
    assert sorted(e.core.store.known) == e.on_disk()
    assert e.on_disk() == sorted(key(7, 2) + key(6, 2)[1:])  # the most recent three
    assert not e.core.store.erases  # every erase was answered


def test_the_least_recently_used_block_is_the_one_evicted(engines):
    """X and Y fill a store of two; X is read back (used), so a third block evicts Y,
    whose erase goes out before the write that needs its room."""
    e = engines(2)
    e.serve("x", prompt(0))
    e.serve("y", prompt(1))
    assert e.on_disk() == sorted(key(0) + key(1))
    e.send(DropTree("f"))  # the tree and host tier forget: X comes back from the store
    m = e.serve("x2", prompt(0))
    assert m.num_cached_tokens == BLOCK and e.core.statistics().num_fetched_blocks == 1
    out_before = len(e.log)
    e.serve("z", prompt(2))
    copies = [m for _, m in e.log[out_before:] if isinstance(m, EraseBlocks | StorePages)]
    assert [type(c) for c in copies] == [EraseBlocks, StorePages]
    assert copies[0].keys == key(1) and copies[1].keys == key(2)
    assert e.on_disk() == sorted(key(0) + key(2))
    assert list(e.core.store.known) == key(0) + key(2)  # least recent first
    assert e.core.statistics().num_store_blocks_evicted == 1


def test_a_block_a_fetch_is_reading_is_not_evicted(engines):
    """X is being read (its reply not yet in) when Y and then Z are written to a store
    of two: X is the least recently used of X and Y by then, but Y goes."""
    e = engines(2)
    e.serve("x", prompt(0))
    e.send(DropTree("f"))
    e.hold_fetches = True
    assert e.send(Tokenized("x2", prompt(0), SP)) == []  # waits for the read
    e.hold_fetches = False
    e.serve("y", prompt(1))  # fits: nothing evicted
    assert e.erased() == []
    e.serve("z", prompt(2))
    assert e.erased() == [key(1)]
    assert e.on_disk() == sorted(key(0) + key(2))
    (m,) = of(e.release_held(), Matched)  # the read lands and is loaded
    assert m.request.request_id == "x2" and m.num_cached_tokens == BLOCK


def test_when_every_block_is_being_read_a_write_writes_only_what_fits(engines):
    e = engines(1)
    e.serve("x", prompt(0))
    e.send(DropTree("f"))
    e.hold_fetches = True
    e.send(Tokenized("x2", prompt(0), SP))
    e.serve("y", prompt(1))  # no room, nothing to evict: not written
    assert e.erased() == [] and e.on_disk() == key(0)
    assert not [m for _, m in e.log if isinstance(m, StorePages) and m.keys == key(1)]
    e.hold_fetches = False
    e.release_held()
    e.serve("z", prompt(2))  # X is evictable again
    assert e.erased() == [key(0)] and e.on_disk() == key(2)


def test_old_weights_blocks_go_first(engines):
    """After a weights flip no earlier block can be matched: they are evicted first."""
    e = engines(2)
    e.serve("x", prompt(0))
    e.serve("y", prompt(1))
    e.send(DropTree("f", weights_changed=True))
    e.serve("z", prompt(2))
    assert e.erased() == [key(0)] and e.core.statistics().num_store_blocks == 2
    e.serve("w", prompt(3))
    assert e.erased() == [key(0), key(1)]
    assert e.on_disk() == sorted(block_keys(1, "", prompt(2), BLOCK)
                                 + block_keys(1, "", prompt(3), BLOCK))  # fmt: skip


def test_a_restart_trims_what_an_earlier_run_left_oldest_first(engines):
    """Four blocks written with no cap, X read back last; a server capped at two lists
    them oldest first (by modification time: a read sets it) and evicts the two least
    recently used, through the store's erase."""
    first = engines(None)
    for i in range(4):
        first.serve(f"r{i}", prompt(i))
    for i in range(4):  # distinct times, in writing order, as a slow disk would give
        os.utime(first.files.path / f"{key(i)[0] % 2**64:016x}.kv", ns=(10**18 + i,) * 2)
    first.send(DropTree("f"))
    first.serve("x", prompt(0))  # read back: now the most recent
    first.files.close()
    assert list_keys(first.files.path, oldest_first=True) == key(1) + key(2) + key(3) + key(0)

    again = engines(2)
    listed = list_keys(again.files.path, oldest_first=True)
    assert again.send(StoreListed(listed), "cache") == []
    assert again.erased() == [key(1) + key(2)]
    assert again.on_disk() == sorted(key(3) + key(0))
    s = again.core.statistics()
    assert (s.num_store_blocks, s.num_store_blocks_evicted) == (2, 2)
    assert again.serve("x", prompt(0)).num_cached_tokens == BLOCK  # a kept block reads


def test_a_cap_below_one_block_is_refused(tmp_path):
    host = HostKVPool(8, like=KVPool(CFG, 4))
    with pytest.raises(ValueError, match="holds no block"):
        FileStore(tmp_path, host, BLOCK, FP, max_bytes=FILE_BYTES - 1)
    with pytest.raises(ValueError, match="max_bytes must be >= 0"):
        FileStore(tmp_path, host, BLOCK, FP, max_bytes=-1)
    with pytest.raises(ValueError, match="store_max_blocks"):
        CacheConfig(num_pages=4, num_host_pages=8, store_max_blocks=2)  # no store


def test_a_capped_run_replays_identically(engines, tmp_path):
    """The run above's inbox, recorded with the cache's Ready, gives the same outbox
    (evictions included) from a core rebuilt from that Ready alone; a core told no cap
    diverges at the first eviction."""
    e = engines(2)
    e.send(StoreListed([]), "cache")
    for i in range(4):
        e.serve(f"r{i}", prompt(i))
    e.send(DropTree("f"))
    e.serve("x", prompt(3))
    assert e.erased()

    def write(path, info) -> None:
        w, seqs = LogWriter(path), {}
        ready = Ready("cache", "cache", info)
        for i, (pub, msg) in enumerate([("cache", ready), *e.log]):
            seqs[pub] = seqs.get(pub, -1) + 1
            w.append(encode(msg, Envelope(pub, seqs[pub], i, i)), now_ns=i)
        w.close()

    write(tmp_path / "log", e.config.to_info())
    result = replay(tmp_path / "log", "cache")
    assert result.identical, result.report()
    assert result.num_outbox == result.num_produced > 0

    write(tmp_path / "uncapped", {**e.config.to_info(), "store_max_blocks": 0})
    d = replay(tmp_path / "uncapped", "cache").divergence
    assert d is not None and "EraseBlocks" in d.expected


def test_a_failed_erase_counts_as_a_failed_copy():
    core, seq = make(store_max_blocks=1), Seq()
    stored(core, "x", prompt(0), seq)
    (sp,) = of(serve(core, "y", prompt(1), seq), SpillPages)
    er, st = core.handle(PagesSpilled(sp.copy_id, sp.keys))
    assert isinstance(er, EraseBlocks) and isinstance(st, StorePages) and er.keys == key(0)
    assert core.handle(BlocksErased(er.copy_id, er.keys, ok=False, error="EROFS")) == []
    assert core.handle(BlocksErased(er.copy_id, er.keys)) == []  # answered once
    s = core.statistics()
    assert (s.num_store_copies_failed, s.num_store_blocks_evicted) == (1, 1)
