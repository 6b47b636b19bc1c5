"""Token sampling for one step: penalties, bias, temperature, truncation, seeded draws.

Theory of operation
-------------------
`sample(logits, rows)` turns the model's logits of the rows that sample this step
(one row of logits each) into one token per row, vectorized over rows. The pipeline,
in order, each stage touching only the rows whose parameters ask for it:

1. repetition penalty (HF semantics): for every token seen in the prompt or output,
   a positive logit is divided by the penalty and a negative one multiplied by it;
2. frequency and presence penalties (OpenAI semantics, over output tokens only):
   `logit -= frequency_penalty * count + presence_penalty * (count > 0)`;
3. logit_bias is added;
4. min_new_tokens: eos and the stop token ids get -inf until that many tokens exist;
5. temperature 0 rows take the argmax of the processed logits (greedy); the other rows
   divide by their temperature and take a softmax;
6. truncation, every mask computed from the same (untruncated) probabilities, as SGLang
   does: top-k keeps tokens whose probability is >= the k-th largest (ties kept),
   top-p keeps the smallest most-likely set whose mass reaches top_p, min-p keeps
   tokens with probability >= min_p * max probability;
7. one uniform draw per row from the row's own torch.Generator picks the token by
   inverse CDF over the kept probabilities.

Reproducibility: a row's draw comes from its own generator (seeded from RowOpen.seed)
and each row follows a path fixed by its own parameters (rows with top_p < 1 go
through a sorted path, the others stay in vocabulary order), so a seeded request gives
the same tokens whatever else shares its batch.

Device and host: `sample_on_device` launches the whole pipeline on the logits' device
and returns tensors (a DeviceSample: tokens, and for rows that asked, the chosen and top
logprobs); `sample_results` turns host copies of them into lists. Only the uniforms
come from the host (each row's own CPU generator, then moved), so a seeded row draws
the same tokens on every device that computes the same logits. Between the two calls
the executor launches the next step's forward (core.py). `sample` does both at once.

flashinfer's sampling kernels (rejection sampling, no sort) are not used: they draw
from one seed and offset per call, by a row's position in the batch, so a seeded
request's tokens would depend on its neighbours; here a row's draws are its own.

Logprobs are those of the model's RAW distribution: log_softmax of the logits before
penalties, bias, masks, temperature and truncation (vLLM's default "raw logprobs").
So a token's logprob does not depend on the sampling settings, and prompt logprobs
and output logprobs are on the same scale. (SGLang reports the processed one.)
A row's token_ids_logprob ids are reported from the same distribution, after its top
tokens in each position's list (`ids_logprobs`, `with_ids`).

Invariants
----------
- `RowSampling` is the only mutable state; `sample` mutates nothing but the generators.
- A greedy row never consumes a random draw.
- sample_on_device never waits for the device on a GPU: every index and parameter
  tensor it builds reaches the logits' device by an asynchronous copy from pinned
  memory (to_device), and nothing is read back. (On the CPU a top-p row reads one
  flag, which way its nucleus is sorted; there nothing runs ahead to wait for.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from shunter.actors.executor.penalties import apply_penalties, needs_processing
from shunter.actors.executor.slot_table import device_tensor
from shunter.bus.messages.request import SamplingParams
from shunter.kernels.argmax import argmax

if TYPE_CHECKING:
    from shunter.actors.grammar.token_fsm import TokenFsm
from shunter.kernels.page_layout import to_device

# Temperatures at or below this are greedy (a division by ~0 would overflow anyway).
GREEDY_TEMPERATURE = 1e-5
# Top-p first looks for the nucleus among this many most likely tokens (see _sample_group)
# on these devices. Choosing reads a flag back, which on a GPU would stall the pipeline
# (the next step's forward waits for this host): there top-p rows sort everything.
NUCLEUS_CANDIDATES = 1024
NARROW_NUCLEUS_DEVICES = ("cpu",)


def validate_params(params: SamplingParams, vocab_size: int) -> str | None:
    """Why these parameters cannot be sampled with, or None if they can."""
    p = params
    if not (p.temperature >= 0.0 and math.isfinite(p.temperature)):
        return f"temperature must be a finite number >= 0, got {p.temperature}"
    if not (0.0 < p.top_p <= 1.0):
        return f"top_p must be in (0, 1], got {p.top_p}"
    if not (0.0 <= p.min_p <= 1.0):
        return f"min_p must be in [0, 1], got {p.min_p}"
    if not (p.repetition_penalty > 0.0 and math.isfinite(p.repetition_penalty)):
        return f"repetition_penalty must be a finite number > 0, got {p.repetition_penalty}"
    for name in ("frequency_penalty", "presence_penalty"):
        if not math.isfinite(getattr(p, name)):
            return f"{name} must be finite, got {getattr(p, name)}"
    if p.min_new_tokens < 0:
        return f"min_new_tokens must be >= 0, got {p.min_new_tokens}"
    if p.top_logprobs_num < 0:
        return f"top_logprobs_num must be >= 0, got {p.top_logprobs_num}"
    bad = [t for t in p.token_ids_logprob if not 0 <= t < vocab_size]
    if bad:
        return f"token_ids_logprob outside the vocabulary [0, {vocab_size}): {bad[:5]}"
    bad = [t for t in p.logit_bias if not 0 <= t < vocab_size]
    if bad:
        return f"logit_bias names token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"
    bad = [t for t in p.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        return f"stop_token_ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"
    if any(not math.isfinite(b) and b != -math.inf for b in p.logit_bias.values()):
        return "logit_bias values must be finite (or -inf to ban a token)"
    return None


class RowSampling:
    """One row's sampling state: parameters, generator and the token statistics that
    penalties need. Fed by the core: `observe_prompt` for tokens the row computes
    before its first sample (and cached prefix tokens), `observe_output` per sample."""

    __slots__ = (
        "generator",
        "grammar",
        "grammar_state",
        "greedy",
        "masked_ids",
        "num_output_tokens",
        "output_counts",
        "params",
        "seen",
        "wants_logprobs",
    )

    def __init__(self, params: SamplingParams, seed: int, eos_token_ids: Sequence[int] = (),
                 grammar: TokenFsm | None = None):  # fmt: skip
        self.params = params
        # constrained decoding: the pattern's token automaton and where the output is in it
        self.grammar = grammar
        self.grammar_state = grammar.initial if grammar is not None else 0
        self.greedy = params.temperature <= GREEDY_TEMPERATURE
        self.generator: torch.Generator | None = None
        if not self.greedy:
            self.generator = torch.Generator().manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
        self.seen: set[int] = set()  # prompt + output ids (repetition penalty)
        self.output_counts: dict[int, int] = {}  # output id -> occurrences
        self.num_output_tokens = 0
        # Ids that min_new_tokens keeps out until enough tokens exist.
        self.masked_ids = sorted({*eos_token_ids, *params.stop_token_ids})
        self.wants_logprobs = (
            params.return_logprob or params.top_logprobs_num > 0 or bool(params.token_ids_logprob)
        )

    def observe_prompt(self, token_ids: Sequence[int]) -> None:
        if self.params.repetition_penalty != 1.0:
            self.seen.update(token_ids)

    def observe_output(self, token_id: int) -> None:
        self.num_output_tokens += 1
        if self.grammar is not None:
            self.grammar_state = self.grammar.advance(self.grammar_state, token_id)
        if self.params.repetition_penalty != 1.0:
            self.seen.add(token_id)
        if self.params.frequency_penalty != 0.0 or self.params.presence_penalty != 0.0:
            self.output_counts[token_id] = self.output_counts.get(token_id, 0) + 1

    def resume(self, output_ids: Sequence[int]) -> None:
        """Take output_ids as this row's earlier outputs (a request resumed after a
        retraction): count them, and skip the one draw each of them took, so the
        generator continues where the first run of the request left it."""
        for t in output_ids:
            self.observe_output(t)
        if self.generator is not None:
            for _ in output_ids:
                torch.rand(1, generator=self.generator)


class SampleOutput(NamedTuple):
    token_ids: list[int]  # one per row
    logprobs: list[float]  # raw logprob per row (NaN for rows that did not ask); [] if none asked
    top_logprobs: list[list[tuple[int, float]]]  # per row, [] for rows that did not ask


def truncate_probs(
    probs: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor,
    *,
    kmax: int | None = None,
    use_min_p: bool | None = None,
) -> torch.Tensor:
    """Zero the probabilities outside top-k / top-p / min-p, each mask from `probs`.

    probs: [B, V] float32, each row sorted descending when top_p is given (the sorted
    path), in vocabulary order otherwise. top_k: [B] int64 (V for off). top_p: [B] or
    None. min_p: [B]. All on probs' device. kmax (the largest k below V, 0 if none) and
    use_min_p (any min_p > 0) are read from the tensors when not given, which only the
    CPU may do (on a GPU that read would wait for the device: pass them).
    Returns a new [B, V] tensor."""
    num_vocab = probs.shape[-1]
    if probs.is_cuda and (kmax is None or use_min_p is None):
        raise ValueError("truncate_probs on a GPU needs kmax and use_min_p from the host")
    if kmax is None:
        limited = top_k[top_k < num_vocab]
        kmax = int(limited.max()) if limited.numel() else 0
    if use_min_p is None:
        use_min_p = bool((min_p > 0).any())
    out = probs
    if kmax > 0:
        k_idx = (top_k.clamp(1, num_vocab) - 1).unsqueeze(1)  # [B, 1]
        if top_p is not None:
            kth = probs.gather(1, k_idx)  # sorted: the k-th largest is at k-1
        else:
            # Only up to the largest real k; rows without a limit keep everything (0).
            kth = probs.topk(kmax, dim=-1).values.gather(1, k_idx.clamp_max(kmax - 1))
            kth = kth.masked_fill((top_k >= num_vocab).unsqueeze(1), 0.0)
        out = out.masked_fill(probs < kth, 0.0)
    if top_p is not None:
        before = probs.cumsum(-1) - probs  # [B, V] mass strictly before each token
        out = out.masked_fill(before > top_p.unsqueeze(1), 0.0)
    if use_min_p:
        top = probs[:, :1] if top_p is not None else probs.amax(-1, keepdim=True)
        out = out.masked_fill(probs < top * min_p.unsqueeze(1), 0.0)
    return out


def _sort_desc(probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows sorted by probability descending, equal ones by token id ascending: one
    order on every device and both top-p paths, so ties (common in bf16) draw alike."""
    return probs.sort(dim=-1, descending=True, stable=True)


def _draw_sorted(sorted_probs, order, top_k, top_p, min_p, uniforms, kmax, use_min_p):
    """Truncate rows sorted descending (order: their token ids) and draw: [G] token ids."""
    kept = truncate_probs(sorted_probs, top_k, top_p, min_p, kmax=kmax, use_min_p=use_min_p)
    return order.gather(1, _draw(kept, uniforms).unsqueeze(1)).squeeze(1)


def _draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: probs [B, V] (unnormalized, >= 0), uniforms [B] in [0, 1) ->
    [B] int64 column index. A zero-probability column is never chosen."""
    cdf = probs.cumsum(-1)  # [B, V]
    target = (uniforms * cdf[:, -1]).unsqueeze(1)  # [B, 1]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return idx.clamp_max(probs.shape[-1] - 1)


def _sample_group(x: torch.Tensor, rows: Sequence[RowSampling], sorted_path: bool) -> torch.Tensor:
    """x: [G, V] processed logits of non-greedy rows -> [G] int64 token ids on x's
    device. Each row's uniform comes from its own (CPU) generator."""
    dev, dt = x.device, x.dtype
    temps = device_tensor([r.params.temperature for r in rows], dev, dt)
    probs = torch.softmax(x / temps.unsqueeze(1), dim=-1)  # [G, V]
    num_vocab = x.shape[-1]
    ks = [r.params.top_k if 0 < r.params.top_k < num_vocab else num_vocab for r in rows]
    top_k = device_tensor(ks, dev)
    kmax = max((k for k in ks if k < num_vocab), default=0)
    min_ps = [r.params.min_p for r in rows]
    min_p = device_tensor(min_ps, dev, dt)
    use_min_p = any(m > 0 for m in min_ps)
    uniforms = to_device(torch.cat([torch.rand(1, generator=r.generator) for r in rows]), dev)
    if not sorted_path:
        kept = truncate_probs(probs, top_k, None, min_p, kmax=kmax, use_min_p=use_min_p)
        return _draw(kept, uniforms)
    top_p = device_tensor([r.params.top_p for r in rows], dev, dt)
    if dev.type not in NARROW_NUCLEUS_DEVICES:  # one sort, nothing read back
        return _draw_sorted(*_sort_desc(probs), top_k, top_p, min_p, uniforms, kmax, use_min_p)
    # Sorting the whole vocabulary is the cost of top-p on the CPU. When the
    # NUCLEUS_CANDIDATES most likely tokens, counting only those above the smallest
    # candidate's probability (ties there may reach past the candidates), already hold
    # more than top_p (plus a margin for rounding), the nucleus lies inside them, so
    # ordering them alone gives the same kept set in the same order; the other rows sort
    # everything. Which way a row goes depends only on its own distribution, so batch
    # composition still does not change its token. Choosing the way reads one flag per
    # row back to the host.
    num_cand = min(num_vocab, NUCLEUS_CANDIDATES)
    _, picked = probs.topk(num_cand, dim=-1)  # [G, C] ties in no set order
    picked = picked.sort(dim=-1).values  # the canonical order: ids ascending, then
    cand, perm = _sort_desc(probs.gather(1, picked))  # probabilities descending
    cand_order = picked.gather(1, perm)
    above = cand.masked_fill(cand <= cand[:, -1:], 0.0).sum(-1)
    narrow = (above > top_p + 1e-4).tolist()  # [G] bool
    tokens = torch.empty(len(rows), dtype=torch.int64, device=dev)
    for is_narrow in (True, False):
        sel_l = [i for i, n in enumerate(narrow) if n == is_narrow]
        if not sel_l:
            continue
        sel = device_tensor(sel_l, dev)  # [S]
        if is_narrow:
            sorted_probs, order = cand[sel], cand_order[sel]
        else:
            sorted_probs, order = _sort_desc(probs[sel])
        kmax_s = max((ks[i] for i in sel_l if ks[i] < num_vocab), default=0)
        tokens[sel] = _draw_sorted(sorted_probs, order, top_k[sel], top_p[sel], min_p[sel],
                                   uniforms[sel], kmax_s, use_min_p)  # fmt: skip
    return tokens


class DeviceSample(NamedTuple):
    """A step's sample before it reaches the host: tensors on the logits' device
    (or their host copies, see `to_host`)."""

    tokens: torch.Tensor  # [B] int64
    asked: list[int]  # indices (into rows) of the rows that asked for logprobs
    chosen: torch.Tensor | None  # [A] float32 raw logprob of each asked row's token
    top_vals: torch.Tensor | None  # [A, kmax] float32 largest raw logprobs, or None
    top_ids: torch.Tensor | None  # [A, kmax] int64 their token ids
    id_vals: torch.Tensor | None = None  # [A, L] float32 raw logprobs of token_ids_logprob

    def to_host(self, non_blocking: bool) -> DeviceSample:
        """Copies on the CPU. non_blocking from CUDA lands in pinned memory and is only
        valid once the stream reached it (an event recorded after this call)."""

        def cpu(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to("cpu", non_blocking=non_blocking)

        return DeviceSample(cpu(self.tokens), self.asked, cpu(self.chosen),  # type: ignore[arg-type]
                            cpu(self.top_vals), cpu(self.top_ids), cpu(self.id_vals))  # fmt: skip


def ids_logprobs(lp: torch.Tensor, ids: Sequence[Sequence[int]]) -> torch.Tensor | None:
    """lp [A, V] logprobs -> [A, L] those of each row's ids (padded past a row's own
    count with token 0's), or None when no row names any. No device wait."""
    width = max(map(len, ids), default=0)
    if width == 0:
        return None
    padded = [list(r) + [0] * (width - len(r)) for r in ids]
    return lp.gather(1, device_tensor(padded, lp.device, torch.int64))


def with_ids(top: list[tuple[int, float]], ids: Sequence[int], vals: list[float]) -> list:
    """A position's top tokens followed by its token_ids_logprob ids (SampleOutput)."""
    return top + list(zip(ids, vals[: len(ids)])) if ids else top


def sample_on_device(logits: torch.Tensor, rows: Sequence[RowSampling]) -> DeviceSample:
    """Stages 1-7 on logits [B, V] float32 (one row per entry of `rows`), launched on
    logits' device; reads nothing back on a GPU (on the CPU, one flag per top-p row).
    Does not modify `logits`; advances the generators of the rows that draw."""
    assert logits.dim() == 2 and logits.shape[0] == len(rows), (logits.shape, len(rows))
    dev = logits.device
    x = logits
    if any(needs_processing(r) for r in rows):
        x = apply_penalties(logits.clone(), rows)

    greedy = [i for i, r in enumerate(rows) if r.greedy]
    if len(greedy) == len(rows):
        tokens = argmax(x)  # [B]
    else:
        tokens = torch.empty(len(rows), dtype=torch.int64, device=dev)
        if greedy:
            g = device_tensor(greedy, dev)
            tokens[g] = argmax(x[g])
        for sorted_path in (False, True):
            idx = [
                i
                for i, r in enumerate(rows)
                if not r.greedy and (r.params.top_p < 1.0) == sorted_path
            ]
            if len(idx) == len(rows):  # one group holds every row: no gather copy
                tokens = _sample_group(x, rows, sorted_path)
            elif idx:
                t = device_tensor(idx, dev)
                tokens[t] = _sample_group(x[t], [rows[i] for i in idx], sorted_path)

    asked = [i for i, r in enumerate(rows) if r.wants_logprobs]
    if not asked:
        return DeviceSample(tokens, [], None, None, None)
    a = device_tensor(asked, dev)
    lp = torch.log_softmax(logits[a], dim=-1)  # [A, V] raw model distribution
    chosen = lp.gather(1, tokens[a].unsqueeze(1)).squeeze(1)
    id_vals = ids_logprobs(lp, [rows[i].params.token_ids_logprob for i in asked])
    kmax = max(rows[i].params.top_logprobs_num for i in asked)
    if kmax == 0:
        return DeviceSample(tokens, asked, chosen, None, None, id_vals)
    vals, ids = lp.topk(min(kmax, lp.shape[-1]), dim=-1)
    return DeviceSample(tokens, asked, chosen, vals, ids, id_vals)


def sample_results(ds: DeviceSample, rows: Sequence[RowSampling]) -> SampleOutput:
    """The host lists of a DeviceSample (reads its tensors: pass host copies)."""
    token_ids: list[int] = ds.tokens.tolist()
    if ds.chosen is None:
        return SampleOutput(token_ids, [], [])
    logprobs = [math.nan] * len(rows)
    top_logprobs: list[list[tuple[int, float]]] = [[] for _ in rows]
    for i, v in zip(ds.asked, ds.chosen.tolist()):
        logprobs[i] = v
    if ds.top_vals is not None and ds.top_ids is not None:
        vals_l, ids_l = ds.top_vals.tolist(), ds.top_ids.tolist()
        for j, i in enumerate(ds.asked):
            k = rows[i].params.top_logprobs_num
            top_logprobs[i] = list(zip(ids_l[j][:k], vals_l[j][:k]))
    if ds.id_vals is not None:
        for i, vals in zip(ds.asked, ds.id_vals.tolist(), strict=True):
            top_logprobs[i] = with_ids(top_logprobs[i], rows[i].params.token_ids_logprob, vals)
    return SampleOutput(token_ids, logprobs, top_logprobs)


def sample(logits: torch.Tensor, rows: Sequence[RowSampling]) -> SampleOutput:
    """logits: [B, V] float32, one row per entry of `rows`. Does not modify `logits`.
    sample_on_device then sample_results, in one call (reads the device)."""
    return sample_results(sample_on_device(logits, rows), rows)
