"""Decode steps replayed from CUDA graphs, one per batch-size bucket.

Theory of operation
-------------------
A decode step of B entries launches hundreds of small kernels; at small B the host
cannot launch them as fast as the GPU runs them. `DecodeGraphs` captures the whole
decode forward (embedding, every layer, final norm, logits) once per bucket size
(`capture_sizes`: 1, 2, 4, 8, 12, 16, 24, ... up to `max_bs`) and replays it. Each
bucket owns a [5, bucket] int64 input block (input ids, positions, rows of the
device slot table, KV lengths, output slots) that the captured kernels read; a
replay of B <= bucket entries writes the block with one pinned host-to-device copy,
entries B.. padded with the padding row (length 1, padding slot: see kv_pool.py and
slot_table.py), and returns the first B rows of the bucket's logits.

Attention in a captured step reads the device slot table through a row plan whose
length bound is the table's width, so the split count is fixed per bucket and each
entry splits its own length on the device. Under flashinfer each bucket whose
`runner.decode_backend(bucket)` is "flashinfer" (by default those above
backends.TRITON_DECODE_MAX_BS) has its own fixed-buffer decode wrapper, planned on the
host before each replay (outside the graph) from the same rows and lengths; the other
buckets capture the Triton row path, as under the triton backend.

The rope table is grown to the table's width before capture, so no captured step
ever reallocates it. Captures run largest first and share one memory pool.

Invariants: a replay's entries are all decode (one new token each), within the slot
table (runner.forward checks), and the table holds every slot before their new one (a
row that just opened is copied by runner.forward first); `run` writes the new slots
from the staged block before anything reads them; the
returned logits are a view of the bucket's output, valid until the next replay of
that bucket (the executor samples from them before it launches another step).
Without CUDA (`capture=False`) the same padded path runs eagerly: what the CPU tests
check.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from shunter.actors.executor.models.attention import AttentionContext, RowDecode
from shunter.actors.executor.slot_table import long_tensor

if TYPE_CHECKING:
    from shunter.actors.executor.runner import ForwardInput, ModelRunner

_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160, 176,
            192, 208, 224, 240, 256, 288, 320, 352, 384, 448, 512)  # fmt: skip


def capture_sizes(largest: int, sizes: Sequence[int] | None = None,
                  defaults: Sequence[int] = _BUCKETS) -> list[int]:  # fmt: skip
    """The bucket sizes captured up to `largest` (itself included): the `defaults` below
    it, or the given `sizes` below it (--cuda-graph-bs, --piecewise-cuda-graph-tokens)."""
    if largest < 1:
        raise ValueError(f"the largest graph size must be >= 1, got {largest}")
    if sizes is not None and (not sizes or min(sizes) < 1):
        raise ValueError(f"graph sizes must be >= 1, got {list(sizes)}")
    below = defaults if sizes is None else sizes
    return sorted({b for b in below if b < largest} | {largest})


def capture_stream(runner: ModelRunner, stream: torch.cuda.Stream | None) -> torch.cuda.Stream:
    """The side stream a graph set captures on (`stream`, or a new one the first time:
    see DecodeGraphs.__init__), once the rope table is grown to the slot table's width
    (never inside a graph) and the current stream's queued work comes before it."""
    assert runner.slot_table is not None, "graphs read the device slot table's width"
    runner.model.cos_sin_cache(runner.slot_table.width)
    if stream is None:
        stream = torch.cuda.Stream(runner.device)
    stream.wait_stream(torch.cuda.current_stream(runner.device))
    return stream


def bucket_of(sizes: list[int], n: int) -> int | None:
    """The smallest of the sorted `sizes` >= n, or None if n is above them all."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class DecodeGraphs:
    """See the module docstring."""

    def __init__(self, runner: ModelRunner, max_bs: int, *, capture: bool = True,
                 sizes: Sequence[int] | None = None) -> None:  # fmt: skip
        table = runner.slot_table
        if table is None or runner.kv_pool.pad_slot is None:
            raise ValueError("decode graphs need the device slot table and a padding page")
        self.runner = runner
        self.sizes = capture_sizes(max_bs, sizes)
        self.max_bs = self.sizes[-1]
        self.capture = capture
        self.num_replays = 0
        dev = runner.device
        self._pad = torch.tensor([0, 0, table.pad_row, 1, runner.kv_pool.pad_slot],
                                 dtype=torch.int64)  # fmt: skip
        self._inputs = {
            bs: self._pad[:, None].expand(5, bs).contiguous().to(dev) for bs in self.sizes
        }
        self._fi: dict[int, Any] = {}  # bucket -> flashinfer GraphDecode
        if runner.flashinfer is not None:
            self._fi = {bs: runner.flashinfer.graph_decoder(bs) for bs in self.sizes
                        if runner.decode_backend(bs) == "flashinfer"}  # fmt: skip
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        # one side stream for every capture_all: torch keeps a cuBLAS workspace (32 MiB on
        # Hopper) per stream it has seen, for good, so a new stream per recapture (after
        # each memory release) would leave one more workspace allocated each time
        self._stream: torch.cuda.Stream | None = None

    def bucket(self, bs: int) -> int | None:
        """The smallest captured size >= bs, or None if bs is above them all."""
        return bucket_of(self.sizes, bs)

    # ---- capture --------------------------------------------------------------------

    def _body(self, bs: int) -> torch.Tensor:
        """The captured step of bucket `bs`: [bs, vocab] float32 logits."""
        r = self.runner
        ids, pos, rows, lens, slots = self._inputs[bs].unbind(0)
        width = r.slot_table.width
        if bs in self._fi:
            ctx = AttentionContext(r.kv_pool.k_buffers, r.kv_pool.v_buffers, slots, None, None,
                                   None, None, flashinfer=self._fi[bs])  # fmt: skip
        else:
            rd = RowDecode(r.slot_table.table, rows, lens, width)
            ctx = r.decode_context(slots, rd, num_entries=bs)
        hidden = r.model(ids, pos, ctx, max_pos=width)
        return r.model.compute_logits(hidden)

    def _plan_flashinfer(self, bs: int, lens: list[int]) -> None:
        if bs in self._fi:
            r = self.runner
            rows = self._inputs[bs][2]
            r.plan_flashinfer_decode(self._fi[bs], rows, lens)

    @torch.inference_mode()
    def capture_all(self, progress: bool = True) -> None:
        """Capture every bucket, largest first (no-op without `capture`)."""
        if not self.capture:
            return
        r = self.runner
        self._stream = stream = capture_stream(r, self._stream)
        pool = torch.cuda.graph_pool_handle()
        sizes = sorted(self.sizes, reverse=True)
        for bs in tqdm(sizes, desc="capturing decode graphs", unit="graph", disable=not progress):
            self._plan_flashinfer(bs, [1] * bs)
            stream.wait_stream(torch.cuda.current_stream(r.device))  # the plan's copies first
            with torch.cuda.stream(stream):
                for _ in range(2):  # compiles the Triton kernels, settles the allocator
                    self._body(bs)
            stream.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, stream=stream):
                out = self._body(bs)
            self._graphs[bs] = g
            self._outputs[bs] = out
        torch.cuda.current_stream(r.device).wait_stream(stream)
        torch.cuda.synchronize(r.device)

    def drop(self) -> None:
        """Forget the captured graphs (their memory pool goes with them): the storage
        they were captured over is about to change (memory.py); `capture_all` again
        once it is back."""
        self._graphs.clear()
        self._outputs.clear()

    @property
    def captured(self) -> bool:
        return bool(self._graphs) or not self.capture

    # ---- replay ---------------------------------------------------------------------

    def run(self, inp: ForwardInput, out_slots: torch.Tensor) -> torch.Tensor:
        """[B, vocab] logits of an all-decode step of B <= max_bs entries.
        out_slots: [B] int64 host slots of the new tokens."""
        assert inp.row_ids is not None
        bs = len(inp.num_new_tokens)
        bucket = self.bucket(bs)
        assert bucket is not None, (bs, self.max_bs)
        block = self._pad[:, None].expand(5, bucket).clone()
        ids_on_device = inp.input_ids.device != torch.device("cpu")
        if not ids_on_device:
            block[0, :bs] = inp.input_ids
        block[1, :bs] = inp.positions
        block[2, :bs] = long_tensor(inp.row_ids)
        block[3, :bs] = long_tensor(inp.seq_lens)
        block[4, :bs] = out_slots
        dev_block = self._inputs[bucket]
        self.runner.stager.stage([block], out=dev_block.view(-1))
        if ids_on_device:
            dev_block[0, :bs].copy_(inp.input_ids)
        # the new tokens' slots enter the slot table from the block itself (a decode
        # token's position is its cell); padded rows rewrite the padding cell
        self.runner.slot_table.write(dev_block[2], dev_block[1], dev_block[4])
        self._plan_flashinfer(bucket, list(inp.seq_lens) + [1] * (bucket - bs))
        self.num_replays += 1
        if self.capture:
            self._graphs[bucket].replay()
            return self._outputs[bucket][:bs]
        return self._body(bucket)[:bs]
