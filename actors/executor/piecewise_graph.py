"""Prefill, extend and mixed steps replayed piecewise from CUDA graphs, one set of
pieces per token-count bucket.

Theory of operation
-------------------
A step of a few dozen new tokens launches as many kernels as a decode step (about a
dozen per layer) but is not all decode, so `DecodeGraphs` does not take it: run
eagerly, the host spends longer launching them than the GPU spends running them (an
8B step of 32 tokens over a 2,048-token prefix: ~14 ms, of which ~6 ms on the device).
Its attention cannot be captured as it stands (the plans depend on each entry's new and
cached lengths), everything else can. So the forward is cut at each layer's
attention: piece 0 is the embedding and layer 0 up to its attention (norm, qkv
projection, rope and the store of k and v), piece i (0 < i < L) is layer i-1 after its
attention (output projection, norm, MLP) and layer i up to its attention, and piece L
is the last layer after its attention and the final norm. Each piece is captured once
per bucket T of `capture_sizes`; a step of n <= T tokens writes its ids, positions and
output slots into the bucket's first n rows (the rest padded: id 0, position 0, the
pool's padding slot, so the padded rows' k and v land in the padding page), replays
piece 0, runs layer 0's attention eagerly on the first n rows with the step's own
attention context (any backend: Triton, flashinfer or torch), replays piece 1, and so
on. Per step the host launches L + 1 graphs and L attentions instead of ~12 L kernels.

Each bucket has its own input block; the pieces talk through buffers that every
bucket shares (views of their first T rows; buckets never run at once): `_qkv` holds a layer's rotated q, k and v for its
attention, `_attn` that attention's output, `_res` the residual stream, `_hidden` the
final hidden states; each piece copies its results into them, so nothing a piece
allocates has to outlive its replay, and one memory pool serves every piece of every
bucket (replayed in the order they were captured, largest bucket first).

Invariants: the rope table is grown to the slot table's width before capture, so no
piece ever reallocates it; padded rows write only the padding slot and never reach
the logits (`run` returns the first n rows); the captured pieces read nothing the
eager attention writes except `_attn`. Without CUDA (`capture=False`) the same
padded pieces run eagerly: what the CPU tests check.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from shunter.actors.executor import cuda_graph
from shunter.actors.executor.models.attention import AttentionContext
from shunter.kernels.rope import rope_gather

if TYPE_CHECKING:
    from shunter.actors.executor.runner import ForwardInput, ModelRunner

# Token counts captured up to the largest (SGLang's piecewise sizes, below 1,024)
_BUCKETS = (4, 8, 12, 16, 20, 24, 28, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208,
            224, 240, 256, 288, 320, 352, 384, 416, 448, 480, 512, 576, 640, 704, 768, 832,
            896, 960, 1024)  # fmt: skip


def capture_sizes(max_tokens: int, sizes: Sequence[int] | None = None) -> list[int]:
    """The token counts captured for a largest step of `max_tokens` (itself included):
    the default buckets below it, or the given `sizes` below it."""
    return cuda_graph.capture_sizes(max_tokens, sizes, _BUCKETS)


class PiecewiseGraphs:
    """See the module docstring."""

    def __init__(self, runner: ModelRunner, max_tokens: int, *, capture: bool = True,
                 sizes: Sequence[int] | None = None) -> None:  # fmt: skip
        pool = runner.kv_pool
        if pool.pad_slot is None:
            raise ValueError("piecewise graphs need the pool's padding page")
        self.runner = runner
        self.sizes = capture_sizes(max_tokens, sizes)
        self.max_tokens = self.sizes[-1]
        self.capture = capture
        self.num_replays = 0
        c, dev, dtype, top = runner.config, runner.device, runner.dtype, self.sizes[-1]
        self._pad = torch.tensor([0, 0, pool.pad_slot], dtype=torch.int64)
        # each bucket's inputs: [3, t] ids, positions, output slots (one staged copy)
        self._inputs = {t: self._pad[:, None].expand(3, t).contiguous().to(dev) for t in self.sizes}
        self._qkv = torch.zeros(top, c.q_size + 2 * c.kv_size, dtype=dtype, device=dev)
        self._attn = torch.zeros(top, c.q_size, dtype=dtype, device=dev)
        self._res = torch.zeros(top, c.hidden_size, dtype=dtype, device=dev)
        self._hidden = torch.zeros(top, c.hidden_size, dtype=dtype, device=dev)
        # the pieces' context: where k and v go (the staged slots); no plans, so no
        # layer takes the fused decode path
        self._ctx = {t: AttentionContext(pool.k_buffers, pool.v_buffers, self._inputs[t][2],
                                         None, None, None, None) for t in self.sizes}  # fmt: skip
        self._graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self._stream: torch.cuda.Stream | None = None  # one for every capture (cuda_graph.py)

    def bucket(self, num_tokens: int) -> int | None:
        """The smallest captured size >= num_tokens, or None if above them all."""
        return cuda_graph.bucket_of(self.sizes, num_tokens)

    # ---- the pieces ---------------------------------------------------------------

    def _piece(self, t: int, i: int) -> None:
        """Piece i of bucket t (see the module docstring), reading and writing the shared
        buffers' first t rows."""
        model = self.runner.model.model
        layers = model.layers
        ids, pos, _ = self._inputs[t].unbind(0)
        rope = rope_gather(self.runner.model.cos_sin_cache(1), pos)
        if i == 0:
            x, residual = model.embed_tokens(ids), None
        else:
            x, residual = layers[i - 1].after_attention(self._attn[:t], self._res[:t])
        if i == len(layers):
            self._hidden[:t].copy_(model.final_norm(x, residual))
            return
        (q, k, v, stored), residual = layers[i].before_attention(x, residual, rope,
                                                                 self._ctx[t])  # fmt: skip
        assert stored == self._stores(), "a layer stores k and v as its peers do"
        self._res[:t].copy_(residual)
        c = self.runner.config
        qkv = self._qkv[:t]
        joined = _joined(q, k, v, qkv.shape[1])
        if joined is not None:  # q, k and v side by side in one projection: one copy
            qkv.copy_(joined)
            return
        qkv[:, : c.q_size].view_as(q).copy_(q)
        qkv[:, c.q_size : c.q_size + c.kv_size].view_as(k).copy_(k)
        qkv[:, c.q_size + c.kv_size :].view_as(v).copy_(v)

    def _stores(self) -> bool:
        """Whether the pieces store k and v (no q/k norms), else the eager attention does."""
        return not self.runner.config.qk_norm

    def _attend(self, t: int, n: int, i: int, ctx: AttentionContext) -> None:
        """Layer i's attention over the step's first n tokens, eagerly, into `_attn`."""
        c = self.runner.config
        qkv = self._qkv[:n]
        q = qkv[:, : c.q_size].view(n, c.num_heads, c.head_dim)
        k = qkv[:, c.q_size : c.q_size + c.kv_size].view(n, c.num_kv_heads, c.head_dim)
        v = qkv[:, c.q_size + c.kv_size :].view(n, c.num_kv_heads, c.head_dim)
        out = self._attn[:n].view(n, c.num_heads, c.head_dim)
        self.runner.model.model.layers[i].self_attn.attend(ctx, q, k, v, self._stores(), out)

    # ---- capture --------------------------------------------------------------------

    @torch.inference_mode()
    def capture_all(self, progress: bool = True) -> None:
        """Capture every bucket's pieces, largest bucket first (no-op without `capture`)."""
        if not self.capture:
            return
        r = self.runner
        self._stream = stream = cuda_graph.capture_stream(r, self._stream)
        num_pieces = len(r.model.model.layers) + 1
        pool = torch.cuda.graph_pool_handle()
        sizes = sorted(self.sizes, reverse=True)
        for t in tqdm(sizes, desc="capturing piecewise graphs", unit="size", disable=not progress):
            with torch.cuda.stream(stream):
                for _ in range(2):  # compiles the Triton kernels, settles the allocator
                    for i in range(num_pieces):
                        self._piece(t, i)
            stream.synchronize()
            graphs = []
            for i in range(num_pieces):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, stream=stream):
                    self._piece(t, i)
                graphs.append(g)
            self._graphs[t] = graphs
            with torch.cuda.stream(stream):  # each launched once now (writing only the
                for g in graphs:  # padding slot): no first launch, upload and all, in a request
                    g.replay()
        torch.cuda.current_stream(r.device).wait_stream(stream)
        torch.cuda.synchronize(r.device)

    def drop(self) -> None:
        """Forget the captured pieces (their memory pool goes with them): see
        DecodeGraphs.drop."""
        self._graphs.clear()

    @property
    def captured(self) -> bool:
        return bool(self._graphs) or not self.capture

    # ---- replay ---------------------------------------------------------------------

    def run(
        self, inp: ForwardInput, out_slots: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """[n, hidden] final hidden states of a step of n <= max_tokens new tokens (a
        view valid until the next replay). out_slots: [n] int64 host slots of the new
        tokens; ctx: the step's attention context (runner._eager_context)."""
        n = out_slots.shape[0]
        t = self.bucket(n)
        assert t is not None, (n, self.max_tokens)
        block = self._pad[:, None].expand(3, t).clone()
        ids_on_device = inp.input_ids.device != torch.device("cpu")
        if not ids_on_device:
            block[0, :n] = inp.input_ids
        block[1, :n] = inp.positions
        block[2, :n] = out_slots
        dev_block = self._inputs[t]
        self.runner.stager.stage([block], out=dev_block.view(-1))
        if ids_on_device:
            dev_block[0, :n].copy_(inp.input_ids)
        self.num_replays += 1
        layers = len(self.runner.model.model.layers)
        graphs = self._graphs.get(t) if self.capture else None
        for i in range(layers + 1):
            if graphs is not None:
                graphs[i].replay()
            else:
                self._piece(t, i)
            if i < layers:
                self._attend(t, n, i, ctx)
        return self._hidden[:n]


def _joined(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, width: int) -> torch.Tensor | None:
    """[T, width] view of q, k, v when they lie side by side in the rows of one tensor
    (the qkv projection's output, rotated in place), else None."""
    row = q.stride(0)
    if k.stride(0) != row or v.stride(0) != row or row < width or q.dtype != k.dtype:
        return None
    elem = q.element_size()
    if (k.data_ptr() != q.data_ptr() + q[0].numel() * elem
            or v.data_ptr() != k.data_ptr() + k[0].numel() * elem):  # fmt: skip
        return None
    if not (q[0].is_contiguous() and k[0].is_contiguous() and v[0].is_contiguous()):
        return None
    return q.as_strided((q.shape[0], width), (row, 1))
