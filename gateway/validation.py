"""Request bodies: msgspec schemas and the checks that turn bad input into clear 400s.

Decoding is strict about types (a string where a number belongs is an error that names
the field) and lenient about unknown fields, which are ignored as the OpenAI API does.
Ranges are checked after decoding; each failure names its parameter (`param`).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, TypeVar

import msgspec

from shunter.bus.messages import ChatMessage, SamplingParams
from shunter.gateway.errors import APIError, bad_request
from shunter.gateway.tool_calls import PARSERS

T = TypeVar("T")

# Bounded integer types: a number past 64 bits would fail to encode on the bus (a 500),
# so the schema rejects it with a 400 naming the field.
I64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
Seed = Annotated[int, msgspec.Meta(ge=0, le=2**62)]  # choice k uses seed + k
Priority = Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)]
_PATH = re.compile(r"at `\$\.?([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]*)`")


def decode_body(body: bytes, schema: type[T]) -> T:
    """JSON body -> schema instance, or APIError(400) naming what is wrong."""
    if not body.strip():
        raise bad_request("the request body is empty; send a JSON object")
    try:
        return msgspec.json.decode(body, type=schema)
    except msgspec.ValidationError as e:
        m = _PATH.search(str(e))
        param = m.group(1) if m and m.group(1) else None
        missing = _MISSING.search(str(e))
        if missing:
            param = f"{param}.{missing.group(1)}" if param else missing.group(1)
        raise bad_request(f"invalid request: {e}", param=param) from None
    except msgspec.DecodeError as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None


class StreamOptions(msgspec.Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by /v1/completions, /v1/chat/completions and /v1/responses (OpenAI
    names plus the SGLang/vLLM extensions that clients pass through extra_body)."""

    model: str | None = None
    n: I64 = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: I64 | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: Seed | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    min_tokens: I64 = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    priority: Priority = 0
    rid: str | None = None
    regex: Any = None
    ebnf: Any = None
    json_schema: Any = None
    structural_tag: Any = None
    stop_regex: str | list[str] | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[Any]
    max_tokens: I64 | None = 16
    echo: bool = False
    logprobs: I64 | None = None
    best_of: I64 | None = None
    suffix: str | None = None


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class FunctionCallIn(msgspec.Struct):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(msgspec.Struct):
    function: FunctionCallIn
    id: str = ""
    type: str = "function"


class ChatMessageIn(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class JsonSchemaFormat(msgspec.Struct):
    schema: dict[str, Any] | None = None
    name: str | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct):
    type: str
    json_schema: JsonSchemaFormat | None = None
    schema: dict[str, Any] | None = None  # vLLM/SGLang also take it here
    structures: list[Any] | None = None  # type structural_tag (SGLang)
    triggers: list[Any] | None = None
    format: Any = None  # type structural_tag, the format-object form (xgrammar's)


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessageIn]
    max_tokens: I64 | None = None
    max_completion_tokens: I64 | None = None
    logprobs: bool = False
    top_logprobs: I64 | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # with a required call: false asks for exactly one
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool | None = None  # None: true unless continue_final_message
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class Limits(msgspec.Struct, frozen=True):
    max_context_len: int
    max_n: int
    max_top_logprobs: int
    max_prompts: int


def _check(cond: bool, message: str, param: str) -> None:
    if not cond:
        raise bad_request(message, param=param)


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
    _check(len(given) <= 1, f"give at most one of regex, json_schema, ebnf, structural_tag, {fmt_param}; "
                            f"got {', '.join(given)}", given[-1] if given else None)  # fmt: skip
    if not given:
        return ""
    try:
        if given[0] == "regex":
            _check(isinstance(req.regex, str) and req.regex != "", "regex must be a non-empty "
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
        _check(schema is not None, f"{fmt_param} json_schema needs a schema", fmt_param)
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
    _check(all(stops), f"{what} must not be empty", param)
    return stops


def generation_prompt(add_generation_prompt: bool | None, continue_final_message: bool) -> bool:
    """Whether the chat template adds the assistant's turn opening: as asked, else
    unless the last message is to be continued; both at once is refused."""
    _check(
        not (add_generation_prompt and continue_final_message),
        "continue_final_message and add_generation_prompt cannot both be true",
        "continue_final_message",
    )
    if add_generation_prompt is None:
        return not continue_final_message
    return add_generation_prompt


def check_n(n: int, limits: Limits) -> None:
    _check(1 <= n <= limits.max_n, f"n must be between 1 and {limits.max_n}, got {n}", "n")


def check_max_tokens(value: int | None, limits: Limits, param: str, *, minimum: int = 1) -> None:
    if value is None:
        return
    _check(value >= minimum, f"{param} must be at least {minimum}, got {value}", param)
    _check(
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
    _check(0.0 <= t <= 100.0, f"temperature must be between 0 and 100, got {t}", "temperature")
    top_p = 1.0 if req.top_p is None else req.top_p
    _check(0.0 < top_p <= 1.0, f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = -1 if req.top_k is None else req.top_k
    _check(top_k == -1 or top_k >= 1, f"top_k must be -1 (all) or >= 1, got {top_k}", "top_k")
    min_p = 0.0 if req.min_p is None else req.min_p
    _check(0.0 <= min_p <= 1.0, f"min_p must be in [0, 1], got {min_p}", "min_p")
    pres = req.presence_penalty or 0.0
    freq = req.frequency_penalty or 0.0
    _check(
        -2.0 <= pres <= 2.0, f"presence_penalty must be in [-2, 2], got {pres}", "presence_penalty"
    )
    _check(
        -2.0 <= freq <= 2.0,
        f"frequency_penalty must be in [-2, 2], got {freq}",
        "frequency_penalty",
    )
    rep = 1.0 if req.repetition_penalty is None else req.repetition_penalty
    _check(
        0.0 < rep <= 2.0, f"repetition_penalty must be in (0, 2], got {rep}", "repetition_penalty"
    )
    _check(req.min_tokens >= 0, f"min_tokens must be >= 0, got {req.min_tokens}", "min_tokens")
    _check(
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
        _check(0 <= tid < 2**31, f"logit_bias token id must be in [0, 2^31), got {tid}",
               "logit_bias")  # fmt: skip
        _check(
            -100.0 <= v <= 100.0, f"logit_bias values must be in [-100, 100], got {v}", "logit_bias"
        )
        bias[tid] = float(v)
    stop_ids = list(req.stop_token_ids or [])
    _check(all(i >= 0 for i in stop_ids), "stop_token_ids must be >= 0", "stop_token_ids")
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
    _check(len(prompt) > 0, "prompt must not be an empty list", "prompt")
    if all(isinstance(p, str) for p in prompt):
        prompts: list[str | list[int]] = list(prompt)
    elif all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        prompts = [list(prompt)]
    elif all(isinstance(p, list) for p in prompt):
        for p in prompt:
            _check(
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
    _check(
        len(prompts) <= limits.max_prompts,
        f"at most {limits.max_prompts} prompts per request, got {len(prompts)}",
        "prompt",
    )
    for p in prompts:
        if isinstance(p, list):
            _check(all(0 <= i < 2**31 for i in p), "token ids must be in [0, 2^31)", "prompt")
    return prompts


def chat_messages(messages: list[ChatMessageIn]) -> list[ChatMessage]:
    """OpenAI chat messages -> bus ChatMessages (text only)."""
    _check(len(messages) > 0, "messages must not be empty", "messages")
    out: list[ChatMessage] = []
    for i, m in enumerate(messages):
        _check(
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
                _check(
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


def tool_parser(tools: list[Any] | None, tool_choice: Any, parser: str | None, *,
                forced_ok: bool = False) -> str | None:  # fmt: skip
    """The tool-call parser a request's answer goes through (None: no tools), from its
    tools, its tool_choice and the server's --tool-call-parser. `forced_ok`: the
    endpoint constrains the answer for a required or named call (forced_call)."""
    if not forced_ok:
        _check(tool_choice in (None, "auto", "none"), "tool_choice must be 'auto' or 'none' "
               "here (a required or named call is taken by /v1/chat/completions)",
               "tool_choice")  # fmt: skip
    forced = forced_call(tool_choice)
    _check(forced is None or bool(tools), "tool_choice asks for a call but there are no tools",
           "tool_choice")  # fmt: skip
    if not tools or tool_choice == "none":
        return None
    _check(parser is not None, "tools need a server started with --tool-call-parser "
           f"({', '.join(PARSERS)})", "tools")  # fmt: skip
    return parser


def forced_call(tool_choice: Any) -> str | None:
    """None when the model may answer freely ("auto", "none", absent); "" for a required
    call of any tool; the function's name for {"type": "function", "function":
    {"name": ...}}."""
    if tool_choice in (None, "auto", "none"):
        return None
    if tool_choice == "required":
        return ""
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    _check(isinstance(fn, dict) and isinstance(fn.get("name"), str) and bool(fn["name"]),
           "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', "
           "'function': {'name': ...}}", "tool_choice")  # fmt: skip
    return fn["name"]


def constrain_to_calls(sampling: SamplingParams, tool_choice: Any, parser: str | None,
                       tools: list[dict[str, Any]], parallel_tool_calls: bool | None,
                       other: str) -> SamplingParams:  # fmt: skip
    """`sampling` with the answer constrained to calls in the parser's format when
    tool_choice asks for a required or named call (tool_calls.forced_regex; exactly
    one with parallel_tool_calls false), or, with "auto" and a strict tool, to prose and
    whole calls (tool_calls.strict_regex); 400 where another constraint (`other`) is
    given with a forced call or the calls cannot be written so."""
    forced = forced_call(tool_choice)
    if forced is None and parser is not None and tool_choice != "none" and not sampling.regex:
        from shunter.gateway import tool_calls

        try:
            strict = tool_calls.strict_regex(parser, tools)
        except ValueError as e:
            raise bad_request(str(e), param="tools") from None
        return msgspec.structs.replace(sampling, regex=strict) if strict else sampling
    if forced is None or parser is None:
        return sampling
    if sampling.regex:
        raise bad_request(f"a required or named tool call cannot be combined with {other}",
                          param="tool_choice")  # fmt: skip
    from shunter.gateway import tool_calls

    try:
        call_regex = tool_calls.forced_regex(parser, tools, forced or None,
                                             many=parallel_tool_calls is not False)  # fmt: skip
    except ValueError as e:
        raise bad_request(str(e), param="tool_choice") from None
    return msgspec.structs.replace(sampling, regex=call_regex)


def check_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """OpenAI function tools, each {type: "function", function: {name, ...}}."""
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        _check(isinstance(fn, dict) and t.get("type", "function") == "function"
               and isinstance(fn.get("name"), str) and bool(fn["name"]),
               f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}",
               f"tools[{i}]")  # fmt: skip
    return list(tools)


class NativeSamplingParams(msgspec.Struct, kw_only=True):
    """`sampling_params` of SGLang's /generate."""

    max_new_tokens: I64 = 128
    temperature: float | None = None
    top_p: float | None = None
    top_k: I64 | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_new_tokens: I64 = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: I64 = 1
    seed: Seed | None = None
    sampling_seed: Seed | None = None
    logit_bias: dict[str, float] | None = None
    regex: Any = None
    ebnf: Any = None
    json_schema: Any = None
    structural_tag: Any = None
    stop_regex: str | list[str] | None = None

    @property
    def min_tokens(self) -> int:
        return self.min_new_tokens


class GenerateBody(msgspec.Struct, kw_only=True):
    """Body of SGLang's native /generate: one request or a batch."""

    text: str | list[str] | None = None
    input_ids: list[Any] | None = None
    sampling_params: NativeSamplingParams | list[NativeSamplingParams] | None = None
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: I64 = -1
    top_logprobs_num: I64 = 0
    token_ids_logprob: list[Any] | None = None  # ids (or one list per input), see native_api
    return_text_in_logprobs: bool = False  # SGLang's default: entries are [logprob, id, None]
    rid: str | list[str] | None = None
    priority: Priority | None = None
