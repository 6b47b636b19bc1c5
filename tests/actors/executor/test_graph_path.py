"""The runner's device-slot-table and decode-graph paths against the plain runner.

On the CPU the graph path runs eagerly (`capture=False`) over the same padded
[5, bucket] input blocks, padding row and padding slot that a CUDA replay reads, and
attention reads the device slot table through row plans. A scripted run (prefills,
a row opened on a cached prefix whose first step is a single token, padded decode
batches, a mixed decode + extend step) must give the same logits as a runner that
attends from the ForwardInput's own slot tables. Float32; tolerance 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from shunter.actors.executor import backends as backends_mod
from shunter.actors.executor import runner as runner_mod
from shunter.actors.executor.backends import (
    TRITON_DECODE_MAX_BS,
    decode_backend_for,
    resolve_backend,
)
from shunter.actors.executor.cuda_graph import DecodeGraphs, capture_sizes
from shunter.actors.executor.kv_pool import KVPool
from shunter.actors.executor.loader import load_model
from shunter.actors.executor.models.attention import build_attention_context
from shunter.actors.executor.runner import ForwardInput, ModelRunner
from shunter.actors.executor.slot_table import PinnedStager, long_tensor


class Script:
    """Rows of token slots over pages handed out in order, and ForwardInputs for them."""

    def __init__(self, page_size: int) -> None:
        self.ps = page_size
        self.next_page = 0
        self.slots: dict[int, list[int]] = {}
        self.opened: set[int] = set()
        self.gen = torch.Generator().manual_seed(7)

    def _grow(self, row: int, n: int) -> None:
        s = self.slots.setdefault(row, [])
        for _ in range(n):
            if len(s) % self.ps == 0:
                self.next_page += 1
                page = self.next_page
                s_page = page
            else:
                s_page = s[-1] // self.ps
            s.append(s_page * self.ps + len(s) % self.ps)

    def share(self, row: int, src: int, num_tokens: int) -> None:
        """Open `row` on the first num_tokens (whole pages) of src's slots."""
        assert num_tokens % self.ps == 0
        self.slots[row] = list(self.slots[src][:num_tokens])

    def step(self, entries: list[tuple[int, int]]) -> ForwardInput:
        """entries: (row, new tokens)."""
        ids, pos, nn, sl, tables, rows, fresh, last = [], [], [], [], [], [], [], []
        for row, n in entries:
            start = len(self.slots.get(row, []))
            self._grow(row, n)
            ids += torch.randint(0, 256, (n,), generator=self.gen).tolist()
            pos += range(start, start + n)
            nn.append(n)
            sl.append(start + n)
            tables.append(torch.tensor(self.slots[row]))
            rows.append(row)
            fresh.append(row not in self.opened)
            self.opened.add(row)
            last.append(len(ids) - 1)
        return ForwardInput(
            input_ids=torch.tensor(ids), positions=torch.tensor(pos), num_new_tokens=nn,
            seq_lens=sl, slot_tables=tables, logits_indices=torch.tensor(last),
            row_ids=rows, fresh=fresh,
        )  # fmt: skip


@pytest.mark.parametrize(("name", "page_size", "sizes"),
                         [("llama", 1, None), ("mistral_window", 4, None), ("llama", 1, (3,))])  # fmt: skip
def test_table_and_padded_graph_path_match_plain_runner(tiny_model_dir, name, page_size, sizes):
    """sizes: --cuda-graph-bs (3 and the largest, 5: two- and one-entry steps pad to 3)."""
    model, config = load_model(str(tiny_model_dir(name)), progress=False)
    plain = ModelRunner(model, KVPool(config, 64, page_size=page_size))
    graph = ModelRunner(
        model, KVPool(config, 64, page_size=page_size, pad_page=True), attention_backend="torch",
        max_num_rows=8, max_context_len=64, slot_table=True, cuda_graph_max_bs=5, capture=False,
        cuda_graph_sizes=sizes,
    )  # fmt: skip
    assert graph.graphs is not None
    assert graph.graphs.sizes == ([1, 2, 4, 5] if sizes is None else [3, 5])
    s = Script(page_size)
    steps = [[(3, 5), (0, 9)]]
    steps += [[(3, 1), (0, 1)]] * 2
    steps.append("share")  # row 5 opens on row 0's first page(s): a fresh one-token entry
    steps += [[(3, 1), (5, 1), (0, 1)]] * 3
    steps.append([(3, 1), (0, 3), (5, 1)])  # mixed: eager, decode rows from the table
    steps += [[(5, 1), (3, 1), (0, 1)]] * 2 + [[(0, 1)]]
    for entries in steps:
        if entries == "share":
            s.share(5, 0, 4)
            continue
        inp = s.step(entries)
        want = plain.forward(inp)
        got = graph.forward(inp)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert graph.graphs.num_replays == 8  # every all-decode step went through a bucket
    # the padding slot absorbed the padded entries' K/V; no handed-out slot was touched
    pad = graph.kv_pool.pad_slot
    assert pad == 64 * page_size
    used = {t for row in s.slots.values() for t in row}
    for k_p, k_g in zip(plain.kv_pool.k_buffers, graph.kv_pool.k_buffers, strict=True):
        idx = torch.tensor(sorted(used))
        torch.testing.assert_close(k_g[idx], k_p[idx], atol=1e-5, rtol=1e-5)


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(10) == [1, 2, 4, 8, 10]
    assert capture_sizes(256)[-3:] == [224, 240, 256]
    with pytest.raises(ValueError):
        capture_sizes(0)
    assert capture_sizes(16, [1, 4, 64, 8]) == [1, 4, 8, 16]  # --cuda-graph-bs, capped
    with pytest.raises(ValueError):
        capture_sizes(8, [0, 8])


def test_slot_table_rejects_rows_outside_it(tiny_model_dir):
    model, config = load_model(str(tiny_model_dir("llama")), progress=False)
    r = ModelRunner(model, KVPool(config, 16), max_num_rows=2, max_context_len=16, slot_table=True)
    s = Script(1)
    with pytest.raises(ValueError, match="slot table"):
        r.forward(s.step([(2, 3)]))


def test_attention_backend_resolution():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_backend("auto", cpu, torch.float32) == "torch"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_backend("triton", cpu, torch.bfloat16)
    assert resolve_backend("triton", cuda, torch.float32) == "triton"
    assert resolve_backend("auto", cuda, torch.float32) == "triton"  # flashinfer: no fp32
    assert resolve_backend("auto", cuda, torch.bfloat16, head_dim=16) == "triton"
    with pytest.raises(ValueError, match="head_dim"):
        resolve_backend("flashinfer", cuda, torch.bfloat16, head_dim=16)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        resolve_backend("flashinfer", cuda, torch.float32)


M = TRITON_DECODE_MAX_BS
SMALL = 4  # a crossover the runner tests below patch in, to fit a small table
DECODE_BACKENDS = [
    # (runner backend, requested, batch size, decode kernels)
    ("torch", "auto", 1, "torch"), ("torch", "triton", 1, "torch"),
    ("triton", "auto", 1, "triton"), ("triton", "auto", 512, "triton"),
    ("triton", "triton", 512, "triton"),
    ("flashinfer", "auto", 1, "triton"), ("flashinfer", "auto", M, "triton"),
    ("flashinfer", "auto", M + 1, "flashinfer"), ("flashinfer", "auto", 512, "flashinfer"),
    ("flashinfer", "triton", 512, "triton"), ("flashinfer", "flashinfer", 1, "flashinfer"),
]  # fmt: skip


@pytest.mark.parametrize(("backend", "requested", "bs", "want"), DECODE_BACKENDS)
def test_decode_backend_for(backend, requested, bs, want):
    assert decode_backend_for(backend, requested, bs) == want


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_flashinfer_decode_needs_the_flashinfer_backend(backend):
    with pytest.raises(ValueError, match="needs --attention-backend flashinfer"):
        decode_backend_for(backend, "flashinfer", 1)


@pytest.mark.parametrize("requested", ["triton", "flashinfer"])
def test_cpu_runner_refuses_cuda_decode_kernels(tiny_model_dir, requested):
    model, config = load_model(str(tiny_model_dir("llama")), progress=False)
    assert ModelRunner(model, KVPool(config, 16)).decode_backend(1) == "torch"
    with pytest.raises(ValueError, match=f"decode attention backend '{requested}' needs a CUDA"):
        ModelRunner(model, KVPool(config, 16), decode_attention_backend=requested)


class _Planned(Exception):
    """Raised where the stand-in flashinfer runner would plan a flashinfer wrapper."""


def _plan(inp, out_slots, rows):
    raise _Planned(len(inp.num_new_tokens))


def test_flashinfer_runner_decodes_small_batches_on_the_row_path(tiny_model_dir, monkeypatch):
    """A CPU runner posing as a flashinfer one (its flashinfer planning replaced): an
    all-decode step that decode_backend gives to triton reads the row table and matches
    the plain runner; every other step goes to flashinfer. The crossover is lowered to
    SMALL so that both sides fit a small table."""
    monkeypatch.setattr(backends_mod, "TRITON_DECODE_MAX_BS", SMALL)
    M = SMALL
    model, config = load_model(str(tiny_model_dir("llama")), progress=False)
    plain = ModelRunner(model, KVPool(config, 128))
    fi = ModelRunner(model, KVPool(config, 128), attention_backend="torch", max_num_rows=16,
                     max_context_len=64, slot_table=True)  # fmt: skip
    s = Script(1)
    rows = list(range(M + 1))
    prefill = s.step([(r, 3) for r in rows])
    plain.forward(prefill)
    fi.forward(prefill)
    monkeypatch.setattr(fi, "_flashinfer_context", _plan)
    fi.backend, fi.flashinfer = "flashinfer", object()

    def run(entries, requested):
        fi.decode_attention_backend = requested
        inp = s.step(entries)
        want = plain.forward(inp)
        try:
            got = fi.forward(inp)
        except _Planned:
            return "flashinfer"
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        return "triton"

    assert run([(r, 1) for r in rows[:M]], "auto") == "triton"
    assert run([(r, 1) for r in rows], "triton") == "triton"
    # the steps below plan flashinfer before the model runs: nothing is compared after
    assert run([(r, 1) for r in rows], "auto") == "flashinfer"
    assert run([(0, 1)], "flashinfer") == "flashinfer"
    assert run([(0, 1), (1, 2)], "triton") == "flashinfer"  # a mixed step: never triton


class _FakeFlashInfer:
    def graph_decoder(self, batch_size: int) -> tuple[str, int]:
        return ("decoder", batch_size)


@pytest.mark.parametrize(
    ("requested", "buckets"),
    [("auto", [b for b in capture_sizes(16) if b > SMALL]), ("triton", []),
     ("flashinfer", capture_sizes(16))],
)  # fmt: skip
def test_graph_buckets_hold_flashinfer_decoders_only_where_it_decodes(
    tiny_model_dir, monkeypatch, requested, buckets
):
    monkeypatch.setattr(backends_mod, "TRITON_DECODE_MAX_BS", SMALL)
    model, config = load_model(str(tiny_model_dir("llama")), progress=False)
    r = ModelRunner(model, KVPool(config, 64, pad_page=True), attention_backend="torch",
                    max_num_rows=16, max_context_len=64, slot_table=True)  # fmt: skip
    r.backend, r.flashinfer, r.decode_attention_backend = "flashinfer", _FakeFlashInfer(), requested
    graphs = DecodeGraphs(r, 16, capture=False)
    assert sorted(graphs._fi) == buckets
    assert all(graphs._fi[b] == ("decoder", b) for b in buckets)


def test_slot_table_decode_fast_path_writes_and_checks():
    from shunter.actors.executor.slot_table import DeviceSlotTable

    t = DeviceSlotTable(3, 8, pad_slot=99, device=torch.device("cpu"))
    tables = [torch.tensor([5, 6, 7]), torch.tensor([1])]
    t.update([0, 2], [True, True], [3, 1], [3, 1], tables)  # prefills: the generic path
    tables = [torch.tensor([5, 6, 7, 9]), torch.tensor([1, 4])]
    t.update([0, 2], [False, False], [1, 1], [4, 2], tables, torch.tensor([9, 4]))
    assert t.table[0, :4].tolist() == [5, 6, 7, 9] and t.table[2, :2].tolist() == [1, 4]
    assert t.table[3, 0] == 99  # the padding row
    with pytest.raises(ValueError, match="slot table"):
        t.update([3], [False], [1], [1], [torch.tensor([0])], torch.tensor([0]))
    with pytest.raises(ValueError, match="slot table"):
        t.update([0], [False], [1], [9], [torch.arange(9)], torch.tensor([8]))


@pytest.mark.parametrize("num_rows", [3, 12])  # slices per entry; one scatter
def test_slot_table_writes_fresh_and_extended_rows(num_rows):
    """The generic path (prefills, extends, fresh rows with a prefix) leaves every row
    of the device table equal to its host slot table, whichever way it writes."""
    from shunter.actors.executor.slot_table import SLICE_MAX_ENTRIES, DeviceSlotTable

    assert (num_rows <= SLICE_MAX_ENTRIES) == (num_rows == 3)
    g = torch.Generator().manual_seed(num_rows)
    t = DeviceSlotTable(num_rows, 64, pad_slot=999, device=torch.device("cpu"))
    host = [torch.randperm(900, generator=g)[:40] for _ in range(num_rows)]
    lens = [5 + 2 * r for r in range(num_rows)]
    rows = list(range(num_rows))
    t.update(rows, [True] * num_rows, lens, lens, [h[:n] for h, n in zip(host, lens)])
    more = [1 + r % 4 for r in rows]  # then extend every row by 1-4 tokens
    ends = [n + m for n, m in zip(lens, more)]
    t.update(rows, [False] * num_rows, more, ends, [h[:e] for h, e in zip(host, ends)])
    for r, e in zip(rows, ends):
        assert t.table[r, :e].tolist() == host[r][:e].tolist()
    assert t.table[num_rows, 0] == 999


def test_long_tensor_equals_torch_tensor_of_the_list():
    from shunter.actors.executor.slot_table import long_tensor

    values = [5, -1, 2**40, 0, 7]
    t = long_tensor(values)
    assert t.dtype == torch.int64 and torch.equal(t, torch.tensor(values))
    values[0] = 99  # the tensor owns its buffer, not the list
    assert int(t[0]) == 5
    t += 1  # and it is writable
    assert long_tensor([]).shape == (0,) and long_tensor([]).dtype == torch.int64
    with pytest.raises(TypeError):
        long_tensor([1.5])


@pytest.mark.parametrize(("crossover", "want_pages"), [(256, 0), (SMALL, 16 * 64)])
def test_graph_page_buffer_is_sized_for_flashinfer_buckets_only(
    tiny_model_dir, monkeypatch, crossover, want_pages
):
    """The flashinfer graph decoders' shared page-id buffer holds what the largest
    flashinfer bucket can name (16 rows x 64 positions here); with every bucket on the
    Triton kernel it is only the pool's size."""
    from shunter.actors.executor import runner as runner_mod
    from shunter.kernels import attention_flashinfer as fi_mod

    made: dict = {}

    class _Recording(_FakeFlashInfer):
        def __init__(self, **kw) -> None:
            made.update(kw)

    monkeypatch.setattr(fi_mod, "FlashInferAttention", _Recording)
    monkeypatch.setattr(runner_mod, "resolve_backend", lambda *a, **k: "flashinfer")
    monkeypatch.setattr(backends_mod, "TRITON_DECODE_MAX_BS", crossover)
    model, config = load_model(str(tiny_model_dir("llama")), progress=False)
    pool = KVPool(config, 64, pad_page=True)
    r = ModelRunner(model, pool, max_num_rows=16, max_context_len=64, slot_table=True,
                    cuda_graph_max_bs=16, capture=False)  # fmt: skip
    assert r.backend == "flashinfer"
    assert made["max_num_pages"] == max(pool.num_pages + 1, want_pages)
    assert bool(r.graphs._fi) == (want_pages > 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_stager_grows_its_whole_ring_at_the_first_long_staging():
    """A staging longer than the ring's buffers grows all of them at once (one round
    of pinned allocations), and every staging, long or short, arrives intact while the
    ring turns over more than once."""
    from shunter.actors.executor.slot_table import RING, PinnedStager

    st = PinnedStager(torch.device("cuda"), min_elems=16)
    for i in range(2 * RING + 1):
        v = torch.arange(1000 - i) * 3 if i % 3 else torch.arange(5) + i
        assert torch.equal(st.stage([v[:7], v[7:]]).cpu(), v)
        if i == 1:
            assert st.capacity >= 999


def test_extend_entries_read_their_slots_from_the_row_table(tiny_model_dir, monkeypatch):
    """With a row table, a step's extend entries get Triton metadata over that table
    (their rows and lengths, no padded copy of their slot tables), and those rows hold
    their slots when the step runs; every staged vector a kernel reads starts on a
    16-byte boundary, whatever the step's token and entry counts (Triton would build a
    kernel again for another alignment); the logits match the plain runner's."""
    model, config = load_model(str(tiny_model_dir("llama")), progress=False)
    plain = ModelRunner(model, KVPool(config, 64))
    tab = ModelRunner(model, KVPool(config, 64), attention_backend="torch", max_num_rows=8,
                      max_context_len=64, slot_table=True)  # fmt: skip
    contexts = []

    def spy(*args, **kwargs):
        contexts.append(build_attention_context(*args, **kwargs))
        return contexts[-1]

    monkeypatch.setattr(runner_mod, "build_attention_context", spy)
    s = Script(1)
    # prefills; a decode beside a new row's prefill and a continued row's extend; then
    # odd token and entry counts
    for entries in ([(3, 5), (0, 9)], [(3, 1), (6, 4), (0, 3)], [(6, 1), (3, 2)]):
        inp = s.step(entries)
        got = tab.forward(inp)
        ctx = contexts[-1]
        meta = ctx.extend_plan.device_meta
        ext = [(r, n) for r, n in entries if n > 1]
        assert meta.table is tab.slot_table.table
        assert meta.rows.tolist() == [r for r, _ in ext]
        assert meta.num_new.tolist() == [n for _, n in ext]
        assert meta.seq_lens.tolist() == [len(s.slots[r]) for r, _ in ext]
        assert meta.q_starts.tolist() == [0, ext[0][1]][: len(ext)]
        assert (meta.max_num_new, meta.max_seq_len) == (max(n for _, n in ext),
                                                        max(meta.seq_lens.tolist()))  # fmt: skip
        for r, _ in ext:
            assert meta.table[r, : len(s.slots[r])].tolist() == s.slots[r]
        staged = [ctx.out_slots, meta.rows, meta.q_starts, meta.num_new, meta.seq_lens]
        if ctx.decode_plan is not None:
            staged += [ctx.decode_plan.rows, ctx.decode_plan.kv_lens]
        assert all(t.data_ptr() % 16 == 0 for t in staged)
        torch.testing.assert_close(got, plain.forward(inp), atol=1e-5, rtol=1e-5)


def test_staged_views_start_on_16_byte_boundaries():
    stager = PinnedStager(torch.device("cpu"))
    parts = [long_tensor(list(range(n))) for n in (3, 1, 0, 4, 7, 2)]
    views = stager.stage_views(parts)
    for p, v in zip(parts, views, strict=True):
        assert torch.equal(p, v) and v.data_ptr() % 16 == 0
