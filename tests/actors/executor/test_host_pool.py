"""The host KV tier (actors/executor/host_pool.py): spill and load round trips on every
layer, refused copies that change nothing, sizing, ExecutorCore.copy's replies (a
prefix loaded back from the host decodes as the original did), and the actor answering
SpillPages / LoadPages in order on the in-process bus."""

from __future__ import annotations

import json
import threading

import anyio
import msgspec
import pytest
import torch

from shunter.actors.executor import host_pool as host_pool_module
from shunter.actors.executor.actor import build_core, ready_info, run
from shunter.actors.executor.config import ExecutorConfig
from shunter.actors.executor.host_pool import HostKVPool, host_pool_pages
from shunter.actors.executor.kv_pool import KVPool
from shunter.actors.executor.models.config import ModelConfig
from shunter.bus.inproc import InProcHub
from shunter.bus.messages import (
    BlocksErased,
    EraseBlocks,
    FetchPages,
    ForwardBatch,
    LoadPages,
    MemoryState,
    PagesFetched,
    PagesLoaded,
    PagesSpilled,
    PagesStored,
    Ready,
    ReleaseMemory,
    RowOpen,
    SamplingParams,
    SpillPages,
    StepResult,
    StorePages,
)

CFG = ModelConfig(family="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=4)  # fmt: skip
PER_TOKEN_F32 = 2 * 3 * 2 * 4 * 4  # K and V, layers, kv heads, head dim, bytes
TINY_LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512,
                  hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  eos_token_id=2, tie_word_embeddings=True)  # fmt: skip
PROMPT = [1, 90, 198, 283, 359, 253, 56, 46, 111, 365, 311, 77]  # 12 tokens: 3 pages of 4


def _pools(page_size: int, dtype=torch.float32) -> tuple[KVPool, HostKVPool]:
    g = torch.Generator().manual_seed(page_size)
    pool = KVPool(CFG, 12, page_size=page_size, dtype=dtype)
    host = HostKVPool(20, like=pool)
    for t in (pool.k_all, pool.v_all, host.k_all, host.v_all):
        t.copy_(torch.randn(t.shape, generator=g))
    return pool, host


def _page(t: torch.Tensor, page: int, page_size: int) -> torch.Tensor:
    """[num_layers, page_size, num_kv_heads, head_dim] of one page, every layer."""
    return t[:, page * page_size : (page + 1) * page_size]


def _assert_pages(src, src_pages, dst, dst_pages, page_size) -> None:
    for a, b in zip(src_pages, dst_pages, strict=True):
        for s, d in ((src.k_all, dst.k_all), (src.v_all, dst.v_all)):
            assert torch.equal(_page(s, a, page_size), _page(d, b, page_size))


def _others_unchanged(before: tuple[torch.Tensor, torch.Tensor], pool, written, page_size):
    for old, new in zip(before, (pool.k_all, pool.v_all), strict=True):
        for p in range(pool.num_pages):
            if p not in written:
                assert torch.equal(_page(old, p, page_size), _page(new, p, page_size))


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("chunk_bytes", [64 << 20, 1])  # one chunk; a chunk per page
@pytest.mark.parametrize("min_run_bytes", [0, 1 << 40])  # host runs as slices; by index
def test_spill_then_load_round_trips_every_layer(page_size, chunk_bytes, min_run_bytes,
                                                 monkeypatch):  # fmt: skip
    monkeypatch.setattr(host_pool_module, "_CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(host_pool_module, "_MIN_RUN_BYTES", min_run_bytes)
    pool, host = _pools(page_size)
    original = (pool.k_all.clone(), pool.v_all.clone())
    device_pages, host_pages = [7, 2, 9, 0, 11], [13, 1, 5, 19, 6]
    before = (host.k_all.clone(), host.v_all.clone())
    host.spill(pool, device_pages, host_pages)
    _assert_pages(pool, device_pages, host, host_pages, page_size)
    _others_unchanged(before, host, host_pages, page_size)
    assert torch.equal(pool.k_all, original[0]) and torch.equal(pool.v_all, original[1])

    for t in (pool.k_all, pool.v_all):  # the device tier forgets them
        t.normal_()
    before = (pool.k_all.clone(), pool.v_all.clone())
    back = [3, 10, 6, 8, 1]
    host.load(pool, host_pages[::-1], back)
    for (src, dst) in zip(device_pages[::-1], back, strict=True):  # fmt: skip
        assert torch.equal(_page(pool.k_all, dst, page_size), _page(original[0], src, page_size))
        assert torch.equal(_page(pool.v_all, dst, page_size), _page(original[1], src, page_size))
    _others_unchanged(before, pool, back, page_size)
    s = host.statistics()
    assert (s.num_pages, s.page_size, s.num_slots) == (20, page_size, 20 * page_size)
    assert (s.num_pages_spilled, s.num_pages_loaded, s.pinned) == (5, 5, False)
    assert s.total_bytes == PER_TOKEN_F32 * 20 * page_size


def _copied(src, src_pages, dst, dst_pages, page_size) -> tuple[torch.Tensor, torch.Tensor]:
    """dst's K and V after copying src_pages[i] to dst_pages[i] page by page."""
    want = dst.k_all.clone(), dst.v_all.clone()
    for a, b in zip(src_pages, dst_pages, strict=True):
        for w, s in zip(want, (src.k_all, src.v_all), strict=True):
            _page(w, b, page_size).copy_(_page(s, a, page_size))
    return want


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("min_run_bytes", [0, 1 << 40])
def test_copies_of_runs_repeats_and_any_order_match_plain_indexing(seed, min_run_bytes,
                                                                   monkeypatch):  # fmt: skip
    """Host pages in long runs (ascending, descending, interleaved), a host page loaded
    into several device pages, chunks splitting runs: each copy equals indexing page by
    page, and nothing else changes."""
    monkeypatch.setattr(host_pool_module, "_MIN_RUN_BYTES", min_run_bytes)
    monkeypatch.setattr(host_pool_module, "_CHUNK_BYTES", [64 << 20, 3 * 4 * 2 * 4 * 5][seed % 2])
    page_size = [1, 2, 4][seed % 3]
    g = torch.Generator().manual_seed(seed)
    pool = KVPool(CFG, 12, page_size=page_size)
    host = HostKVPool(40, like=pool)
    for t in (pool.k_all, pool.v_all, host.k_all, host.v_all):
        t.copy_(torch.randn(t.shape, generator=g))
    # 30-34 ascending, 9-5 descending and 20-21, interleaved
    host_pages = [30, 9, 20, 31, 8, 21, 32, 7, 33, 6, 34, 5]
    device_pages = torch.randperm(12, generator=g).tolist()

    want = _copied(pool, device_pages, host, host_pages, page_size)
    host.spill(pool, device_pages, host_pages)
    assert torch.equal(host.k_all, want[0]) and torch.equal(host.v_all, want[1])

    sources = [31, 31, 32, 5, 4, 3, 30, 33, 34, 35, 20, 5]  # 31 and 5 twice
    want = _copied(host, sources, pool, device_pages, page_size)
    host.load(pool, sources, device_pages)
    assert torch.equal(pool.k_all, want[0]) and torch.equal(pool.v_all, want[1])


def test_runs_of_sorted_pages():
    assert host_pool_module._runs([3, 4, 5, 9, 10, 20], 1) == (
        [(3, 0, 3), (9, 3, 2), (20, 5, 1)], None)  # fmt: skip
    assert host_pool_module._runs([2, 2, 3, 7], 4) == ([(8, 0, 8), (28, 8, 4)], [0, 0, 1, 2])


def test_bf16_and_empty_copies():
    pool, host = _pools(4, torch.bfloat16)
    assert host.k_all.dtype == torch.bfloat16 and host.k_all.device.type == "cpu"
    host.spill(pool, [], [])
    host.load(pool, [], [])
    host.spill(pool, [4, 4], [0, 1])  # a source twice is fine
    _assert_pages(pool, [4, 4], host, [0, 1], 4)


@pytest.mark.parametrize(
    ("op", "src", "dst", "why"),
    [
        ("spill", [1, 2], [3], "2 device pages but 1 host pages"),
        ("load", [1], [2, 3], "1 host pages but 2 device pages"),
        ("spill", [12], [0], r"device page 12 out of range \[0, 12\)"),
        ("spill", [-1], [0], "device page -1 out of range"),
        ("spill", [0], [20], r"host page 20 out of range \[0, 20\)"),
        ("load", [25], [0], "host page 25 out of range"),
        ("load", [0], [12], "device page 12 out of range"),
        ("spill", [1, 2, 3], [5, 6, 5], "host page 5 is a destination twice"),
        ("load", [1, 2], [7, 7], "device page 7 is a destination twice"),
    ],
)
def test_bad_copies_are_refused_and_change_nothing(op, src, dst, why):
    pool, host = _pools(4)
    before = [t.clone() for t in (pool.k_all, pool.v_all, host.k_all, host.v_all)]
    with pytest.raises(ValueError, match=why):
        getattr(host, op)(pool, src, dst)
    after = (pool.k_all, pool.v_all, host.k_all, host.v_all)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert host.statistics().num_pages_spilled == host.statistics().num_pages_loaded == 0


def test_released_or_foreign_device_pool_is_refused():
    pool, host = _pools(4)
    other = KVPool(CFG, 12, page_size=2)
    with pytest.raises(ValueError, match="layout differs"):
        host.spill(other, [0], [0])
    pool.release()
    with pytest.raises(ValueError, match="the device KV pool is released"):
        host.spill(pool, [0], [0])
    with pytest.raises(ValueError, match="released"):
        host.load(pool, [0], [0])
    with pytest.raises(ValueError, match="num_pages"):
        HostKVPool(0, like=KVPool(CFG, 2))


def test_host_pool_pages_from_ratio_or_size(monkeypatch):
    pool = KVPool(CFG, 10, page_size=4)
    per_page = PER_TOKEN_F32 * 4
    assert host_pool_pages(pool, 2.0, 0.0) == 20
    assert host_pool_pages(pool, 0.25, 0.0) == 2
    assert host_pool_pages(pool, 2.0, per_page * 7.5 / 1e9) == 7  # size wins over ratio
    with pytest.raises(ValueError, match=r"hicache_ratio=0\.05 gives no host KV page"):
        host_pool_pages(pool, 0.05, 0.0)
    with pytest.raises(ValueError, match="gives no host KV page"):
        host_pool_pages(pool, 2.0, per_page * 0.5 / 1e9)
    monkeypatch.setattr(host_pool_module, "host_available_bytes", lambda: per_page * 15)
    assert host_pool_pages(pool, 1.5, 0.0) == 15
    with pytest.raises(ValueError, match=r"more than the 0\.00 GB of host memory available"):
        host_pool_pages(pool, 1.6, 0.0)
    with pytest.raises(ValueError, match=r"hicache_size=1000\.0 GB asks for"):
        host_pool_pages(pool, 2.0, 1000.0)


def test_config_validates_the_host_tier_fields():
    assert ExecutorConfig().enable_hierarchical_cache is False
    with pytest.raises(ValueError, match="hicache_ratio must be > 0"):
        ExecutorConfig(hicache_ratio=0.0)
    with pytest.raises(ValueError, match="hicache_size must be >= 0"):
        ExecutorConfig(hicache_size=-1.0)


def test_pinning_is_all_or_nothing_and_errors_stay_in_their_thread(monkeypatch):
    """_pin against a fake CUDA runtime: every call runs off the caller's thread; a
    refusal unlocks what was locked; a locked pool is unlocked once it is collected."""
    import gc
    import threading

    calls: list[tuple[str, int, str]] = []

    class FakeCudart:
        refuse: set[int] = set()

        def cudaHostRegister(self, ptr, size, flags):
            calls.append(("register", ptr, threading.current_thread().name))
            return 2 if ptr in self.refuse else 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr, threading.current_thread().name))
            return 0

    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    a, b = torch.empty(16), torch.empty(16)

    class Owner:
        pass

    owner = Owner()
    assert host_pool_module._pin(owner, [a, b])
    assert [c[0] for c in calls] == ["register"] * 2
    assert all(c[2] == "host-kv-pin" for c in calls)
    del owner
    gc.collect()
    assert [(c[0], c[1]) for c in calls[2:]] == [("unregister", a.data_ptr()),
                                                 ("unregister", b.data_ptr())]  # fmt: skip
    calls.clear()
    fake.refuse = {b.data_ptr()}
    owner = Owner()
    assert not host_pool_module._pin(owner, [a, b])
    assert [(c[0], c[1]) for c in calls] == [("register", a.data_ptr()),
                                             ("register", b.data_ptr()),
                                             ("unregister", a.data_ptr())]  # fmt: skip
    del owner
    gc.collect()
    assert len(calls) == 3  # nothing left to unlock


# ---- the core and the actor ----------------------------------------------------------


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> ExecutorConfig:
    """Seeded dummy weights of a small Llama; 64 pages of 4 tokens and 128 host pages."""
    d = tmp_path_factory.mktemp("tiny_llama_hicache")
    (d / "config.json").write_text(json.dumps(TINY_LLAMA))
    return ExecutorConfig(model_path=str(d), load_format="dummy", seed=3, max_total_tokens=256,
                          page_size=4, load_progress=False, device="cpu",
                          enable_hierarchical_cache=True)  # fmt: skip


GREEDY = SamplingParams(temperature=0.0, return_logprob=True)


def _prefill(step_id: int, row: int, pages: list[int]) -> ForwardBatch:
    return ForwardBatch(step_id=step_id, opens=[RowOpen(row, f"r{row}", [], 0, GREEDY, 0)],
                        rows=[row], num_new_tokens=[12], start_pos=[0], input_ids=PROMPT,
                        new_pages=pages, num_new_pages=[len(pages)], sample=[True])  # fmt: skip


def _on_prefix(step_id: int, row: int, pages: list[int]) -> ForwardBatch:
    """A row opened on `pages` as the cached KV of PROMPT[:11], feeding PROMPT[11]."""
    o = RowOpen(row, f"r{row}", pages, 11, GREEDY, 0, prefix_token_ids=PROMPT[:11])
    return ForwardBatch(step_id=step_id, opens=[o], rows=[row], num_new_tokens=[1],
                        start_pos=[11], input_ids=[PROMPT[11]], num_new_pages=[0],
                        sample=[True])  # fmt: skip


def test_core_copy_restores_a_prefix_that_decodes_as_before(config):
    core = build_core(config)
    assert core.host_pool is not None and core.host_pool.num_pages == 2 * core.num_pages == 128
    first = core.step(_prefill(0, 0, [5, 9, 2]))
    got = core.copies.copy(SpillPages(1, [11, 12, 13], [5, 9, 2], [100, 3, 64]))
    assert got == PagesSpilled(1, [11, 12, 13], ok=True)
    pool = core.runner.kv_pool
    pool.k_all.zero_(), pool.v_all.zero_()  # the device tier forgets it
    got = core.copies.copy(LoadPages(2, [11, 12, 13], [100, 3, 64], [40, 13, 27]))
    assert got == PagesLoaded(2, [11, 12, 13], ok=True)
    again = core.step(_on_prefix(1, 1, [40, 13, 27]))
    assert again.token_ids == first.token_ids
    assert again.logprobs == pytest.approx(first.logprobs, abs=1e-4)

    pool.k_all.zero_(), pool.v_all.zero_()  # without the load the prefix is gone
    lost = core.step(_on_prefix(2, 2, [40, 13, 27]))
    assert lost.logprobs != pytest.approx(first.logprobs, abs=1e-4)


def test_core_file_store_round_trip_decodes_as_before(config, tmp_path):
    """device -> host -> a block file -> other host pages -> other device pages: the
    prefix decodes as it did; a later core of the same model lists the block, one of
    other weights does not."""
    core = build_core(msgspec.structs.replace(config, hicache_storage_dir=str(tmp_path)))
    fs = core.file_store
    assert fs is not None and fs.block_tokens == 64 and fs.path.parent == tmp_path
    info = ready_info(core)
    assert (info["store_block_tokens"], info["store_path"]) == (64, str(fs.path))
    assert info["store_max_blocks"] == 0  # no cap
    first = core.step(_prefill(0, 0, [5, 9, 2]))
    block = [5, 9, 2, *range(20, 33)]  # 16 pages: one block
    core.copies.copy(SpillPages(1, [0] * 16, block, list(range(16))))
    assert core.copies.copy(StorePages(2, [-7], list(range(16)))) is None  # on the store's thread
    assert core.copies.done(wait=True) == [PagesStored(2, [-7])]
    core.host_pool.k_all.zero_(), core.host_pool.v_all.zero_()
    pool = core.runner.kv_pool
    pool.k_all.zero_(), pool.v_all.zero_()
    assert core.copies.copy(FetchPages(3, [-7], 0, list(range(40, 56)))) is None
    (wait,) = core.copies.waiters()
    wait()
    assert core.copies.done() == [PagesFetched(3, [-7])]
    core.copies.copy(LoadPages(4, [0] * 3, [40, 41, 42], [7, 8, 11]))
    again = core.step(_on_prefix(1, 1, [7, 8, 11]))
    assert again.token_ids == first.token_ids
    assert again.logprobs == pytest.approx(first.logprobs, abs=1e-4)
    missing = core.copies.copy(FetchPages(5, [8], 0, list(range(16))))
    assert missing is None and not core.copies.done(wait=True)[0].ok
    fs.close()
    later = build_core(msgspec.structs.replace(config, hicache_storage_dir=str(tmp_path),
                                               hicache_storage_max_size=2.5e-3))  # fmt: skip
    assert later.file_store.list_keys() == [-7]
    block_bytes = (fs.path / f"{-7 % 2**64:016x}.kv").stat().st_size
    assert ready_info(later)["store_max_blocks"] == int(2.5e6) // block_bytes  # whole files
    other = build_core(msgspec.structs.replace(config, hicache_storage_dir=str(tmp_path),
                                               seed=4))  # fmt: skip
    assert other.file_store.list_keys() == []
    assert later.copies.copy(EraseBlocks(1, [], everything=True)) is None
    assert later.copies.done(wait=True) == [BlocksErased(1, [])]
    assert later.file_store.list_keys() == []
    off = build_core(config)  # a host tier without a store below it
    assert off.copies.copy(EraseBlocks(2, [3])) == BlocksErased(2, [3], ok=False,
                                                               error="the file store is off")  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_core_copies_are_answered_when_done_and_the_prefix_decodes_as_before(config):
    """On a GPU a copy comes back as None from copy() and is answered by copies.done()
    once its copy stream got there; the reloaded prefix decodes the same."""
    core = build_core(
        msgspec.structs.replace(
            config, device="cuda", attention_backend="triton", skip_server_warmup=True
        )
    )
    assert core.host_pool is not None and core.host_pool.pinned
    first = core.step(_prefill(0, 0, [5, 9, 2]))
    assert core.copies.copy(SpillPages(1, [11, 12, 13], [5, 9, 2], [100, 3, 64])) is None
    assert core.copies.done(wait=True) == [PagesSpilled(1, [11, 12, 13], ok=True)]
    assert core.copies.waiters() == [] and core.copies.done() == []
    pool = core.runner.kv_pool
    pool.k_all.zero_(), pool.v_all.zero_()
    assert core.copies.copy(LoadPages(2, [11, 12, 13], [100, 3, 64], [40, 13, 27])) is None
    (wait,) = core.copies.waiters()
    wait()
    assert core.copies.done() == [PagesLoaded(2, [11, 12, 13], ok=True)]
    again = core.step(_on_prefix(1, 1, [40, 13, 27]))
    assert again.token_ids == first.token_ids
    assert again.logprobs == pytest.approx(first.logprobs, abs=1e-3)


def test_core_copy_answers_failures_with_ok_false(config):
    core = build_core(config)
    bad = core.copies.copy(LoadPages(7, [1], [0], [64]))
    assert (bad.copy_id, bad.keys, bad.ok) == (7, [1], False) and isinstance(bad, PagesLoaded)
    assert bad.error == "device page 64 out of range [0, 64)"
    core.runner.kv_pool.release()
    gone = core.copies.copy(SpillPages(8, [1], [0], [0]))
    assert isinstance(gone, PagesSpilled) and not gone.ok and "released" in gone.error
    off = build_core(msgspec.structs.replace(config, enable_hierarchical_cache=False))
    assert off.host_pool is None
    for msg in (SpillPages(9, [], [], []), LoadPages(10, [], [], [])):
        reply = off.copies.copy(msg)
        assert (reply.copy_id, reply.ok, reply.error) == (msg.copy_id, False,
                                                          "the host KV tier is off")  # fmt: skip


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
async def test_actor_answers_copies_in_order_between_batches(config):
    hub = InProcHub()
    exec_bus, cm_bus = hub.connect("executor.0"), hub.connect("cache_manager")
    msgs = [
        _prefill(0, 0, [5, 9, 2]),
        SpillPages(1, [11, 12, 13], [5, 9, 2], [100, 3, 64]),
        LoadPages(2, [11, 12, 13], [100, 3, 64], [40, 13, 27]),
        LoadPages(3, [14], [200], [1]),  # out of range: refused
        SpillPages(4, [15], [7], [8]),
        _on_prefix(1, 1, [40, 13, 27]),
    ]
    got: list = []
    async with anyio.create_task_group() as tg:
        async with cm_bus.subscribe(
            "spill.done", "spill.loaded", "sched.result", "health.ready"
        ) as sub:
            tg.start_soon(run, config, exec_bus)
            with anyio.fail_after(60):
                ready = (await sub.receive()).msg
                assert isinstance(ready, Ready) and ready.info["num_host_pages"] == 128
                for m in msgs:
                    await cm_bus.publish(m)
                while len(got) < len(msgs):
                    got.append((await sub.receive()).msg)
        tg.cancel_scope.cancel()

    copies = [m for m in got if not isinstance(m, StepResult)]
    assert [(type(m), m.copy_id, m.ok) for m in copies] == [
        (PagesSpilled, 1, True), (PagesLoaded, 2, True), (PagesLoaded, 3, False),
        (PagesSpilled, 4, True)]  # fmt: skip
    assert "host page 200 out of range" in copies[2].error
    steps = [m for m in got if isinstance(m, StepResult)]
    assert [s.step_id for s in steps] == [0, 1] and all(s.error is None for s in steps)
    assert steps[1].token_ids == steps[0].token_ids


class _HeldCopy:
    """Stands in for a copy's CUDA event, which a CPU has none of: the copy is done (it
    already is) when the test says so."""

    def __init__(self) -> None:
        self._done = threading.Event()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()

    def release(self) -> None:
        self._done.set()


@pytest.mark.anyio
async def test_actor_answers_copies_once_done_and_finishes_them_before_a_flip(config,
                                                                               monkeypatch):  # fmt: skip
    """A copy still running on the device does not hold the loop: later steps are
    answered first, and its reply comes once its copy is done (a load's not behind an
    older spill's), whether the loop waits for a message or a step then; a flip waits
    for the copies in flight."""
    held: list[_HeldCopy] = []

    def holding(copy):
        def held_copy(self, pool, src, dst):
            assert copy(self, pool, src, dst) is None  # done on the CPU
            held.append(_HeldCopy())
            return held[-1]

        return held_copy

    monkeypatch.setattr(HostKVPool, "spill", holding(HostKVPool.spill))
    monkeypatch.setattr(HostKVPool, "load", holding(HostKVPool.load))
    hub = InProcHub()
    exec_bus, cm_bus = hub.connect("executor.0"), hub.connect("cache_manager")
    async with anyio.create_task_group() as tg:
        async with cm_bus.subscribe("spill.done", "spill.loaded", "sched.result", "health.ready",
                                    "flip.memory") as sub:  # fmt: skip

            async def next_msg():
                return (await sub.receive()).msg

            async def nothing_yet(why: str) -> None:
                with anyio.move_on_after(0.3):
                    pytest.fail(f"{why}: {await next_msg()}")

            tg.start_soon(run, config, exec_bus)
            with anyio.fail_after(60):
                assert isinstance(await next_msg(), Ready)
                for m in (_prefill(0, 0, [5, 9, 2]), SpillPages(1, [11], [5], [100]),
                          LoadPages(2, [12], [7], [30]), _prefill(1, 1, [6, 10, 3])):  # fmt: skip
                    await cm_bus.publish(m)
                steps = [await next_msg(), await next_msg()]
                assert [(type(m), m.step_id) for m in steps] == [(StepResult, 0), (StepResult, 1)]
                await nothing_yet("answered before its copy was done")
                held[1].release()  # the load, while the spill before it still runs
                assert await next_msg() == PagesLoaded(2, [12], ok=True)
                await nothing_yet("answered before its copy was done")
                held[0].release()  # the loop is idle, waiting for a message
                assert await next_msg() == PagesSpilled(1, [11], ok=True)

                await cm_bus.publish(SpillPages(3, [13], [9], [101]))
                await cm_bus.publish(ReleaseMemory("f1", ["kv_cache"]))
                await nothing_yet("the flip went ahead of the copy")
                held[2].release()
                assert await next_msg() == PagesSpilled(3, [13], ok=True)
                state = await next_msg()
                assert isinstance(state, MemoryState) and state.ok
        tg.cancel_scope.cancel()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("min_run_bytes", [0, 1 << 40])
@pytest.mark.parametrize("page_size", [1, 16])
def test_cuda_copies_match_plain_indexing(min_run_bytes, page_size, monkeypatch):
    """On a GPU, bf16, at the 8B model's KV head shape: a spill (on its copy stream,
    readable once its event is done, behind a forward's write queued before it) and a load
    (queued; read after a synchronize) in both host paths, over runs split by small
    chunks, equal a page-by-page copy; the host pool is page-locked."""
    monkeypatch.setattr(host_pool_module, "_MIN_RUN_BYTES", min_run_bytes)
    monkeypatch.setattr(host_pool_module, "_CHUNK_BYTES", 1 << 20)
    cfg = ModelConfig(family="llama", vocab_size=32, hidden_size=1024, intermediate_size=32,
                      num_layers=4, num_heads=8, num_kv_heads=8, head_dim=128)  # fmt: skip
    pool = KVPool(cfg, 96, page_size=page_size, dtype=torch.bfloat16, device="cuda")
    host = HostKVPool(128, like=pool)
    assert host.pinned
    g = torch.Generator().manual_seed(page_size)
    for t in (pool.k_all, pool.v_all):
        t.copy_(torch.randn(t.shape, generator=g))
    device_pages = torch.randperm(96, generator=g)[:80].tolist()
    host_pages = list(range(100, 128)) + list(range(40, 0, -1)) + [60, 62, 64, 66, 68, 70, 72,
                                                                   74, 76, 78, 80, 82]  # fmt: skip
    torch.cuda._sleep(50_000_000)  # a long kernel, then a write the spill must see
    pool.k_all.mul_(2)
    done = host.spill(pool, device_pages, host_pages)
    done.synchronize()
    for d, h in zip(device_pages, host_pages, strict=True):
        for src, dst in ((pool.k_all, host.k_all), (pool.v_all, host.v_all)):
            assert torch.equal(_page(src, d, page_size).cpu(), _page(dst, h, page_size))
    original = pool.k_all.clone(), pool.v_all.clone()
    pool.k_all.zero_()
    pool.v_all.zero_()
    host.load(pool, host_pages, device_pages)
    torch.cuda.synchronize()
    for d in device_pages:
        for now, then in zip((pool.k_all, pool.v_all), original, strict=True):
            assert torch.equal(_page(now, d, page_size), _page(then, d, page_size))
