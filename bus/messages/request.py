"""The request lifecycle at the edge: what the gateway asks for and how it ends."""

from __future__ import annotations

from typing import Any

import msgspec

from shunter.bus.messages.base import Msg


class SamplingParams(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Per-request sampling and stopping controls (SGLang's names).

    Defaults mean "off": temperature 1.0 with top_p 1, top_k -1 (all), min_p 0,
    penalties neutral. temperature 0 is greedy."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # >1 discourages tokens already in prompt or output
    frequency_penalty: float = 0.0  # subtracted once per earlier occurrence in the output
    presence_penalty: float = 0.0  # subtracted once if the token occurred in the output
    min_new_tokens: int = 0  # eos and stop token ids are masked until this many tokens
    stop: list[str] = []  # stop strings, matched by the tokenizer on detokenized text
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False  # keep the matched stop string in the output text
    seed: int | None = None  # per-request sampling seed; None draws one at the gateway
    logit_bias: dict[int, float] = {}  # token id -> bias added to its logit
    return_logprob: bool = False  # logprob of each sampled token
    top_logprobs_num: int = 0  # also the k most likely tokens at each step
    logprob_start_len: int = -1  # >= 0: prompt logprobs from this prompt position on
    # These tokens' logprobs at every position that reports logprobs, each position's
    # list of them following its top_logprobs_num top tokens (SGLang's token_ids_logprob)
    token_ids_logprob: list[int] = []
    # stop regexes, matched by the tokenizer on detokenized text as the stop strings are
    # (actors/tokenizer/stop_regex.py: linear-time, the syntax Python's re shares with it)
    stop_regex: list[str] = []
    # constrained decoding: the whole output must match this regular expression
    # (actors/grammar: the gateway turns json_schema and response_format into one)
    regex: str = ""


class ChatMessage(msgspec.Struct, frozen=True, array_like=True, gc=False):
    role: str
    content: str
    # an assistant turn's calls: OpenAI's [{id, type: "function", function: {name,
    # arguments: JSON text}}]; a tool turn names the call it answers
    tool_calls: list[dict[str, Any]] = []
    tool_call_id: str | None = None


class GenerateRequest(Msg, tag="req.generate"):
    """A new request from the gateway. Exactly one of text, input_ids, messages is set.
    The gateway expands `n > 1` into n requests (`request_id` + "-i") before this."""

    request_id: str
    sampling: SamplingParams
    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None  # chat: the tokenizer applies the template
    stream: bool = False
    priority: int = 0  # larger is more urgent (policy "priority")
    extra_key: str = ""  # cache namespace: LoRA id / cache salt; prefixes never cross it
    arrival_ns: int = 0  # gateway's monotonic clock at arrival
    add_generation_prompt: bool = True  # chat only
    # True: a prompt too long for prompt + max_new_tokens shortens max_new_tokens to fit
    # (the OpenAI API with max_tokens unset); False: such a request fails (400).
    clamp_max_new_tokens: bool = False
    # chat only: end the prompt inside the last message (an assistant reply to go on
    # with) instead of closing it, and extra variables for the template
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] = {}
    # chat only: function tools the template shows the model (OpenAI's [{type:
    # "function", function: {name, description, parameters}}])
    tools: list[dict[str, Any]] = []


class AbortRequest(Msg, tag="req.abort"):
    """Stop a request wherever it is. Idempotent: aborting a finished or unknown request
    is a no-op. The tokenizer also sends it (reason "stop_string") when a stop string
    matched, which ends the request with finish_reason "stop"."""

    request_id: str
    reason: str = "client"  # "client", "disconnect", "stop_string", "shutdown", "admin"
    matched_stop: str | None = None  # the stop string, when reason == "stop_string"


class RequestFailed(Msg, tag="req.failed"):
    """A request-scoped failure: the request is over and the client gets this error."""

    request_id: str
    code: str  # "invalid_request", "context_length_exceeded", "actor_died", "internal"
    message: str
    http_status: int = 400
