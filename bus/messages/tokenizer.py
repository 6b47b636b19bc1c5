"""Tokenizer actor: text in (Tokenized), text out (TextDeltas)."""

from __future__ import annotations

import msgspec

from shunter.bus.messages.base import Msg
from shunter.bus.messages.request import SamplingParams


class Tokenized(Msg, tag="tok.tokenized"):
    """A request as token ids, on its way to the cache manager for a prefix match."""

    request_id: str
    input_ids: list[int]
    sampling: SamplingParams  # stop_token_ids already include the model's eos ids
    priority: int = 0
    extra_key: str = ""
    arrival_ns: int = 0
    stream: bool = False


class TopLogprob(msgspec.Struct, frozen=True, array_like=True, gc=False):
    token_id: int
    logprob: float
    text: str = ""  # filled by the tokenizer on the way out


class TextDelta(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """New output of one request since its last delta."""

    request_id: str
    text: str  # never ends in half a UTF-8 character; stop strings already trimmed
    token_ids: list[int]
    logprobs: list[float] = []  # one per token in token_ids, when asked for
    top_logprobs: list[list[TopLogprob]] = []  # one list per token, when asked for
    prompt_logprobs: list[float] = []  # first delta only, when logprob_start_len >= 0
    finish_reason: str | None = None  # set on the last delta; see FinishReason
    matched_stop: int | str | None = None  # the stop token id or stop string that hit
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    num_cached_tokens: int = 0


class TextDeltas(Msg, tag="tok.deltas"):
    """All deltas produced from one scheduler step, batched to keep bus traffic per step
    constant rather than per request."""

    deltas: list[TextDelta]
