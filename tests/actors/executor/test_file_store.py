"""The file tier of the KV cache (actors/executor/file_store.py), on real files in
tmp_path: write / fetch round trips (float32 and bfloat16, page sizes 1 and 4, with and
without skip), persistence and isolation of stores, content-keyed writes that never
rewrite, failures carried by the future, and refused calls that queue nothing."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from shunter.actors.executor.file_store import FileStore
from shunter.actors.executor.host_pool import HostKVPool
from shunter.actors.executor.kv_pool import KVPool
from shunter.actors.executor.models.config import ModelConfig

CFG = ModelConfig(family="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=4)  # fmt: skip
BLOCK_PAGES = 2
FP = "tiny-llama/test"


def _host(page_size: int, dtype=torch.float32, seed: int = 0) -> HostKVPool:
    g = torch.Generator().manual_seed(seed)
    host = HostKVPool(16, like=KVPool(CFG, 4, page_size=page_size, dtype=dtype))
    for t in (host.k_all, host.v_all):
        t.copy_(torch.randn(t.shape, generator=g))
    return host


def _page(t: torch.Tensor, page: int, page_size: int) -> torch.Tensor:
    """[num_layers, page_size, num_kv_heads, head_dim] of one page, every layer."""
    return t[:, page * page_size : (page + 1) * page_size]


def _same_pages(host: HostKVPool, src: list[int], dst: list[int]) -> bool:
    ps = host.page_size
    return all(torch.equal(_page(t, a, ps), _page(t, b, ps))
               for a, b in zip(src, dst, strict=True)
               for t in (host.k_all, host.v_all))  # fmt: skip


@pytest.fixture
def stores(tmp_path):
    """FileStore(tmp_path, ...) factory; every store is closed after the test."""
    made = []

    def make(host: HostKVPool, fingerprint: str = FP, block_pages: int = BLOCK_PAGES):
        made.append(FileStore(tmp_path, host, block_pages, fingerprint))
        return made[-1]

    yield make
    for s in made:
        s.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 4])
def test_write_then_fetch_round_trips_k_and_v(stores, page_size, dtype):
    host = _host(page_size, dtype)
    store = stores(host)
    assert store.block_tokens == BLOCK_PAGES * page_size
    store.write([11, 22], [0, 1, 5, 3]).result()
    before = (host.k_all.clone(), host.v_all.clone())
    store.fetch([11, 22], 0, [8, 9, 12, 10]).result()
    assert _same_pages(host, [0, 1, 5, 3], [8, 9, 12, 10])
    untouched = [p for p in range(host.num_pages) if p not in (8, 9, 12, 10)]
    for old, new in zip(before, (host.k_all, host.v_all), strict=True):
        for p in untouched:
            assert torch.equal(_page(old, p, page_size), _page(new, p, page_size))
    size = os.path.getsize(store.path / f"{11:016x}.kv")
    elem = torch.empty(0, dtype=dtype).element_size()
    assert size == 64 + 2 * 3 * store.block_tokens * 2 * 4 * elem  # 64-byte header, K, V


@pytest.mark.parametrize("page_size", [1, 4])
def test_fetch_with_skip_fills_only_the_tail(stores, page_size):
    host = _host(page_size)
    store = stores(host, block_pages=3)
    store.write([7, 8], [0, 1, 2, 3, 4, 5]).result()
    before = (host.k_all.clone(), host.v_all.clone())
    store.fetch([7, 8], 2, [10, 11, 12, 13]).result()  # block 7's last page, all of 8
    assert _same_pages(host, [2, 3, 4, 5], [10, 11, 12, 13])
    for old, new in zip(before, (host.k_all, host.v_all), strict=True):
        for p in range(host.num_pages):
            if p not in (10, 11, 12, 13):
                assert torch.equal(_page(old, p, page_size), _page(new, p, page_size))


def test_list_keys_persists_across_stores_and_fingerprints_are_isolated(stores, tmp_path):
    host = _host(4)
    store = stores(host)
    assert store.list_keys() == []
    store.write([30, -5, 2], [0, 1, 2, 3, 4, 5]).result()
    (store.path / "not-a-block.kv").write_bytes(b"x")
    (store.path / f"{9:016x}.kv.abc.tmp").write_bytes(b"x")  # a write cut short
    assert store.list_keys() == [-5, 2, 30]
    assert store.path.parent == tmp_path and len(store.path.name) == 16
    assert '"fingerprint": "tiny-llama/test"' in (store.path / "layout.json").read_text()
    again = stores(host)  # a restart: same root, same fingerprint
    assert again.path == store.path and again.list_keys() == [-5, 2, 30]
    other = stores(host, fingerprint="another-model")
    assert other.path != store.path and other.list_keys() == []
    with pytest.raises(FileNotFoundError):
        other.fetch([30], 0, [0, 1]).result()


def test_a_store_of_another_layout_refuses_the_directory(stores):
    stores(_host(4))
    with pytest.raises(ValueError, match="layout"):
        stores(_host(4), block_pages=BLOCK_PAGES + 1)
    with pytest.raises(ValueError, match="layout"):
        stores(_host(4, torch.bfloat16))


def test_second_write_of_a_key_does_not_rewrite_the_file(stores):
    host = _host(1)
    store = stores(host)
    store.write([5], [0, 1]).result()
    file = store.path / f"{5:016x}.kv"
    old = file.stat()
    os.utime(file, ns=(old.st_atime_ns, 1_000_000_000))  # a write would move it
    store.write([5, 6], [2, 3, 4, 5]).result()  # other content, same key: kept
    new = file.stat()
    assert (new.st_ino, new.st_mtime_ns) == (old.st_ino, 1_000_000_000)
    store.fetch([5], 0, [8, 9]).result()
    assert _same_pages(host, [0, 1], [8, 9])
    assert store.list_keys() == [5, 6]


def test_negative_keys_round_trip_under_unsigned_names(stores):
    host = _host(4, torch.bfloat16)
    store = stores(host)
    keys = [-1, -(2**63), 2**63 - 1]
    store.write(keys, [0, 1, 2, 3, 4, 5]).result()
    names = sorted(p.name for p in store.path.glob("*.kv"))
    assert names == ["7fffffffffffffff.kv", "8000000000000000.kv", "ffffffffffffffff.kv"]
    assert store.list_keys() == sorted(keys)
    store.fetch(keys, 1, [9, 10, 11, 12, 13]).result()
    assert _same_pages(host, [1, 2, 3, 4, 5], [9, 10, 11, 12, 13])


def test_fetch_of_a_missing_key_fails_in_the_future(stores):
    store = stores(_host(4))
    store.write([1], [0, 1]).result()
    fut = store.fetch([1, 2], 0, [4, 5, 6, 7])
    with pytest.raises(FileNotFoundError, match="block 0000000000000002: no file"):
        fut.result()


@pytest.mark.parametrize(
    ("corrupt", "match"),
    [
        (lambda b: b[:-1], "file is 1599 bytes, expected 1600"),
        (lambda b: b + b"\0", "file is 1601 bytes, expected 1600"),
        (lambda b: b"XXXXXXXX" + b[8:], "not a version 1 KV block file"),
        (lambda b: b[:12] + (99).to_bytes(4, "little") + b[16:], "layout .* differs"),
        (
            lambda b: b[:44] + (3).to_bytes(8, "little") + b[52:],
            "file holds block 0000000000000003",
        ),
    ],
    ids=["truncated", "grown", "magic", "layout", "key"],
)
def test_a_corrupted_file_fails_the_fetch_clearly(stores, corrupt, match):
    host = _host(4)
    store = stores(host)
    store.write([1], [0, 1]).result()
    file = store.path / f"{1:016x}.kv"
    file.write_bytes(corrupt(file.read_bytes()))
    with pytest.raises(ValueError, match=f"block 0000000000000001: {match}"):
        store.fetch([1], 0, [4, 5]).result()
    assert store.list_keys() == ([] if "bytes" in match else [1])  # listing checks the size


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda s: s.write([1, 2], [0, 1, 2]), "need 4 host pages, got 3"),
        (lambda s: s.write([1], [0, 16]), r"host page 16 out of range \[0, 16\)"),
        (lambda s: s.write([1], [-1, 0]), "host page -1 out of range"),
        (lambda s: s.write([2**63], [0, 1]), "not a signed 64-bit"),
        (lambda s: s.fetch([1], 0, [0]), "need 2 host pages, got 1"),
        (lambda s: s.fetch([1, 2], 1, [0, 1, 2, 3]), "need 3 host pages, got 4"),
        (lambda s: s.fetch([1], 2, []), r"skip 2 out of range \[0, 2\)"),
        (lambda s: s.fetch([1], -1, [0, 1, 2]), "skip -1 out of range"),
        (lambda s: s.fetch([1], 0, [0, 99]), "host page 99 out of range"),
        (lambda s: s.fetch([1], 0, [3, 3]), "destination twice"),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_bad_arguments_raise_at_call_time_and_queue_nothing(stores, call, match):
    store = stores(_host(1))
    with pytest.raises(ValueError, match=match):
        call(store)
    assert store.list_keys() == []


@pytest.fixture
def gate(monkeypatch) -> threading.Event:
    """Every FileStore write waits until the returned event is set (at most 5 s)."""
    event = threading.Event()
    real_write = FileStore._write

    def slow_write(self, keys, host_pages):
        event.wait(5)
        real_write(self, keys, host_pages)

    monkeypatch.setattr(FileStore, "_write", slow_write)
    return event


def test_close_waits_for_queued_writes_and_fetch_sees_earlier_writes(tmp_path, gate):
    host = _host(4)
    store = FileStore(tmp_path, host, BLOCK_PAGES, FP)
    futures = [store.write([k], [2 * k, 2 * k + 1]) for k in range(4)]
    fetched = store.fetch([3], 0, [14, 15])  # queued behind the write of 3
    assert not any(f.done() for f in [*futures, fetched])
    threading.Timer(0.05, gate.set).start()
    store.close()
    assert all(f.done() and f.exception() is None for f in [*futures, fetched])
    assert store.list_keys() == [0, 1, 2, 3]
    assert _same_pages(host, [6, 7], [14, 15])
    with pytest.raises(RuntimeError):
        store.write([9], [0, 1])
    assert not list(store.path.glob("*.tmp"))


def test_erase_deletes_the_named_blocks_or_every_block_file(stores):
    host = _host(4)
    store = stores(host)
    store.write([30, -5, 2], [0, 1, 2, 3, 4, 5]).result()
    assert store.erase([-5, 77]).result() == 1  # 77 was never there: no error
    assert store.list_keys() == [2, 30]
    with pytest.raises(FileNotFoundError):
        store.fetch([-5], 0, [0, 1]).result()
    (store.path / "notes.txt").write_text("kept")
    (store.path / f"{9:016x}.kv.abc.tmp").write_bytes(b"x")  # a killed process's write
    assert store.erase([], everything=True).result() == 3
    assert store.list_keys() == [] and not list(store.path.glob("*.tmp"))
    assert sorted(p.name for p in store.path.iterdir()) == ["layout.json", "notes.txt"]
    store.write([2], [0, 1]).result()  # the store goes on after a clear
    assert store.list_keys() == [2]
    with pytest.raises(ValueError, match="not a signed 64-bit"):
        store.erase([2**63])


def test_an_erase_runs_after_the_writes_queued_before_it(tmp_path, gate):
    """The cache manager clears the store while writes are in flight: those queued
    before the erase land first (and are erased), the one queued after it stays."""
    host = _host(4)
    store = FileStore(tmp_path, host, BLOCK_PAGES, FP)
    before = [store.write([k], [2 * k, 2 * k + 1]) for k in range(3)]
    erased = store.erase([], everything=True)
    after = store.write([5], [0, 1])
    assert not erased.done()
    gate.set()
    assert erased.result(timeout=5) == 3 and after.result(timeout=5) is None
    assert all(f.done() for f in before)
    assert store.list_keys() == [5]
    store.close()


def test_a_block_is_on_disk_before_it_has_its_name(stores, monkeypatch):
    store = stores(_host(4))
    calls = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append("fsync") or real_fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: calls.append("replace") or real_replace(a, b))
    store.write([1, 2], [0, 1, 2, 3]).result()
    assert calls == ["fsync", "replace", "fsync", "replace"]
