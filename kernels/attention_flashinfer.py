"""Paged decode and extend attention through flashinfer's paged-KV wrappers: the
flashinfer path beside kernels/attention_decode_triton.py and
kernels/attention_extend_triton.py, with the same semantics as `attention_decode_ref`
and `attention_extend_ref`.

Theory of operation: the pool's per-layer k_cache / v_cache [num_slots, Hkv, D] (slot =
page * page_size + offset) are viewed as [num_pages, page_size, Hkv, D], which is
flashinfer's NHD paged layout, so no KV is copied. An entry's KV is named by its page
ids (kv_indices, on the device) and two host arrays: kv_indptr (where each entry's pages
start in kv_indices) and kv_last_page_len (tokens in its last page);
kernels/page_layout.py builds them without waiting for the device. Once per step,
`plan_*` hands these to flashinfer (which schedules the work on the host and copies its
plan to the device asynchronously); every layer then calls `decode` / `extend`, which
only launch kernels. `plan_extend` and `plan_prefill` check their layout at once but
call flashinfer's planner at the step's first `extend` / `prefill`: by then the first
layer's projections are queued, so the device computes them while the host plans (about
a millisecond before an 8k-token prefill). Extend is causal within the new tokens,
aligned to the end of the KV (flashinfer's causal mask for append). A sliding window of
w keys is flashinfer's window_left = w - 1. The softmax scale arrives with the query:
plans fix sm_scale at 1 and runs pass q_scale=scale (flashinfer multiplies them). A
prefill whose entries have no cached prefix (every KV token is new) attends the step's
own q/k/v through the ragged wrapper (`plan_prefill` / `prefill`; fa3 on Hopper), with
no page indices at all. Decode uses the tensor-core (prefill) kernel for GQA groups of 4
and more, and for the group sizes the CUDA-core decode kernel is not compiled for (it
has 1, 2, 3, 4 and 8). `GraphDecode` is a decode wrapper in flashinfer's CUDA-graph
mode: its indptr, last-page and page-id buffers never move, `plan` copies into them
(stream-ordered), and `decode` is what a graph captures.

Invariants:
- One float workspace per FlashInferAttention, shared by all its wrappers (kernels
  of one stream run one after another).
- flashinfer's plan writes its schedule into a pinned host buffer and copies it to the
  device asynchronously; a wrapper's next plan waits (host side, on an event) until
  that copy has run, so a host running steps ahead cannot overwrite a schedule the
  device has not read yet. Usually the event has long completed.
- The graph decoders of one FlashInferAttention share one page-id buffer of
  max_num_pages: plan a graph decoder and replay its graph before planning another.
- A graph is captured only after one `decode` outside any capture on the same device
  (a warm-up: flashinfer caches small device buffers on first use, and a capture may
  not copy from host memory).
- Entries have 1 <= kv_len, and for extend 1 <= num_new <= kv_len; the new tokens'
  K/V are in the pool before attention runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
# head sizes flashinfer's kernels are built for (others fail when the kernel is made)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
# GQA group sizes flashinfer's CUDA-core decode kernel is compiled for (DISPATCH_GQA_GROUP_SIZE)
CUDA_CORE_DECODE_GROUPS = (1, 2, 3, 4, 8)


def flashinfer_available() -> bool:
    """flashinfer imports and a CUDA device is present. Never raises."""
    try:
        import flashinfer  # noqa: F401

        return torch.cuda.is_available()
    except Exception:
        return False


def decode_uses_tensor_cores(num_heads: int, num_kv_heads: int) -> bool:
    """Groups of 4+ query heads per KV head fill a tensor-core tile well enough to beat
    the CUDA-core kernel; other groups the CUDA-core kernel lacks need it too."""
    group = num_heads // num_kv_heads
    return group >= 4 or group not in CUDA_CORE_DECODE_GROUPS


def _window_left(sliding_window: int | None) -> int:
    if sliding_window is None:
        return -1
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    return sliding_window - 1


class _PlanFence:
    """Orders a wrapper's plans after the device has read the previous plan's pinned
    host copy (see the module's invariants). Off CUDA (tests) there is nothing to order."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._event: torch.cuda.Event | None = None

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def record(self) -> None:
        if self._device.type != "cuda":
            return
        if self._event is None:
            self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(self._device))


def _plan(wrapper: Any, fence: _PlanFence, args: tuple, kwargs: dict) -> None:
    """wrapper.plan(*args, **kwargs) once the device has read the wrapper's last plan."""
    fence.wait()
    wrapper.plan(*args, **kwargs)
    fence.record()


@dataclass(frozen=True)
class _Geometry:
    """The shapes and dtype one pool's attention is planned and checked against."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype
    device: torch.device

    def plan_kwargs(self, sliding_window: int | None) -> dict[str, Any]:
        return dict(
            window_left=_window_left(sliding_window),
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
            sm_scale=1.0,  # the scale comes with each run as q_scale
        )

    def check_paged(
        self,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_last_page_len: torch.Tensor,
    ) -> torch.Tensor:
        """Host checks of a page layout (no device reads); returns the host kv lengths."""
        for name, t in (("kv_indptr", kv_indptr), ("kv_last_page_len", kv_last_page_len)):
            if t.dtype != torch.int32 or t.device.type != "cpu" or t.dim() != 1:
                raise ValueError(f"{name} must be a 1-D int32 host tensor")
        if kv_indices.dtype != torch.int32 or kv_indices.device != self.device:
            raise ValueError(f"kv_indices must be int32 on {self.device}")
        batch = kv_last_page_len.shape[0]
        if kv_indptr.shape[0] != batch + 1 or batch < 1 or int(kv_indptr[0]) != 0:
            raise ValueError("kv_indptr must be [B+1] starting at 0 for B >= 1 entries")
        num_pages = kv_indptr[1:] - kv_indptr[:-1]
        if int(num_pages.min()) < 1:
            raise ValueError("every entry needs at least one page")
        if int(kv_last_page_len.min()) < 1 or int(kv_last_page_len.max()) > self.page_size:
            raise ValueError(f"kv_last_page_len must lie in 1..{self.page_size}")
        if kv_indices.shape[0] != int(kv_indptr[-1]):
            raise ValueError(
                f"{kv_indices.shape[0]} page ids for kv_indptr[-1]={int(kv_indptr[-1])}"
            )
        return (num_pages.to(torch.int64) - 1) * self.page_size + kv_last_page_len

    def paged(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_rows: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Checks a run's inputs; returns the pool viewed as NHD pages."""
        if num_rows is None:
            raise RuntimeError("plan before running attention")
        shape = (num_rows, self.num_heads, self.head_dim)
        if tuple(q.shape) != shape or q.stride(-1) != 1:
            raise ValueError(
                f"q must be {list(shape)} with a contiguous last axis, got {list(q.shape)}"
            )
        for t in (q, k_cache, v_cache):
            if t.dtype != self.dtype:
                raise ValueError(f"planned for {self.dtype}, got {t.dtype}")
        kv_shape = (k_cache.shape[0], self.num_kv_heads, self.head_dim)
        if k_cache.shape != kv_shape or v_cache.shape != kv_shape:
            raise ValueError(f"k_cache/v_cache must be {list(kv_shape)}, got {list(v_cache.shape)}")
        pages = (-1, self.page_size, self.num_kv_heads, self.head_dim)
        return k_cache.view(pages), v_cache.view(pages)  # [num_pages, page_size, Hkv, D]


class _Decoder:
    """Decode through one flashinfer BatchDecodeWithPagedKVCacheWrapper: plan once
    per step, then run once per layer."""

    def __init__(self, geometry: _Geometry, wrapper: Any) -> None:
        self.geometry = geometry
        self._decode = wrapper
        self._decode_fence = _PlanFence(geometry.device)
        self._decode_rows: int | None = None
        self._sliding_window: int | None = None

    def plan_decode(
        self,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_last_page_len: torch.Tensor,
        *,
        sliding_window: int | None = None,
    ) -> None:
        """kv_indptr [B+1] and kv_last_page_len [B] int32 on the host; kv_indices
        [nnz] int32 page ids on the device (kept by reference: do not overwrite them
        until this plan's last `decode`)."""
        g = self.geometry
        g.check_paged(kv_indptr, kv_indices, kv_last_page_len)
        self._check_plan(kv_indices, kv_last_page_len, sliding_window)
        self._decode_fence.wait()
        self._decode.plan(
            kv_indptr, kv_indices, kv_last_page_len,
            g.num_heads, g.num_kv_heads, g.head_dim, g.page_size,
            **g.plan_kwargs(sliding_window),
        )  # fmt: skip
        self._decode_fence.record()
        self._decode_rows = kv_last_page_len.shape[0]
        self._sliding_window = sliding_window

    def _check_plan(
        self, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor, window: int | None
    ) -> None:
        """What a plan must also satisfy beyond a valid layout (nothing here)."""

    def decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q: [B, H, D]; k_cache, v_cache: [num_slots, Hkv, D] -> [B, H, D]. Launches
        kernels only."""
        paged = self.geometry.paged(q, k_cache, v_cache, self._decode_rows)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        return self._decode.run(q, paged, out=out, q_scale=scale)


class FlashInferAttention(_Decoder):
    """One pool's decode and extend attention through flashinfer's paged wrappers
    (eager decode: `plan_decode` / `decode`, from _Decoder)."""

    def __init__(
        self,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        max_num_pages: int,
        workspace_bytes: int = 256 << 20,
    ) -> None:
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"flashinfer attention supports bfloat16/float16 pools, not {dtype}")
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"flashinfer attention supports head_dim {SUPPORTED_HEAD_DIMS}, "
                             f"not {head_dim}")  # fmt: skip
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
        import flashinfer

        self._fi = flashinfer
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())  # tensors say cuda:N
        g = _Geometry(num_heads, num_kv_heads, head_dim, page_size, dtype, device)
        self.max_num_pages = max_num_pages
        self.use_tensor_cores = decode_uses_tensor_cores(num_heads, num_kv_heads)
        # [workspace_bytes] uint8: split-KV partial outputs; flashinfer wants it zeroed once
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)
        decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores
        )
        super().__init__(g, decode)
        # fa2: the SM90 fa3 path would re-index every page into per-token offsets
        self._extend = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend="fa2"
        )
        self._extend_fence = _PlanFence(device)
        self._extend_rows: int | None = None
        self._extend_pending: tuple[tuple, dict] | None = None  # plan() args, until the run
        # prefill with no cached prefix: the new tokens' own q/k/v, no page walk ("auto"
        # takes the SM90 fa3 kernels on Hopper, fa2 elsewhere)
        self._ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
            self.workspace, "NHD", backend="auto"
        )
        self._ragged_fence = _PlanFence(device)
        self._ragged_rows: int | None = None
        self._ragged_pending: tuple[tuple, dict] | None = None
        self._ragged_scale = 0.0
        # [max_num_pages] int32: page ids of every graph decoder (one plan+replay at a time)
        self._graph_indices = torch.zeros(max_num_pages, dtype=torch.int32, device=device)
        self._graph_decoders: dict[int, GraphDecode] = {}

    def plan_extend(
        self,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_last_page_len: torch.Tensor,
        *,
        sliding_window: int | None = None,
    ) -> None:
        """qo_indptr [B+1] int32 on the host (the entries' new tokens in the query
        rows); the KV layout as in `plan_decode`, each entry's KV including its new
        tokens."""
        g = self.geometry
        kv_lens = g.check_paged(kv_indptr, kv_indices, kv_last_page_len)
        if qo_indptr.dtype != torch.int32 or qo_indptr.device.type != "cpu":
            raise ValueError("qo_indptr must be an int32 host tensor")
        if qo_indptr.shape != kv_indptr.shape or int(qo_indptr[0]) != 0:
            raise ValueError("qo_indptr must be [B+1] starting at 0, like kv_indptr")
        num_new = (qo_indptr[1:] - qo_indptr[:-1]).to(torch.int64)
        if int(num_new.min()) < 1 or bool((num_new > kv_lens).any()):
            raise ValueError("every extend entry needs 1 <= new tokens <= its KV length")
        self._extend_pending = (
            (qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
             g.num_heads, g.num_kv_heads, g.head_dim, g.page_size),
            dict(causal=True, **g.plan_kwargs(sliding_window)),
        )  # fmt: skip
        self._extend_rows = int(qo_indptr[-1])

    def extend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q: [T, H, D] (T = qo_indptr[-1]); k_cache, v_cache: [num_slots, Hkv, D]
        -> [T, H, D]."""
        paged = self.geometry.paged(q, k_cache, v_cache, self._extend_rows)
        if self._extend_pending is not None:
            _plan(self._extend, self._extend_fence, *self._extend_pending)
            self._extend_pending = None
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        return self._extend.run(q, paged, out=out, q_scale=scale)

    def plan_prefill(
        self, qo_indptr: torch.Tensor, scale: float, *, sliding_window: int | None = None
    ) -> None:
        """Plan a prefill of entries with no cached prefix: qo_indptr [B+1] int32 on the
        host names each entry's new tokens, which are all of its KV. The ragged wrapper
        takes no q_scale, so the softmax scale is fixed here."""
        g = self.geometry
        if qo_indptr.dtype != torch.int32 or qo_indptr.device.type != "cpu":
            raise ValueError("qo_indptr must be an int32 host tensor")
        if qo_indptr.dim() != 1 or qo_indptr.shape[0] < 2 or int(qo_indptr[0]) != 0:
            raise ValueError("qo_indptr must be [B+1] starting at 0 for B >= 1 entries")
        if int((qo_indptr[1:] - qo_indptr[:-1]).min()) < 1:
            raise ValueError("every prefill entry needs at least one token")
        self._ragged_pending = (
            (qo_indptr, qo_indptr, g.num_heads, g.num_kv_heads, g.head_dim),
            dict(causal=True, **{**g.plan_kwargs(sliding_window), "sm_scale": scale}),
        )  # fmt: skip
        self._ragged_rows = int(qo_indptr[-1])
        self._ragged_scale = scale

    def prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D], the same tokens' keys and values (any
        token stride) -> [T, H, D], causal within each entry."""
        g = self.geometry
        if self._ragged_rows is None:
            raise RuntimeError("plan before running attention")
        if scale != self._ragged_scale:
            raise ValueError(f"prefill planned with scale {self._ragged_scale}, run with {scale}")
        shape = (self._ragged_rows, g.num_heads, g.head_dim)
        kv_shape = (self._ragged_rows, g.num_kv_heads, g.head_dim)
        if tuple(q.shape) != shape or tuple(k.shape) != kv_shape or k.shape != v.shape:
            raise ValueError(f"prefill planned for q {list(shape)} and k/v {list(kv_shape)}, "
                             f"got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}")  # fmt: skip
        for t in (q, k, v):
            if t.dtype != g.dtype:
                raise ValueError(f"planned for {g.dtype}, got {t.dtype}")
        if self._ragged_pending is not None:
            _plan(self._ragged, self._ragged_fence, *self._ragged_pending)
            self._ragged_pending = None
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        # the kernels take token and head strides for q, k and v alike: the model's
        # views of its qkv projection are read in place, not copied
        return self._ragged.run(q, k, v, out=out)

    def graph_decoder(self, batch_size: int) -> GraphDecode:
        """The decoder for exactly `batch_size` entries (one per size, made on first use)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if batch_size not in self._graph_decoders:
            self._graph_decoders[batch_size] = GraphDecode(self, batch_size)
        return self._graph_decoders[batch_size]


class GraphDecode(_Decoder):
    """Decode for exactly `batch_size` entries whose buffers never move (capturable).

    Call `plan` (= `plan_decode`) before each replay, outside the graph; `decode` is
    what gets captured. Pad a smaller batch up to batch_size with 1-token entries on
    any page."""

    def __init__(self, owner: FlashInferAttention, batch_size: int) -> None:
        g = owner.geometry
        self.batch_size = batch_size
        self.max_num_pages = owner.max_num_pages
        # fixed device buffers the captured kernels read: [B+1], [max_num_pages], [B] int32
        self._indptr = torch.arange(batch_size + 1, dtype=torch.int32, device=g.device)
        self._indices = owner._graph_indices
        self._last_page_len = torch.ones(batch_size, dtype=torch.int32, device=g.device)
        wrapper = owner._fi.BatchDecodeWithPagedKVCacheWrapper(
            owner.workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=owner.use_tensor_cores,
            paged_kv_indptr_buffer=self._indptr,
            paged_kv_indices_buffer=self._indices,
            paged_kv_last_page_len_buffer=self._last_page_len,
        )
        super().__init__(g, wrapper)

    plan = _Decoder.plan_decode

    def _check_plan(
        self, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor, window: int | None
    ) -> None:
        """Exactly batch_size entries, at most max_num_pages page ids (they are copied
        into the fixed buffer), and the window of the first plan (graphs bake it in)."""
        if kv_last_page_len.shape[0] != self.batch_size:
            raise ValueError(
                f"decoder of {self.batch_size} entries got {kv_last_page_len.shape[0]}"
            )
        if kv_indices.shape[0] > self.max_num_pages:
            raise ValueError(f"{kv_indices.shape[0]} page ids > max_num_pages={self.max_num_pages}")
        if self._decode_rows is not None and window != self._sliding_window:
            raise ValueError(f"decoder planned for window {self._sliding_window}, not {window}")
