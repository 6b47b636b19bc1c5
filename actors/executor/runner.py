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
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import torch

from shunter.actors.executor.kv_pool import KVPool
from shunter.actors.executor.models.attention import build_attention_context
from shunter.actors.executor.models.config import ModelConfig
from shunter.actors.executor.models.llama import LlamaForCausalLM


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

    def __init__(self, model: LlamaForCausalLM, kv_pool: KVPool) -> None:
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
        self._num_forwards = self._num_tokens = self._num_logits = 0

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
        """[num_logits, vocab] float32 logits; the new tokens' K/V are in the pool after."""
        if not inp.checked:
            self.validate(inp)
        dev = self.device
        ctx = build_attention_context(
            self.kv_pool.k_buffers,
            self.kv_pool.v_buffers,
            inp.num_new_tokens,
            inp.seq_lens,
            inp.slot_tables,
            device=dev,
            sliding_window=self.config.sliding_window,
        )
        hidden = self.model(
            inp.input_ids.to(dev), inp.positions.to(dev), ctx, max_pos=max(inp.seq_lens)
        )  # [T, hidden]
        if inp.logits_indices.shape[0] != hidden.shape[0]:
            hidden = hidden.index_select(0, inp.logits_indices.to(dev))
        logits = self.model.compute_logits(hidden)  # [num_logits, vocab] float32
        self._num_forwards += 1
        self._num_tokens += inp.input_ids.shape[0]
        self._num_logits += logits.shape[0]
        return logits

    def statistics(self) -> RunnerStats:
        return RunnerStats(self._num_forwards, self._num_tokens, self._num_logits)
