"""Request checks: what decoding into a schema (schemas.py) leaves open, turned into
clear 400s.

Ranges, prompt shapes, chat messages and the one regex a request's output must match
are checked after decoding; each failure names its parameter (`param`).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from shunter.bus.messages import ChatMessage, SamplingParams
from shunter.gateway.errors import APIError, bad_request, require
from shunter.gateway.schemas import ChatMessageIn, SamplingFields


class Limits(msgspec.Struct, frozen=True):
    max_context_len: int
    max_n: int
    max_top_logprobs: int
    max_prompts: int


MAX_LOGPROB_TOKEN_IDS = 1024  # ids one request may ask logprobs of (token_ids_logprob, labels)


def is_token_ids(x: Any) -> bool:
    """A list of token ids: ints (not bools) in [0, 2^31)."""
    return isinstance(x, list) and all(type(i) is int and 0 <= i < 2**31 for i in x)


def check_logprob_ids(ids: Any, param: str) -> list[int]:
    """ids whose logprobs a request asks for: a non-empty list of token ids, at most
    MAX_LOGPROB_TOKEN_IDS of them (APIError 400 naming `param` otherwise)."""
    if not ids or not is_token_ids(ids):
        raise bad_request(f"{param} must be a non-empty list of token ids (integers >= 0)",
                          param=param)  # fmt: skip
    if len(ids) > MAX_LOGPROB_TOKEN_IDS:
        raise bad_request(f"{param} takes at most {MAX_LOGPROB_TOKEN_IDS} ids", param=param)
    return ids


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise APIError(
            404,
            f"The model `{requested}` does not exist; this server serves `{served}`.",
            param="model",
            code="model_not_found",
        )


def constraint_regex(req: Any, fmt: Any = None, fmt_param: str = "response_format") -> str:
    """The regular expression a request's output must match whole: its `regex`, its
    `json_schema`, its `ebnf` grammar or its `structural_tag` (SGLang's names), or its
    output format `fmt` (chat's response_format, the Responses API's text.format, named
    `fmt_param`: json_schema, json_object or structural_tag); "" when none. At most one
    may be given."""
    from shunter.actors.grammar.ebnf import ebnf_regex
    from shunter.actors.grammar.json_schema import json_object, schema_regex
    from shunter.actors.grammar.structural_tag import structural_tag_regex

    if fmt is None:
        fmt = getattr(req, "response_format", None)
    names = ("regex", "json_schema", "ebnf", "structural_tag")
    given = [n for n in names if getattr(req, n, None) is not None]
    if fmt is not None and fmt.type != "text":
        given.append(fmt_param)
    require(len(given) <= 1, f"give at most one of regex, json_schema, ebnf, structural_tag, {fmt_param}; "
                             f"got {', '.join(given)}", given[-1] if given else None)  # fmt: skip
    if not given:
        return ""
    try:
        if given[0] == "regex":
            require(isinstance(req.regex, str) and req.regex != "", "regex must be a non-empty "
                    "string", "regex")  # fmt: skip
            return req.regex
        if given[0] == "json_schema":
            return schema_regex(req.json_schema)
        if given[0] == "ebnf":
            return ebnf_regex(req.ebnf)
        if given[0] == "structural_tag":
            return structural_tag_regex(req.structural_tag)
        if fmt.type == "json_object":
            return json_object()
        if fmt.type == "structural_tag":
            if getattr(fmt, "format", None) is not None:
                return structural_tag_regex({"format": fmt.format})
            return structural_tag_regex(
                {
                    "structures": getattr(fmt, "structures", None),
                    "triggers": getattr(fmt, "triggers", None),
                }
            )
        if fmt.type != "json_schema":
            raise bad_request(f"{fmt_param} type {fmt.type!r} is not supported (text, "
                              "json_object, json_schema or structural_tag)", param=fmt_param)  # fmt: skip
        nested = getattr(fmt, "json_schema", None)
        schema = nested.schema if nested is not None else fmt.schema
        require(schema is not None, f"{fmt_param} json_schema needs a schema", fmt_param)
        return schema_regex(schema)
    except ValueError as e:
        raise bad_request(str(e), param=given[0]) from None


def stop_list(stop: str | list[str] | None, param: str = "stop") -> list[str]:
    """`stop` or `stop_regex` as a list (the tokenizer compiles the regexes: a pattern
    it refuses is a 400 from there)."""
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    what = "stop strings" if param == "stop" else "stop regexes"
    require(all(stops), f"{what} must not be empty", param)
    return stops


def generation_prompt(add_generation_prompt: bool | None, continue_final_message: bool) -> bool:
    """Whether the chat template adds the assistant's turn opening: as asked, else
    unless the last message is to be continued; both at once is refused."""
    require(
        not (add_generation_prompt and continue_final_message),
        "continue_final_message and add_generation_prompt cannot both be true",
        "continue_final_message",
    )
    if add_generation_prompt is None:
        return not continue_final_message
    return add_generation_prompt


def check_n(n: int, limits: Limits) -> None:
    require(1 <= n <= limits.max_n, f"n must be between 1 and {limits.max_n}, got {n}", "n")


def check_max_tokens(value: int | None, limits: Limits, param: str, *, minimum: int = 1) -> None:
    if value is None:
        return
    require(value >= minimum, f"{param} must be at least {minimum}, got {value}", param)
    require(
        value < limits.max_context_len,
        f"{param} is {value}, but this model's context length is {limits.max_context_len} "
        "tokens (prompt included)",
        param,
    )


def sampling_from(
    req: SamplingFields, *, max_new_tokens: int, return_logprob: bool, top_logprobs_num: int
) -> SamplingParams:
    """OpenAI request -> SamplingParams, checking every range (seed is set per choice)."""
    t = 1.0 if req.temperature is None else req.temperature
    require(0.0 <= t <= 100.0, f"temperature must be between 0 and 100, got {t}", "temperature")
    top_p = 1.0 if req.top_p is None else req.top_p
    require(0.0 < top_p <= 1.0, f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = -1 if req.top_k is None else req.top_k
    require(top_k == -1 or top_k >= 1, f"top_k must be -1 (all) or >= 1, got {top_k}", "top_k")
    min_p = 0.0 if req.min_p is None else req.min_p
    require(0.0 <= min_p <= 1.0, f"min_p must be in [0, 1], got {min_p}", "min_p")
    pres = req.presence_penalty or 0.0
    freq = req.frequency_penalty or 0.0
    require(
        -2.0 <= pres <= 2.0, f"presence_penalty must be in [-2, 2], got {pres}", "presence_penalty"
    )
    require(
        -2.0 <= freq <= 2.0,
        f"frequency_penalty must be in [-2, 2], got {freq}",
        "frequency_penalty",
    )
    rep = 1.0 if req.repetition_penalty is None else req.repetition_penalty
    require(
        0.0 < rep <= 2.0, f"repetition_penalty must be in (0, 2], got {rep}", "repetition_penalty"
    )
    require(req.min_tokens >= 0, f"min_tokens must be >= 0, got {req.min_tokens}", "min_tokens")
    require(
        req.min_tokens <= max_new_tokens,
        f"min_tokens ({req.min_tokens}) is larger than the maximum number of tokens "
        f"({max_new_tokens})",
        "min_tokens",
    )
    bias: dict[int, float] = {}
    for k, v in (req.logit_bias or {}).items():
        try:
            tid = int(k)
        except ValueError:
            raise bad_request(
                f"logit_bias keys must be token ids, got {k!r}", param="logit_bias"
            ) from None
        require(0 <= tid < 2**31, f"logit_bias token id must be in [0, 2^31), got {tid}",
                "logit_bias")  # fmt: skip
        require(
            -100.0 <= v <= 100.0, f"logit_bias values must be in [-100, 100], got {v}", "logit_bias"
        )
        bias[tid] = float(v)
    stop_ids = list(req.stop_token_ids or [])
    require(all(i >= 0 for i in stop_ids), "stop_token_ids must be >= 0", "stop_token_ids")
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=t,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        repetition_penalty=rep,
        frequency_penalty=freq,
        presence_penalty=pres,
        min_new_tokens=req.min_tokens,
        stop=stop_list(req.stop),
        stop_regex=stop_list(req.stop_regex, "stop_regex"),
        regex=constraint_regex(req),
        stop_token_ids=stop_ids,
        ignore_eos=req.ignore_eos,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        no_stop_trim=req.no_stop_trim,
        seed=req.seed,
        logit_bias=bias,
        return_logprob=return_logprob,
        top_logprobs_num=top_logprobs_num,
    )


def completion_prompts(prompt: str | list[Any], limits: Limits) -> list[str | list[int]]:
    """OpenAI's four prompt shapes (str, [str], [int], [[int]]) -> a list of prompts."""
    if isinstance(prompt, str):
        return [prompt]
    require(len(prompt) > 0, "prompt must not be an empty list", "prompt")
    if all(isinstance(p, str) for p in prompt):
        prompts: list[str | list[int]] = list(prompt)
    elif all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        prompts = [list(prompt)]
    elif all(isinstance(p, list) for p in prompt):
        for p in prompt:
            require(
                len(p) > 0 and all(isinstance(i, int) and not isinstance(i, bool) for i in p),
                "each token-id prompt must be a non-empty list of integers",
                "prompt",
            )
        prompts = [list(p) for p in prompt]
    else:
        raise bad_request(
            "prompt must be a string, a list of strings, a list of token ids, "
            "or a list of lists of token ids",
            param="prompt",
        )
    require(
        len(prompts) <= limits.max_prompts,
        f"at most {limits.max_prompts} prompts per request, got {len(prompts)}",
        "prompt",
    )
    for p in prompts:
        if isinstance(p, list):
            require(all(0 <= i < 2**31 for i in p), "token ids must be in [0, 2^31)", "prompt")
    return prompts


def chat_messages(messages: list[ChatMessageIn]) -> list[ChatMessage]:
    """OpenAI chat messages -> bus ChatMessages (text only)."""
    require(len(messages) > 0, "messages must not be empty", "messages")
    out: list[ChatMessage] = []
    for i, m in enumerate(messages):
        require(
            m.role in ("system", "user", "assistant", "developer", "tool"),
            f"messages[{i}].role must be one of system, user, assistant, developer, tool; "
            f"got {m.role!r}",
            f"messages[{i}].role",
        )
        if m.content is None:
            text = ""
        elif isinstance(m.content, str):
            text = m.content
        else:
            parts = []
            for p in m.content:
                require(
                    p.type == "text" and p.text is not None,
                    f"messages[{i}].content: only text parts are supported, got {p.type!r}",
                    f"messages[{i}].content",
                )
                parts.append(p.text)
            text = "".join(parts)  # type: ignore[arg-type]
        calls = [{"id": c.id, "type": c.type, "function": {
            "name": c.function.name, "arguments": c.function.arguments
            if isinstance(c.function.arguments, str) else json.dumps(c.function.arguments)}}
            for c in m.tool_calls or ()]  # fmt: skip
        out.append(ChatMessage("system" if m.role == "developer" else m.role, text, calls,
                               m.tool_call_id))  # fmt: skip
    return out
