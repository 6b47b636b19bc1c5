"""Tokenizer actor: text in (Tokenized), text out (TextDeltas)."""

from __future__ import annotations

from typing import Any

import msgspec

from shunter.bus.messages.base import Msg
from shunter.bus.messages.request import ChatMessage, SamplingParams


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
    token_texts: list[str] = []  # text of each token in token_ids, when logprobs are asked for
    prompt_token_ids: list[int] = []  # first delta only, when logprob_start_len >= 0
    prompt_token_texts: list[str] = []  # text of each of prompt_token_ids
    prompt_top_logprobs: list[list[TopLogprob]] = []  # one list per prompt_logprobs item


class TextDeltas(Msg, tag="tok.deltas"):
    """All deltas produced from one scheduler step, batched to keep bus traffic per step
    constant rather than per request."""

    deltas: list[TextDelta]


class TokenizeQuery(Msg, tag="tok.query.encode"):
    """Gateway to tokenizer (/v1/tokenize): text, or a conversation through the chat
    template, to ids. Answered by TokenizeReply with the same query_id."""

    query_id: str
    text: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True  # messages only
    continue_final_message: bool = False  # messages only, as in GenerateRequest
    chat_template_kwargs: dict[str, Any] = {}  # messages only


class TokenizeReply(Msg, tag="tok.reply.encode"):
    query_id: str
    tokens: list[int] = []
    max_model_len: int = 0
    error: str = ""  # non-empty: the query was invalid, and this says why


class DetokenizeQuery(Msg, tag="tok.query.decode"):
    """Gateway to tokenizer (/v1/detokenize, echo of id prompts): ids to text."""

    query_id: str
    tokens: list[int]
    skip_special_tokens: bool = False


class DetokenizeReply(Msg, tag="tok.reply.decode"):
    query_id: str
    text: str = ""
    error: str = ""
