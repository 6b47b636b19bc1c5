"""OpenAI's Responses API: POST /v1/responses; GET and DELETE /v1/responses/{id}.

Input: `input` (a string, or a list of items: messages, function calls and their
outputs; responses_items.py), `instructions` (a system message ahead of them),
`max_output_tokens`, `temperature`, `top_p`, `stream`, `metadata`, `user`, `tools`
(function tools, with `--tool-call-parser`; `tool_choice` "auto", "none", "required"
or {"type": "function", "name": ...}, the last two constraining the answer to calls as
chat's do, one only with `parallel_tool_calls` false), and the
sampling extensions the chat endpoint takes (`top_k`, `seed`, `stop`, ...). The
answer is a `response` object whose `output` is an assistant message of one
`output_text` part, then a `function_call` item per call the answer made (the message
left out when the answer is only calls); `status` is "completed", "incomplete"
(`incomplete_details.reason` "max_output_tokens") or "cancelled" (aborted). Streamed,
it is OpenAI's event sequence: response.created, response.in_progress, for the message
response.output_item.added, response.content_part.added, response.output_text.delta
per delta and the matching .done events, for each call response.output_item.added,
response.function_call_arguments.delta and .done and response.output_item.done, then
response.completed (or response.incomplete), each with a sequence_number; a failure
after the start is an `error` event.

With `store` (the default) a finished response is kept in the gateway's memory, the
latest MAX_STORED of them: GET returns it (and /input_items its own input), DELETE
forgets it, and `previous_response_id` continues its conversation (its input and
output, calls included, ahead of the new input; its instructions are not carried
over, as OpenAI does). An unknown id is a 404 (GET, DELETE) or a 400
(`previous_response_id`). `text.format` json_schema, json_object and structural_tag
(either form) constrain the answer as chat's response_format does. Reasoning options,
background mode and `n` are 400s.

Theory of operation: the input becomes the messages of one chat generation
(chat_api.py's path through the chat template); the handler shapes its deltas, and
with tools reads calls out of them as the chat endpoint does (tool_calls.py). The
store lives in the gateway process (not an actor core: nothing replays it), so
responses do not survive a restart.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

import msgspec
from aiohttp import web

from shunter.bus.messages import ChatMessage, GenerateRequest
from shunter.gateway import tool_calls
from shunter.gateway.app import (
    ctx_of,
    generation,
    json_encoder,
    json_response,
    open_sse,
    read_body,
)
from shunter.gateway.engine import new_id
from shunter.gateway.errors import APIError, bad_request
from shunter.gateway.formats import Acc
from shunter.gateway.responses_items import chat_tools, input_messages, stored_items
from shunter.gateway.schemas import I64, SamplingFields, StructuralTagFields, decode_body
from shunter.gateway.tool_choice import constrain_to_calls, tool_parser
from shunter.gateway.validation import (
    check_max_tokens,
    check_model,
    constraint_regex,
    sampling_from,
)

routes = web.RouteTableDef()

MAX_STORED = 1024  # responses kept for GET / previous_response_id, oldest dropped first


class Stored(msgspec.Struct, frozen=True):
    response: dict
    conversation: list[ChatMessage]  # what it ended, without its instructions
    num_inputs: int  # the last messages before its answer that were its own input


class ResponseStore:
    """Finished responses by id, the latest MAX_STORED."""

    def __init__(self, capacity: int = MAX_STORED) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def put(self, item: Stored) -> None:
        self._items[item.response["id"]] = item
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> Stored | None:
        return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None


STORE = web.AppKey("responses", ResponseStore)


class TextFormat(StructuralTagFields, kw_only=True):
    type: str
    schema: dict[str, Any] | None = None  # json_schema's, with its name and strictness
    name: str | None = None
    strict: bool | None = None
    description: str | None = None


class TextOptions(msgspec.Struct):
    format: TextFormat | None = None


class ResponsesRequest(SamplingFields, kw_only=True):
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: I64 | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    reasoning: Any = None
    include: list[str] | None = None
    background: bool = False
    truncation: str | None = None


def _text_echo(text: TextOptions | None) -> dict:
    """The response's `text` field: the format asked for (text by default)."""
    if text is None or text.format is None:
        return {"format": {"type": "text"}}
    fmt = {k: v for k, v in msgspec.structs.asdict(text.format).items() if v is not None}
    return {"format": fmt}


def _refuse_unsupported(req: ResponsesRequest) -> None:
    def refuse(param: str, what: str) -> None:
        raise bad_request(f"{what} is not supported by this server", param=param)

    if req.reasoning is not None:
        refuse("reasoning", "reasoning")
    if req.include:
        refuse("include", "include")
    if req.background:
        refuse("background", "background mode")
    if req.truncation not in (None, "disabled"):
        refuse("truncation", f"truncation {req.truncation!r}")
    if req.n != 1:
        refuse("n", "n other than 1")


_FINAL_EVENT = {"completed": "response.completed", "incomplete": "response.incomplete"}


def _status(a: Acc) -> tuple[str, dict | None]:
    reason = a.last.finish_reason if a.last else None
    if reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if reason == "abort" or reason is None:
        return "cancelled", None
    return "completed", None


def _usage(a: Acc) -> dict | None:
    if a.last is None:
        return None
    inp, out = a.last.num_prompt_tokens, a.last.num_completion_tokens
    return {"input_tokens": inp, "output_tokens": out, "total_tokens": inp + out,
            "input_tokens_details": {"cached_tokens": a.last.num_cached_tokens},
            "output_tokens_details": {"reasoning_tokens": 0}}  # fmt: skip


class _Shape:
    """The response object and its message item, as they stand."""

    def __init__(self, req: ResponsesRequest, model: str) -> None:
        self.id, self.msg_id = new_id("resp_"), new_id("msg_")
        self.req, self.model, self.created = req, model, int(time.time())

    def calls(self, calls: list[tool_calls.Call]) -> list[dict]:
        """function_call output items."""
        return [{"type": "function_call", "id": new_id("fc_"), "call_id": new_id("call_"),
                 "name": name, "arguments": args, "status": "completed"}
                for name, args in calls]  # fmt: skip

    def message(self, text: str, status: str) -> dict:
        return {"id": self.msg_id, "type": "message", "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [],
                             "logprobs": []}] if status != "in_progress" else []}  # fmt: skip

    def response(self, status: str, output: list, usage: dict | None = None,
                 incomplete: dict | None = None) -> dict:  # fmt: skip
        r = self.req
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": output, "usage": usage, "error": None,
            "incomplete_details": incomplete, "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens, "temperature": r.temperature,
            "top_p": r.top_p, "metadata": r.metadata or {}, "user": r.user, "store": r.store,
            "parallel_tool_calls": r.parallel_tool_calls is not False, "tools": r.tools or [],
            "tool_choice": r.tool_choice or ("auto" if r.tools else "none"),
            "text": _text_echo(r.text), "truncation": "disabled",
            "previous_response_id": r.previous_response_id, "reasoning": None,
            "background": False,
        }  # fmt: skip


def _chat_tool_choice(choice: Any) -> Any:
    """The Responses API's named-function choice, {"type": "function", "name": ...}, in
    chat's shape ({"type": "function", "function": {"name": ...}}); others as they are."""
    if isinstance(choice, dict) and "function" not in choice and "name" in choice:
        return {"type": choice.get("type", "function"), "function": {"name": choice["name"]}}
    return choice


@routes.post("/v1/responses")
async def responses(request: web.Request) -> web.StreamResponse:
    ctx = ctx_of(request)
    req = decode_body(await read_body(request), ResponsesRequest)
    check_model(req.model, ctx.config.served_model_name)
    _refuse_unsupported(req)
    choice = _chat_tool_choice(req.tool_choice)
    parser = tool_parser(req.tools, choice, ctx.config.tool_call_parser, forced_ok=True)
    tools = chat_tools(req.tools or []) if parser else []
    store = request.app[STORE]
    before: list[ChatMessage] = []
    if req.previous_response_id is not None:
        found = store.get(req.previous_response_id)
        if found is None:
            raise bad_request(f"no stored response {req.previous_response_id!r}",
                              param="previous_response_id")  # fmt: skip
        before = found.conversation
    conversation = before + input_messages(req.input)
    num_inputs = len(conversation) - len(before)
    system = [ChatMessage("system", req.instructions)] if req.instructions else []
    messages = system + conversation
    check_max_tokens(req.max_output_tokens, ctx.limits, "max_output_tokens")
    clamp = req.max_output_tokens is None
    max_new = ctx.config.max_context_len if clamp else req.max_output_tokens
    sampling = sampling_from(req, max_new_tokens=max_new, return_logprob=False,
                             top_logprobs_num=0)  # fmt: skip
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type != "text":  # structured output: the answer is constrained
        regex = constraint_regex(req, fmt, "text")
        sampling = msgspec.structs.replace(sampling, regex=regex)
    sampling = constrain_to_calls(
        sampling, choice, parser, tools, req.parallel_tool_calls, "a text.format"
    )
    ctx.engine.check_available()
    shape = _Shape(req, ctx.config.served_model_name)
    gen = GenerateRequest(shape.id, sampling, messages=messages, stream=req.stream,
                          priority=req.priority, arrival_ns=time.monotonic_ns(),
                          clamp_max_new_tokens=clamp, tools=tools)  # fmt: skip

    def keep(response: dict, text: str, calls: list[dict]) -> None:
        if req.store:
            turn = [{"id": c["call_id"], "type": "function",
                     "function": {"name": c["name"], "arguments": c["arguments"]}}
                    for c in calls]  # fmt: skip
            said = [*conversation, ChatMessage("assistant", text, turn)]
            store.put(Stored(response, said, num_inputs))

    if req.stream:
        return await _stream(request, ctx, gen, shape, keep, parser)
    a = Acc()
    async with generation(ctx, [gen]) as group:
        async for _, d in group:
            a.add(d)
    status, incomplete = _status(a)
    text, found = "".join(a.text), []
    if parser:
        content, found = tool_calls.parse(parser, text)
        text = content or "" if found else text
    calls = shape.calls(found)
    item_status = "completed" if status == "completed" else "incomplete"
    out = ([shape.message(text, item_status)] if text or not calls else []) + calls
    final = shape.response(status, out, _usage(a), incomplete)
    keep(final, text, calls)
    return json_response(final)


def _stored(request: web.Request) -> tuple[str, Stored | None]:
    rid = request.match_info["response_id"]
    return rid, request.app[STORE].get(rid)


@routes.get("/v1/responses/{response_id}")
async def get_response(request: web.Request) -> web.Response:
    rid, found = _stored(request)
    if found is None:
        raise APIError(404, f"no stored response {rid!r}", param="response_id")
    return json_response(found.response)


@routes.get("/v1/responses/{response_id}/input_items")
async def input_items(request: web.Request) -> web.Response:
    """The response's own input as message items, newest first unless `order=asc`."""
    rid, found = _stored(request)
    if found is None:
        raise APIError(404, f"no stored response {rid!r}", param="response_id")
    items = stored_items(rid, found.conversation[-1 - found.num_inputs : -1])
    order = request.query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request(f"order must be asc or desc, got {order!r}", param="order")
    if order == "desc":
        items.reverse()
    return json_response({"object": "list", "data": items, "has_more": False,
                          "first_id": items[0]["id"] if items else None,
                          "last_id": items[-1]["id"] if items else None})  # fmt: skip


@routes.delete("/v1/responses/{response_id}")
async def delete_response(request: web.Request) -> web.Response:
    rid = request.match_info["response_id"]
    if not request.app[STORE].delete(rid):
        raise APIError(404, f"no stored response {rid!r}", param="response_id")
    return json_response({"id": rid, "object": "response.deleted", "deleted": True})


async def _stream(request: web.Request, ctx, gen: GenerateRequest, shape: _Shape, keep,
                  parser: str | None) -> web.StreamResponse:  # fmt: skip
    resp = await open_sse(request)
    seq, said, opened = 0, "", False

    async def send(kind: str, **fields: Any) -> None:
        nonlocal seq
        body = json_encoder.encode({"type": kind, "sequence_number": seq, **fields})
        await resp.write(b"event: " + kind.encode() + b"\ndata: " + body + b"\n\n")
        seq += 1

    item = {"item_id": shape.msg_id, "output_index": 0, "content_index": 0}
    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}

    async def say(text: str) -> None:
        """Content, the message item opened first (with tools, only once there is some)."""
        nonlocal said, opened
        if not opened:
            opened = True
            await send("response.output_item.added", output_index=0,
                       item=shape.message("", "in_progress"))  # fmt: skip
            await send("response.content_part.added", **item, part=part)
        if text:
            said += text
            await send("response.output_text.delta", **item, delta=text, logprobs=[])

    split = tool_calls.Splitter(parser) if parser else None
    a = Acc()
    try:
        await send("response.created", response=shape.response("in_progress", []))
        await send("response.in_progress", response=shape.response("in_progress", []))
        if split is None:
            await say("")
        async with generation(ctx, [gen]) as group:
            async for _, d in group:
                a.add(d)
                text = split.push(d.text) if split else d.text
                if text:
                    await say(text)
    except APIError as e:
        await send("error", code=e.code, message=e.message, param=e.param)
        return resp
    found: list[tool_calls.Call] = []
    if split is not None:
        rest, found = split.finish()
        if rest or not found:
            await say(rest)
    status, incomplete = _status(a)
    output = []
    if opened:
        item_status = "completed" if status == "completed" else "incomplete"
        await send("response.output_text.done", **item, text=said, logprobs=[])
        await send("response.content_part.done", **item, part={**part, "text": said})
        output.append(shape.message(said, item_status))
        await send("response.output_item.done", output_index=0, item=output[0])
    calls = shape.calls(found)
    for call in calls:
        at = {"item_id": call["id"], "output_index": len(output)}
        await send("response.output_item.added", output_index=len(output),
                   item={**call, "arguments": "", "status": "in_progress"})  # fmt: skip
        await send("response.function_call_arguments.delta", **at, delta=call["arguments"])
        await send("response.function_call_arguments.done", **at, arguments=call["arguments"])
        await send("response.output_item.done", output_index=len(output), item=call)
        output.append(call)
    response = shape.response(status, output, _usage(a), incomplete)
    keep(response, said, calls)
    await send(_FINAL_EVENT.get(status, "response.failed"), response=response)
    return resp
