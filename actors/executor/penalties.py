"""Stages 1-4 of the sampling pipeline (actors/executor/sampling.py): the penalties,
logit bias and min_new_tokens masks that change a row's logits before temperature.

Theory of operation: each stage gathers, over the rows that ask for it, flat (row,
token, value) lists on the host from the rows' own statistics, and applies them to
the [B, V] logits with one indexed write or accumulate on the device; the index
tensors reach the device by asynchronous pinned copies, so nothing waits for it.
Stages in order: repetition penalty (HF: a positive logit divided by the penalty, a
negative one multiplied, for every token seen in the prompt or output), frequency
and presence penalties (OpenAI, over output tokens), logit_bias, -inf for eos and
stop ids until min_new_tokens tokens exist, and -inf for every token a row's regex
constraint does not allow next (actors/grammar/token_fsm.py; its masks are host
arrays, stacked and copied once per step).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from shunter.actors.executor.slot_table import device_tensor
from shunter.actors.grammar.token_fsm import DEAD, eos_only

if TYPE_CHECKING:
    from shunter.actors.executor.sampling import RowSampling


def apply_penalties(x: torch.Tensor, rows: Sequence[RowSampling]) -> torch.Tensor:
    """Stages 1-4 of the pipeline on x: [B, V] float32, IN PLACE (pass a copy of the
    model's logits); returns x."""
    rep_r, rep_t, rep_p = [], [], []
    fp_r, fp_t, fp_v = [], [], []
    bias_r, bias_t, bias_v = [], [], []
    mask_r, mask_t = [], []
    grammar_r, grammar_m = [], []
    for i, row in enumerate(rows):
        ends_only = False  # the constraint allows nothing but an end of sequence
        if row.grammar is not None:
            g, state = row.grammar, row.grammar_state
            allowed = g.allowed(state) if state != DEAD else eos_only(g.vocab)
            grammar_r.append(i)
            grammar_m.append(allowed)
            ends_only = not allowed[g.vocab.lengths > 0].any()
        p = row.params
        if p.repetition_penalty != 1.0 and row.seen:
            rep_r += [i] * len(row.seen)
            rep_t += row.seen
            rep_p += [p.repetition_penalty] * len(row.seen)
        if row.output_counts:
            fp_r += [i] * len(row.output_counts)
            fp_t += row.output_counts.keys()
            fp_v += [
                p.frequency_penalty * c + p.presence_penalty for c in row.output_counts.values()
            ]
        if p.logit_bias:
            bias_r += [i] * len(p.logit_bias)
            bias_t += p.logit_bias.keys()
            bias_v += p.logit_bias.values()
        if row.num_output_tokens < p.min_new_tokens and row.masked_ids and not ends_only:
            mask_r += [i] * len(row.masked_ids)
            mask_t += row.masked_ids
    dev = x.device
    if rep_r:
        r, t = device_tensor(rep_r, dev), device_tensor(rep_t, dev)
        pen = device_tensor(rep_p, dev, x.dtype)
        v = x[r, t]  # [N]
        x[r, t] = torch.where(v > 0, v / pen, v * pen)
    if fp_r:
        x.index_put_(
            (device_tensor(fp_r, dev), device_tensor(fp_t, dev)),
            -device_tensor(fp_v, dev, x.dtype),
            accumulate=True,
        )
    if bias_r:
        x.index_put_(
            (device_tensor(bias_r, dev), device_tensor(bias_t, dev)),
            device_tensor(bias_v, dev, x.dtype),
            accumulate=True,
        )
    if mask_r:  # the value as a device tensor: a Python scalar would be a blocking copy
        x.index_put_((device_tensor(mask_r, dev), device_tensor(mask_t, dev)),
                     x.new_full((), -math.inf))  # fmt: skip
    if grammar_r:
        allowed = torch.zeros((len(grammar_r), x.shape[1]), dtype=torch.bool)
        width = min(x.shape[1], grammar_m[0].shape[0])
        allowed[:, :width] = torch.from_numpy(np.stack(grammar_m)[:, :width])
        r = device_tensor(grammar_r, dev)
        x[r] = x[r].masked_fill(~allowed.to(dev, non_blocking=True), -math.inf)
    return x


def needs_processing(row: RowSampling) -> bool:
    """Whether any of stages 1-4 changes this row's logits this step."""
    p = row.params
    return bool(
        (p.repetition_penalty != 1.0 and row.seen)
        or row.output_counts
        or p.logit_bias
        or (row.num_output_tokens < p.min_new_tokens and row.masked_ids)
        or row.grammar is not None
    )
