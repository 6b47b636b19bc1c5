"""ModelRunner: one batched forward over the paged KV pool.

Theory of operation: the executor turns a ForwardBatch into a ForwardInput (flat new
tokens of all entries, their positions, each entry's full slot table and which rows
need logits). `forward` builds the step's attention plans once, runs the model (each
layer stores the new tokens' K/V at their slots, then attends over the pool) and
returns float32 logits only for `logits_indices`. Decode entries (one new token) of
a step are attended together; prefill/extend entries one by one.

Invariants: len(num_new_tokens) == len(seq_lens) == len(slot_tables) == number of
entries; sum(num_new_tokens) == num_tokens; slot_tables[b] has at least seq_lens[b]
slots, all < kv_pool.num_slots; positions of an entry's new tokens are
seq_lens[b] - num_new_tokens[b] ... seq_lens[b] - 1. Violations raise ValueError
before anything is written to the pool.

The ForwardInput lives on the host and is validated there; on CUDA the step's plans
are built once from it and the per-layer path reads no device value back to the host.

On CUDA (and on request elsewhere) the runner keeps a device copy of the row slot
tables (slot_table.py), updated from each ForwardInput's row_ids / fresh, and decode
attention reads it; host vectors reach the device through pinned staging buffers, so
`forward` launches its work without waiting for the device. An all-decode step of at
most `cuda_graph_max_bs` entries replays a captured CUDA graph (cuda_graph.py); any
other step of at most `piecewise_max_tokens` tokens replays piecewise graphs around
eager attention (piecewise_graph.py); larger ones run eagerly. The attention backend is "torch" (SDPA; any device),
"triton" or "flashinfer" (CUDA; kernels/attention_flashinfer.py). Under flashinfer an
all-decode step's kernels are `decode_backend(batch size)`'s: by default a batch of at
most TRITON_DECODE_MAX_BS entries decodes with the Triton split-KV kernel over the
device slot table (as the triton backend does, eager or captured), larger ones with
flashinfer's; prefill and extend steps always run flashinfer (backends.py decides).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import structlog
import torch

from shunter.actors.executor.backends import decode_backend_for, resolve_backend
from shunter.actors.executor.kv_pool import KVPool
from shunter.actors.executor.models.attention import (
    AttentionContext,
    RowDecode,
    build_attention_context,
)
from shunter.actors.executor.models.config import ModelConfig
from shunter.actors.executor.models.llama import LlamaForCausalLM
from shunter.actors.executor.slot_table import DeviceSlotTable, PinnedStager, long_tensor
from shunter.kernels.attention_extend import extend_fields, extend_meta_rows
from shunter.kernels.page_layout import to_device

log = structlog.get_logger(actor="executor")


@dataclass(frozen=True)
class ForwardInput:
    input_ids: torch.Tensor  # [num_tokens] int64, new tokens of all entries in entry order
    positions: torch.Tensor  # [num_tokens] int64, absolute position of each new token
    num_new_tokens: list[int]  # per entry
    seq_lens: list[int]  # per entry: KV length after this step (prefix + new)
    slot_tables: list[torch.Tensor]  # per entry [>= seq_len] int64 flat slots of tokens 0..
    logits_indices: torch.Tensor  # [num_logits] int64 rows of the token axis to return
    # True when the builder already guarantees `ModelRunner.validate`'s invariants (the
    # executor core checks each ForwardBatch in full before staging it), so the decode
    # hot path does not check them twice
    checked: bool = False
    # The executor's mirror row of each entry, and whether that row opened in this batch.
    # With them a CUDA runner keeps a device copy of the row slot tables: an opened row's
    # table is copied whole, the others gain only their new tokens' slots, and decode
    # reads the copy (no per-step padded index, what a CUDA graph replays). None: the
    # runner attends from `slot_tables` alone.
    row_ids: list[int] | None = None
    fresh: list[bool] | None = None

    @classmethod
    def build(
        cls,
        token_ids: list[list[int]],
        prefix_lens: list[int],
        slot_tables: list[torch.Tensor],
        *,
        logits: str = "last",
    ) -> ForwardInput:
        """Convenience: entries given as their new token ids and cached prefix lengths.
        logits: "last" (last new token of each entry) or "all" (every new token)."""
        ids = [t for toks in token_ids for t in toks]
        pos: list[int] = []
        last: list[int] = []
        for toks, p in zip(token_ids, prefix_lens, strict=True):
            pos.extend(range(p, p + len(toks)))
            last.append(len(pos) - 1)
        idx = list(range(len(ids))) if logits == "all" else last
        return cls(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(pos, dtype=torch.int64),
            num_new_tokens=[len(t) for t in token_ids],
            seq_lens=[p + len(t) for t, p in zip(token_ids, prefix_lens, strict=True)],
            slot_tables=list(slot_tables),
            logits_indices=torch.tensor(idx, dtype=torch.int64),
        )


class RunnerStats(msgspec.Struct, frozen=True):
    num_forwards: int
    num_tokens: int  # new tokens computed, all forwards
    num_logits: int


class ModelRunner:
    """Runs `model` over `kv_pool`; see the module docstring."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_pool: KVPool,
        *,
        attention_backend: str = "auto",
        decode_attention_backend: str = "auto",
        max_num_rows: int | None = None,
        max_context_len: int | None = None,
        slot_table: bool | None = None,
        cuda_graph_max_bs: int | None = None,
        capture: bool | None = None,
        progress: bool = False,
        cuda_graph_sizes: Sequence[int] | None = None,
        piecewise_max_tokens: int | None = None,
        piecewise_sizes: Sequence[int] | None = None,
    ) -> None:
        """decode_attention_backend: "auto", "triton" or "flashinfer" (decode_backend_for);
        slot_table: keep the device row table (default: on CUDA when max_num_rows is
        given); cuda_graph_max_bs: capture decode graphs up to this batch (None: none),
        of the default bucket sizes or of cuda_graph_sizes;
        capture: really capture (default: on CUDA; off runs the padded graph path
        eagerly); piecewise_max_tokens: capture piecewise graphs of steps up to this many
        tokens (piecewise_graph.py; None: none), of the default sizes or of
        piecewise_sizes."""
        self.model = model
        self.kv_pool = kv_pool
        self.config: ModelConfig = model.config
        w = model.model.embed_tokens.weight
        self.device = w.device
        self.dtype = w.dtype
        if kv_pool.num_layers != self.config.num_layers:
            raise ValueError(
                f"KV pool has {kv_pool.num_layers} layers, model {self.config.num_layers}"
            )
        on_cuda = self.device.type == "cuda"
        self.backend = resolve_backend(attention_backend, self.device, self.dtype,
                                       self.config.head_dim)  # fmt: skip
        self.stager = PinnedStager(self.device)
        self.slot_table: DeviceSlotTable | None = None
        if slot_table is None:
            slot_table = on_cuda and max_num_rows is not None
        if slot_table:
            if max_num_rows is None:
                raise ValueError("a device slot table needs max_num_rows")
            width = max_context_len or self.config.max_position_embeddings
            pad = kv_pool.pad_slot if kv_pool.pad_slot is not None else 0
            self.slot_table = DeviceSlotTable(max_num_rows, width, pad_slot=pad, device=self.device)
            log.info("slot table", rows=max_num_rows, width=width,
                     mib=round(self.slot_table.nbytes / 2**20, 1))  # fmt: skip
        if self.backend == "flashinfer" and self.slot_table is None:
            if attention_backend == "flashinfer":  # its page lists come from the table
                raise ValueError("the flashinfer backend needs a slot table (max_num_rows)")
            self.backend = "triton"
        if not on_cuda and decode_attention_backend in ("triton", "flashinfer"):
            raise ValueError(f"decode attention backend {decode_attention_backend!r} needs "
                             "a CUDA device")  # fmt: skip
        decode_backend_for(self.backend, decode_attention_backend, 1)  # raises if refused
        self.decode_attention_backend = decode_attention_backend
        self.flashinfer = None
        if self.backend == "flashinfer":
            from shunter.kernels.attention_flashinfer import FlashInferAttention

            c = self.config
            ps = kv_pool.page_size
            # page ids of one graph replay: rows may share prefix pages, so bound by
            # what the largest bucket decoding with flashinfer (the largest bucket, when
            # any does) can name at full context, not by the pool
            width = max_context_len or c.max_position_embeddings
            fi_bs = cuda_graph_max_bs or 0
            if fi_bs and self.decode_backend(fi_bs) != "flashinfer":
                fi_bs = 0  # every bucket decodes with the Triton kernel
            replay_pages = fi_bs * -(-width // ps)
            self.flashinfer = FlashInferAttention(
                num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                page_size=ps, dtype=self.dtype, device=self.device,
                max_num_pages=max(kv_pool.num_pages + 1, replay_pages),
            )  # fmt: skip
        self.graphs = None
        if cuda_graph_max_bs is not None and (self.backend != "torch" or capture is False):
            from shunter.actors.executor.cuda_graph import DecodeGraphs

            self.graphs = DecodeGraphs(
                self,
                cuda_graph_max_bs or 1,
                capture=on_cuda if capture is None else capture,
                sizes=cuda_graph_sizes,
            )
            self.graphs.capture_all(progress)
        self.piecewise = None
        if piecewise_max_tokens is not None and (self.backend != "torch" or capture is False):
            from shunter.actors.executor.piecewise_graph import PiecewiseGraphs

            self.piecewise = PiecewiseGraphs(
                self,
                piecewise_max_tokens,
                capture=on_cuda if capture is None else capture,
                sizes=piecewise_sizes,
            )
            self.piecewise.capture_all(progress)
        self._num_forwards = self._num_tokens = self._num_logits = 0
        # how the last forward ran: "decode graph", "piecewise" or "eager" (slow-step logs)
        self.last_path = ""

    @property
    def graph_sets(self) -> list:
        """The captured graphs this runner replays (decode, piecewise), to drop or
        capture again together (memory.py)."""
        return [g for g in (self.graphs, self.piecewise) if g is not None]

    def decode_backend(self, batch_size: int) -> str:
        """The kernels of an all-decode step of batch_size entries (decode_backend_for)."""
        return decode_backend_for(self.backend, self.decode_attention_backend, batch_size)

    def validate(self, inp: ForwardInput) -> None:
        """Raise ValueError if `inp` breaks the module invariants."""
        n = len(inp.num_new_tokens)
        if n == 0:
            raise ValueError("a forward needs at least one entry")
        if len(inp.seq_lens) != n or len(inp.slot_tables) != n:
            raise ValueError("num_new_tokens, seq_lens and slot_tables differ in length")
        num_tokens = inp.input_ids.shape[0]
        if sum(inp.num_new_tokens) != num_tokens or inp.positions.shape[0] != num_tokens:
            raise ValueError(
                f"{num_tokens} input ids, {inp.positions.shape[0]} positions, "
                f"{sum(inp.num_new_tokens)} new tokens declared"
            )
        for b, (nn_, sl, st) in enumerate(
            zip(inp.num_new_tokens, inp.seq_lens, inp.slot_tables, strict=True)
        ):
            if nn_ < 1 or sl < nn_:
                raise ValueError(f"entry {b}: {nn_} new tokens with seq_len {sl}")
            if st.shape[0] < sl:
                raise ValueError(f"entry {b}: slot table holds {st.shape[0]} < seq_len {sl}")
        # one reduction over all tables instead of two per entry
        used = torch.cat([st[:sl] for st, sl in zip(inp.slot_tables, inp.seq_lens, strict=True)])
        lo, hi = torch.aminmax(used)
        if int(lo) < 0 or int(hi) >= self.kv_pool.num_slots:
            raise ValueError(f"slot out of range [0, {self.kv_pool.num_slots})")
        if num_tokens and (
            int(inp.input_ids.min()) < 0 or int(inp.input_ids.max()) >= self.config.vocab_size
        ):
            raise ValueError(f"input id out of range [0, {self.config.vocab_size})")
        # the GPU rope reads its table at these positions unchecked: bound them here
        if num_tokens and (
            int(inp.positions.min()) < 0 or int(inp.positions.max()) >= max(inp.seq_lens)
        ):
            raise ValueError(f"position out of range [0, {max(inp.seq_lens)})")
        last = torch.tensor(inp.num_new_tokens).cumsum(0) - 1  # [E] row of each entry's last token
        if not torch.equal(inp.positions[last].cpu(), torch.tensor(inp.seq_lens) - 1):
            raise ValueError("an entry's last new token is not at position seq_len - 1")
        li = inp.logits_indices
        if li.numel() and (int(li.min()) < 0 or int(li.max()) >= num_tokens):
            raise ValueError(f"logits index out of range [0, {num_tokens})")

    @torch.inference_mode()
    def forward(self, inp: ForwardInput) -> torch.Tensor:
        """[num_logits, vocab] float32 logits; the new tokens' K/V are in the pool after.
        After a graph replay the logits are a view valid until the next forward."""
        if not inp.checked:
            self.validate(inp)
        n = inp.num_new_tokens
        out_slots = torch.cat(
            [t[s - k : s] for t, k, s in zip(inp.slot_tables, n, inp.seq_lens, strict=True)]
        )  # [T] host
        table = self.slot_table if inp.row_ids is not None else None
        graphs = self.graphs
        num_tokens = inp.input_ids.shape[0]
        replay = (
            table is not None and graphs is not None and num_tokens == len(n)
            and graphs.bucket(num_tokens) is not None
        )  # fmt: skip
        fresh = inp.fresh or [False] * len(n)
        if table is not None:
            if replay and not any(fresh):
                table.check(inp.row_ids, inp.seq_lens)  # the replay writes the new slots
            else:
                table.update(inp.row_ids, fresh, n, inp.seq_lens, inp.slot_tables, out_slots)
        self._num_forwards += 1
        self._num_tokens += num_tokens
        if replay:
            assert graphs is not None
            self.last_path = "decode graph"
            logits = graphs.run(inp, out_slots)
            if inp.logits_indices.shape[0] != num_tokens:
                logits = logits.index_select(0, to_device(inp.logits_indices, self.device))
            self._num_logits += logits.shape[0]
            return logits
        ctx, ids, positions = self._eager_context(inp, out_slots, table)
        pw = self.piecewise
        if pw is not None and pw.captured and pw.bucket(num_tokens) is not None:
            self.last_path = "piecewise"
            hidden = pw.run(inp, out_slots, ctx)  # [T, hidden]
        else:
            self.last_path = "eager"
            hidden = self.model(ids, positions, ctx, max_pos=max(inp.seq_lens))
        if inp.logits_indices.shape[0] != hidden.shape[0]:
            hidden = hidden.index_select(0, to_device(inp.logits_indices, self.device))
        logits = self.model.compute_logits(hidden)  # [num_logits, vocab] float32
        self._num_logits += logits.shape[0]
        return logits

    def _eager_context(
        self, inp: ForwardInput, out_slots: torch.Tensor, table: DeviceSlotTable | None
    ) -> tuple[AttentionContext, torch.Tensor, torch.Tensor]:
        """The step's attention context and its ids and positions on the device, every
        host vector staged in one copy (each on a 16-byte boundary: stage_views)."""
        n = inp.num_new_tokens
        dec = [i for i, k in enumerate(n) if k == 1]
        ext = [i for i, k in enumerate(n) if k != 1]
        if self.flashinfer is not None and table is None:
            raise ValueError("the flashinfer backend needs ForwardInput.row_ids")
        # flashinfer plans the step unless it is all decode and decode_backend picks the
        # Triton kernel over the row table for its size
        use_fi = self.flashinfer is not None and (
            bool(ext) or self.decode_backend(len(n)) == "flashinfer"
        )
        # the Triton kernels read the entries' slots from the row table
        dec_rows = table is not None and not use_fi and bool(dec)
        ext_rows = table is not None and not use_fi and bool(ext)
        ids_host = inp.input_ids.device.type == "cpu"
        rows = inp.row_ids or []
        ext_n, ext_lens = [n[i] for i in ext], [inp.seq_lens[i] for i in ext]
        host = {"positions": inp.positions, "slots": out_slots}
        if ids_host:
            host["ids"] = inp.input_ids
        if use_fi:
            host["fi_rows"] = long_tensor(rows)
        if dec_rows:
            host["dec_rows"] = long_tensor([rows[i] for i in dec])
            host["dec_lens"] = long_tensor([inp.seq_lens[i] for i in dec])
        if ext_rows:
            host["ext"] = long_tensor(extend_fields([rows[i] for i in ext], ext_n, ext_lens))
        dev = dict(zip(host, self.stager.stage_views(list(host.values())), strict=True))
        positions, slots = dev["positions"], dev["slots"]
        ids = dev["ids"] if ids_host else inp.input_ids  # else gathered from the last samples
        if use_fi:
            return self._flashinfer_context(inp, slots, dev["fi_rows"]), ids, positions
        kv = (self.kv_pool.k_buffers, self.kv_pool.v_buffers)
        rd = meta = None
        if dec_rows:
            assert table is not None
            max_len = max(inp.seq_lens[i] for i in dec)
            rd = RowDecode(table.table, dev["dec_rows"], dev["dec_lens"], max_len)
        if ext_rows:
            assert table is not None
            meta = extend_meta_rows(table.table, dev["ext"], ext_n, ext_lens)
        sw = self.config.sliding_window
        ctx = build_attention_context(*kv, n, inp.seq_lens, inp.slot_tables, device=self.device,
                                      sliding_window=sw, out_slots=slots, row_decode=rd,
                                      extend_meta=meta)  # fmt: skip
        return ctx, ids, positions

    def decode_context(
        self, out_slots: torch.Tensor, rd: RowDecode, *, num_entries: int
    ) -> AttentionContext:
        """An all-decode step's context over the device slot table (captured steps)."""
        return build_attention_context(
            self.kv_pool.k_buffers, self.kv_pool.v_buffers, [1] * num_entries,
            [1] * num_entries, [], device=self.device, sliding_window=self.config.sliding_window,
            out_slots=out_slots, row_decode=rd,
        )  # fmt: skip

    # ---- flashinfer -------------------------------------------------------------------

    def _flashinfer_context(
        self, inp: ForwardInput, out_slots: torch.Tensor, rows: torch.Tensor
    ) -> AttentionContext:
        """Plan the step's flashinfer wrapper: decode, prefill when every entry's KV is
        all new, else extend; rows: the entries' slot-table rows, on the device."""
        from shunter.kernels.page_layout import extend_qo_indptr

        assert self.flashinfer is not None
        n = inp.num_new_tokens
        sw = self.config.sliding_window
        if all(k == 1 for k in n):
            self.flashinfer.plan_decode(*self._page_lists(rows, inp.seq_lens), sliding_window=sw)
            mode = "decode"
        elif list(n) == list(inp.seq_lens):  # nothing cached: attend the new tokens alone
            scale = self.config.head_dim**-0.5
            self.flashinfer.plan_prefill(extend_qo_indptr(n), scale, sliding_window=sw)
            mode = "prefill"
        else:
            layout = self._page_lists(rows, inp.seq_lens)
            self.flashinfer.plan_extend(extend_qo_indptr(n), *layout, sliding_window=sw)
            mode = "extend"
        kv = (self.kv_pool.k_buffers, self.kv_pool.v_buffers)
        return AttentionContext(*kv, out_slots, None, None, None, None,
                                flashinfer=self.flashinfer, flashinfer_mode=mode)  # fmt: skip

    def plan_flashinfer_decode(self, wrapper, rows: torch.Tensor, lens: list[int]) -> None:
        """Plan a graph's fixed-buffer flashinfer decode for rows (device) of lengths lens."""
        wrapper.plan(*self._page_lists(rows, lens), sliding_window=self.config.sliding_window)

    def _page_lists(
        self, rows: torch.Tensor, lens: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """flashinfer's (kv_indptr host, page ids device, last page lengths host) of
        entries at slot-table `rows` (device) with KV lengths `lens`."""
        from shunter.kernels import page_layout

        assert self.slot_table is not None
        ps = self.kv_pool.page_size
        kv_indptr, last_len = page_layout.kv_page_layout(lens, ps)
        indices = page_layout.kv_page_indices(
            self.slot_table.table, rows, lens, ps, self.stager.stage
        )
        return kv_indptr, indices, last_len

    def statistics(self) -> RunnerStats:
        return RunnerStats(self._num_forwards, self._num_tokens, self._num_logits)
