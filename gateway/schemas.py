"""Request bodies: the msgspec schemas of the generation endpoints, and `decode_body`.

Decoding is strict about types (a string where a number belongs is an error that names
the field) and lenient about unknown fields, which are ignored as the OpenAI API does.
Ranges are checked after decoding, in validation.py.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, TypeVar

import msgspec

from shunter.gateway.errors import bad_request

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


class SamplingKnobs(msgspec.Struct, kw_only=True):
    """The sampling and output-constraint fields that /generate's sampling_params and
    the OpenAI-style bodies both take, under the same names."""

    n: I64 = 1
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
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    regex: Any = None
    ebnf: Any = None
    json_schema: Any = None
    structural_tag: Any = None
    stop_regex: str | list[str] | None = None


class SamplingFields(SamplingKnobs, kw_only=True):
    """Fields shared by /v1/completions, /v1/chat/completions and /v1/responses (OpenAI
    names plus the SGLang/vLLM extensions that clients pass through extra_body)."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    min_tokens: I64 = 0
    priority: Priority = 0
    rid: str | None = None


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


class StructuralTagFields(msgspec.Struct, kw_only=True):
    """An output format's structural tag (type structural_tag): the format object
    (xgrammar's form) or structures and triggers (SGLang's older form)."""

    format: Any = None
    structures: list[Any] | None = None
    triggers: list[Any] | None = None


class ResponseFormat(StructuralTagFields, kw_only=True):
    type: str
    json_schema: JsonSchemaFormat | None = None
    schema: dict[str, Any] | None = None  # vLLM/SGLang also take it here


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


class NativeSamplingParams(SamplingKnobs, kw_only=True):
    """`sampling_params` of SGLang's /generate."""

    max_new_tokens: I64 = 128
    min_new_tokens: I64 = 0
    sampling_seed: Seed | None = None

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
