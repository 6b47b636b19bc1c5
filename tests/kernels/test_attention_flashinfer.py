"""flashinfer paged attention (kernels/attention_flashinfer.py). Its host page layout
(kernels/page_layout.py) is tested in test_page_layout.py; the slot-table helpers
shared with it are in conftest.py.

CPU tier: the layout checks, the tensor-core choice, that flashinfer reports itself
unavailable without CUDA, and the module's wiring: the decode, extend and
graph-decode tests below also run on the CPU with stand-in wrappers (`_FakeDecode`,
`_FakeExtend`: flashinfer 0.5.3's parameter names and its semantics as the module
reads them: NHD pages, window_left, causal aligned to the end of the KV,
sm_scale * q_scale, fixed buffers read at replay), at a tenth of the long lengths.

`gpu` tier (the `cuda` parameter; needs flashinfer and CUDA): the same tests on the
real wrappers: decode and extend in bf16 against the float32 references
`attention_decode_ref` / `attention_extend_ref`, at page sizes 1 and 16, GQA 32/8
heads with D 128 (tensor-core decode) and 4/2 with D 64 (CUDA-core decode), ragged KV
lengths from 1 to over 1000, extend with and without a cached prefix, sliding windows
(D 128 only, to keep the number of JIT-built kernels small); a `GraphDecode` captured
with torch.cuda.graph and replayed after plans with other lengths; and no device sync
(torch's sync debug mode) in the page-id gather, the plans or the runs.

Tolerances: atol 2e-2, rtol 2e-2 on the bf16 outputs against the float32 reference
rounded to bf16 (the kernels round the softmax weights to bf16 before the second dot)."""

from __future__ import annotations

import itertools
import sys
import types

import pytest
import torch

from shunter.kernels.attention_decode import attention_decode_ref
from shunter.kernels.attention_extend import attention_extend_ref
from shunter.kernels.attention_flashinfer import (
    FlashInferAttention,
    _Geometry,
    decode_uses_tensor_cores,
    flashinfer_available,
)
from shunter.kernels.page_layout import extend_qo_indptr, kv_page_indices, kv_page_layout
from tests.kernels.conftest import _row_table, _scatter

TOL = dict(atol=2e-2, rtol=2e-2)
HEADS = [(32, 8, 128), (4, 2, 64)]  # (num_heads, num_kv_heads, head_dim)


# ---- CPU tier ---------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_flashinfer_unavailable_without_cuda():
    assert flashinfer_available() is False


def test_decode_tensor_core_choice():
    assert decode_uses_tensor_cores(32, 8)  # group 4
    assert not decode_uses_tensor_cores(4, 2)  # group 2
    assert not decode_uses_tensor_cores(8, 8)
    assert decode_uses_tensor_cores(12, 2)  # group 6: no CUDA-core kernel for it


def test_float32_pool_is_refused():
    with pytest.raises(ValueError, match="float32"):
        FlashInferAttention(
            num_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
            dtype=torch.float32, device=torch.device("cpu"), max_num_pages=8,
        )  # fmt: skip


def test_layout_checks():
    g = _Geometry(4, 2, 64, 16, torch.bfloat16, torch.device("cpu"))
    indptr, last = kv_page_layout([17, 3], 16)
    indices = torch.arange(3, dtype=torch.int32)
    assert g.check_paged(indptr, indices, last).tolist() == [17, 3]
    with pytest.raises(ValueError):  # one page id short
        g.check_paged(indptr, indices[:2], last)
    with pytest.raises(ValueError):  # int64 indptr
        g.check_paged(indptr.long(), indices, last)
    with pytest.raises(ValueError):  # a last page longer than a page
        g.check_paged(indptr, indices, torch.tensor([17, 3], dtype=torch.int32))
    k = torch.zeros(64, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError):  # not planned
        g.paged(torch.zeros(2, 4, 64, dtype=torch.bfloat16), k, k, None)
    with pytest.raises(ValueError):  # q dtype differs from the pool's
        g.paged(torch.zeros(2, 4, 64), k, k, 2)
    kp, _ = g.paged(torch.zeros(2, 4, 64, dtype=torch.bfloat16), k, k, 2)
    assert kp.shape == (4, 16, 2, 64)


# ---- gpu tier -----------------------------------------------------------------------


class _FakeDecode:
    """flashinfer 0.5.3's BatchDecodeWithPagedKVCacheWrapper as attention_flashinfer
    calls it (the same parameter names), computed in float32 torch: runs the module's
    wiring on the CPU. In CUDA-graph mode it reads the fixed buffers at run time, as
    a replayed graph does."""

    causal = False

    def __init__(
        self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False,
        use_tensor_cores=False, paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
        paged_kv_last_page_len_buffer=None, backend="auto",
    ):  # fmt: skip
        assert kv_layout == "NHD" and float_workspace_buffer.dtype == torch.uint8
        self.use_tensor_cores, self.backend = use_tensor_cores, backend
        self.fixed = (
            paged_kv_indptr_buffer,
            paged_kv_indices_buffer,
            paged_kv_last_page_len_buffer,
        )
        self.graph = use_cuda_graph

    def plan(
        self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
        page_size, *, window_left=-1, q_data_type="float16", kv_data_type=None, sm_scale=None,
    ):  # fmt: skip
        self._plan(torch.arange(len(last_page_len) + 1), indptr, indices, last_page_len,
                   page_size, window_left, q_data_type, kv_data_type, sm_scale)  # fmt: skip

    def _plan(self, qo, indptr, indices, last, page_size, window_left, q_dtype, kv_dtype, sm_scale):
        assert indptr.device.type == last.device.type == "cpu" and q_dtype == kv_dtype
        if self.graph:
            self.fixed[0].copy_(indptr)
            self.fixed[1][: len(indices)].copy_(indices)
            self.fixed[2].copy_(last)
            indptr, indices, last = self.fixed
        self.p = (qo, indptr, indices, last, page_size, window_left, sm_scale)

    def run(self, q, paged_kv_cache, *, out=None, q_scale=None):
        qo, indptr, indices, last, page_size, window_left, sm_scale = self.p
        k_pages, v_pages = paged_kv_cache  # [num_pages, page_size, Hkv, D]
        indptr, last = indptr.tolist(), last.tolist()
        for b, (q0, q1) in enumerate(zip(qo.tolist(), qo.tolist()[1:])):
            pages = indices[indptr[b] : indptr[b + 1]].long()
            n = (len(pages) - 1) * page_size + last[b]
            k = k_pages[pages].flatten(0, 1)[:n].float()  # [n, Hkv, D]
            v = v_pages[pages].flatten(0, 1)[:n].float()
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            s = torch.einsum("mhd,nhd->hmn", q[q0:q1].float(), k) * sm_scale * q_scale
            q_pos = torch.arange(q1 - q0)[:, None] + n - (q1 - q0)
            k_pos = torch.arange(n)[None, :]
            allowed = k_pos >= q_pos - (window_left if window_left >= 0 else n)
            if self.causal:
                allowed &= k_pos <= q_pos
            s = s.masked_fill(~allowed, float("-inf")).softmax(-1)
            out[q0:q1] = torch.einsum("hmn,nhd->mhd", s, v).to(out.dtype)
        return out


class _FakeExtend(_FakeDecode):
    """BatchPrefillWithPagedKVCacheWrapper, likewise."""

    def plan(
        self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
        num_qo_heads, num_kv_heads, head_dim_qk, page_size, *, causal=False, window_left=-1,
        q_data_type="float16", kv_data_type=None, sm_scale=None,
    ):  # fmt: skip
        self.causal = causal
        self._plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                   page_size, window_left, q_data_type, kv_data_type, sm_scale)  # fmt: skip


class _FakeRagged:
    """BatchPrefillWithRaggedKVCacheWrapper, likewise: the entries' own q/k/v, causal,
    sm_scale fixed at plan time (its run takes no q_scale)."""

    def __init__(self, float_workspace_buffer, kv_layout="NHD", backend="auto"):
        assert kv_layout == "NHD" and float_workspace_buffer.dtype == torch.uint8

    def plan(
        self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, *, causal=False,
        window_left=-1, q_data_type="float16", kv_data_type=None, sm_scale=None,
    ):  # fmt: skip
        assert qo_indptr.device.type == "cpu" and torch.equal(qo_indptr, kv_indptr)
        self.p = (qo_indptr.tolist(), causal, window_left, sm_scale)

    def run(self, q, k, v, *, out=None):
        indptr, causal, window_left, sm_scale = self.p
        for q0, q1 in itertools.pairwise(indptr):
            n = q1 - q0
            rep = q.shape[1] // k.shape[1]
            kk = k[q0:q1].float().repeat_interleave(rep, 1)
            vv = v[q0:q1].float().repeat_interleave(rep, 1)
            s = torch.einsum("mhd,nhd->hmn", q[q0:q1].float(), kk) * sm_scale
            pos = torch.arange(n)
            allowed = pos[None, :] >= pos[:, None] - (window_left if window_left >= 0 else n)
            if causal:
                allowed &= pos[None, :] <= pos[:, None]
            s = s.masked_fill(~allowed, float("-inf")).softmax(-1)
            out[q0:q1] = torch.einsum("hmn,nhd->mhd", s, vv).to(out.dtype)
        return out


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request, monkeypatch):
    """cpu: the fake wrappers above stand in for flashinfer; cuda: the real one."""
    if request.param == "cpu":
        fake = types.SimpleNamespace(
            BatchDecodeWithPagedKVCacheWrapper=_FakeDecode,
            BatchPrefillWithPagedKVCacheWrapper=_FakeExtend,
            BatchPrefillWithRaggedKVCacheWrapper=_FakeRagged,
        )
        monkeypatch.setitem(sys.modules, "flashinfer", fake)
        return torch.device("cpu")
    pytest.importorskip("flashinfer")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return torch.device("cuda", torch.cuda.current_device())


def _long(n, device):
    """A long length on the GPU, a tenth of it for the CPU stand-in."""
    return n if device.type == "cuda" else n // 10


def _setup(heads, page_size, lens, device, seed, num_q_rows=None):
    """A bf16 pool, the entries' slot tables (on the device), a FlashInferAttention,
    its page layout for `lens`, and bf16 queries [num_q_rows or B, H, D]."""
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(seed)
    tables, num_pages = _scatter(lens, page_size, gen)
    num_slots = num_pages * page_size
    k = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    v = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    table, rows = _row_table(tables, len(lens) + 3, gen)
    rows_q = num_q_rows if num_q_rows is not None else len(lens)
    q = torch.randn(rows_q, num_heads, head_dim, generator=gen).to(torch.bfloat16)
    fa = FlashInferAttention(
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        page_size=page_size, dtype=torch.bfloat16, device=device, max_num_pages=num_pages,
        workspace_bytes=(256 << 20) if device.type == "cuda" else 1024,
    )  # fmt: skip
    indptr, last = kv_page_layout(lens, page_size)
    indices = kv_page_indices(table.to(device), rows.to(device), lens, page_size)
    dev_tables = [t.to(device) for t in tables]
    return fa, k.to(device), v.to(device), q.to(device), dev_tables, (indptr, indices, last)


def _windows(heads):
    return [None, 64] if heads[2] == 128 else [None]


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_matches_ref(device, heads, page_size):
    lens = [1, 7, 16, 17, _long(1500, device), 300, 2]
    for window in _windows(heads):
        fa, k, v, q, tables, layout = _setup(heads, page_size, lens, device, seed=page_size)
        scale = heads[2] ** -0.5
        fa.plan_decode(*layout, sliding_window=window)
        out = fa.decode(q, k, v, scale)
        ref = attention_decode_ref(q, k, v, tables, scale, sliding_window=window)
        torch.testing.assert_close(out.float(), ref.float(), **TOL)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_matches_ref(device, heads, page_size):
    entries = [(0, 1), (0, 37), (100, 20), (_long(1200, device), 5), (15, 1), (3, 64)]
    entries.append((0, _long(1100, device)))
    num_new = [n for _, n in entries]
    lens = [p + n for p, n in entries]
    for window in _windows(heads):
        fa, k, v, q, tables, layout = _setup(
            heads, page_size, lens, device, seed=7 + page_size, num_q_rows=sum(num_new)
        )
        scale = heads[2] ** -0.5
        fa.plan_extend(extend_qo_indptr(num_new), *layout, sliding_window=window)
        out = fa.extend(q, k, v, scale)
        ref = attention_extend_ref(q, k, v, num_new, tables, scale, sliding_window=window)
        torch.testing.assert_close(out.float(), ref.float(), **TOL)


@pytest.mark.parametrize("heads", HEADS)
def test_prefill_without_a_prefix_matches_ref(device, heads):
    """The ragged path: every entry's KV is its new tokens, read from the step's own
    k/v (strided views, as the model passes them), against the paged extend reference
    over the same tokens stored in a pool."""
    num_new = [1, 37, 20, _long(1100, device), 64]
    for window in _windows(heads):
        fa, k_pool, v_pool, q, tables, _ = _setup(
            heads, 1, num_new, device, seed=11, num_q_rows=sum(num_new)
        )
        slots = torch.cat(tables)
        k_new, v_new = k_pool[slots], v_pool[slots]  # [T, Hkv, D]
        kv = torch.cat([k_new, v_new], -1)  # strided views like the fused projection's
        scale = heads[2] ** -0.5
        fa.plan_prefill(extend_qo_indptr(num_new), scale, sliding_window=window)
        out = fa.prefill(q, kv[..., : heads[2]], kv[..., heads[2] :], scale)
        ref = attention_extend_ref(q, k_pool, v_pool, num_new, tables, scale, sliding_window=window)
        torch.testing.assert_close(out.float(), ref.float(), **TOL)
        with pytest.raises(ValueError, match="scale"):
            fa.prefill(q, k_new, v_new, scale * 2)


def test_prefill_plan_checks(device):
    fa, k, v, q, _, _ = _setup(HEADS[1], 1, [3], device, seed=12)
    with pytest.raises(RuntimeError, match="plan"):
        fa.prefill(q, k[:3], v[:3], 0.1)
    with pytest.raises(ValueError, match="at least one token"):
        fa.plan_prefill(torch.tensor([0, 2, 2], dtype=torch.int32), 0.1)
    fa.plan_prefill(torch.tensor([0, 3], dtype=torch.int32), 0.1)
    with pytest.raises(ValueError, match="planned for q"):
        fa.prefill(q[:1], k[:3], v[:3], 0.1)


def _capture(gd, q_buf, k, v, scale):
    """The decode of `gd` captured in a CUDA graph (after a warm-up on a side
    stream); off CUDA, a plain call. Returns (replay, out)."""
    if q_buf.device.type != "cuda":
        out = gd.decode(q_buf, k, v, scale)
        return lambda: out.copy_(gd.decode(q_buf, k, v, scale)), out
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gd.decode(q_buf, k, v, scale)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gd.decode(q_buf, k, v, scale)
    return graph.replay, out


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_graph_decode_replays_after_replan(device, heads, page_size):
    lens_a, lens_b = [5, 1, 40, 17], [_long(1300, device), 9, 1, 64]
    scale = heads[2] ** -0.5
    fa, k, v, q, _, _ = _setup(heads, page_size, lens_a + lens_b, device, seed=3)
    gen = torch.Generator().manual_seed(11)
    # two batches over disjoint pages of the same pool
    tables, _ = _scatter(lens_a + lens_b, page_size, gen, spare_pages=0)
    batches = [(lens_a, tables[:4]), (lens_b, tables[4:])]
    q_a, q_b = q[:4].contiguous(), q[4:].contiguous()

    def plan(gd, lens, slot_tables, window=None):
        indptr, last = kv_page_layout(lens, page_size)
        table, rows = _row_table(slot_tables, 4, gen)
        indices = kv_page_indices(table.to(device), rows.to(device), lens, page_size)
        gd.plan(indptr, indices, last, sliding_window=window)

    gd = fa.graph_decoder(4)
    assert fa.graph_decoder(4) is gd
    plan(gd, *batches[0])
    q_buf = q_a.clone()
    replay, out = _capture(gd, q_buf, k, v, scale)
    for (lens, slot_tables), q_new in [(batches[1], q_b), (batches[0], q_a)]:
        plan(gd, lens, slot_tables)
        q_buf.copy_(q_new)
        replay()
        ref = attention_decode_ref(q_new, k, v, [t.to(device) for t in slot_tables], scale)
        torch.testing.assert_close(out.float(), ref.float(), **TOL)
    with pytest.raises(ValueError):  # the captured kernels have no window
        plan(gd, *batches[0], window=8)
    with pytest.raises(ValueError):  # three entries for a decoder of four
        plan(gd, lens_a[:3], batches[0][1][:3])


def test_wrappers_are_configured(device):
    fa, k, v, *_ = _setup((32, 8, 128), 16, [3, 20], device, seed=1)
    gd = fa.graph_decoder(2)
    assert fa.use_tensor_cores and gd.batch_size == 2
    if device.type == "cpu":
        assert fa._decode.use_tensor_cores and fa._extend.backend == "fa2"
        assert gd._decode.graph and gd._decode.fixed[1] is fa._graph_indices
    with pytest.raises(RuntimeError):  # not planned
        gd.decode(torch.zeros(2, 32, 128, dtype=torch.bfloat16, device=device), k, v, 1.0)


@pytest.mark.gpu
def test_plan_and_run_do_not_sync(device):
    if device.type != "cuda":
        pytest.skip("sync checks need CUDA")
    heads, page_size, lens = (32, 8, 128), 16, [3, 700, 1]
    fa, k, v, q, _, layout = _setup(heads, page_size, lens, device, seed=5, num_q_rows=6)
    table = torch.arange(len(lens) * 800, dtype=torch.int64, device=device).view(len(lens), 800)
    rows = torch.arange(len(lens), device=device)
    qo_indptr = extend_qo_indptr([1, 4, 1])
    for _ in range(2):  # the first pass builds kernels and flashinfer's cached buffers
        fa.plan_decode(*layout)
        fa.decode(q[:3], k, v, 0.1)
        fa.plan_extend(qo_indptr, *layout)
        fa.extend(q, k, v, 0.1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        kv_page_indices(table, rows, lens, page_size)
        fa.plan_decode(*layout)
        fa.decode(q[:3], k, v, 0.1)
        fa.plan_extend(qo_indptr, *layout)
        fa.extend(q, k, v, 0.1)
    finally:
        torch.cuda.set_sync_debug_mode(0)
