"""OpenAI's Responses API: POST /v1/responses; GET and DELETE /v1/responses/{id}.

Input: `input` (a string, or a list of message items: `role` and `content` as a string
or `input_text` / `output_text` parts), `instructions` (a system message ahead of
them), `max_output_tokens`, `temperature`, `top_p`, `stream`, `metadata`, `user`, and
the sampling extensions the chat endpoint takes (`top_k`, `seed`, `stop`, ...). The
answer is a `response` object whose `output` is one assistant message of one
`output_text` part; `status` is "completed", "incomplete" (`incomplete_details.reason`
"max_output_tokens") or "cancelled" (aborted). Streamed, it is OpenAI's event sequence:
response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta per delta, then the matching
.done events and response.completed (or response.incomplete), each with a
sequence_number; a failure after the start is an `error` event.

With `store` (the default) a finished response is kept in the gateway's memory, the
latest MAX_STORED of them: GET returns it (and /input_items its own input), DELETE
forgets it, and
`previous_response_id` continues its conversation (its input and output ahead of the
new input; its instructions are not carried over, as OpenAI does). An unknown id is a
404 (GET, DELETE) or a 400 (`previous_response_id`). Tools, structured text formats,
reasoning options, background mode and `n` are 400s.

Theory of operation: the input becomes the messages of one chat generation
(openai_api.py's path through the chat template); the handler shapes its deltas. The
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
from shunter.gateway.validation import (
    I64,
    ChatMessageIn,
    ContentPart,
    SamplingFields,
    chat_messages,
    check_max_tokens,
    check_model,
    decode_body,
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


class TextFormat(msgspec.Struct):
    type: str


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


def _refuse_unsupported(req: ResponsesRequest) -> None:
    def refuse(param: str, what: str) -> None:
        raise bad_request(f"{what} is not supported by this server", param=param)

    if req.tools:
        refuse("tools", "tools")
    if req.tool_choice not in (None, "none", "auto"):
        refuse("tool_choice", "tool_choice")
    if req.text is not None and req.text.format is not None and req.text.format.type != "text":
        refuse("text", f"text format {req.text.format.type!r} (only 'text')")
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


TEXT_PARTS = ("input_text", "output_text")


def _parts(i: int, content: Any) -> str | list[ContentPart]:
    """An input item's content: a string, or its text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"input[{i}].content must be a string or a list of parts",
                          param=f"input[{i}].content")  # fmt: skip
    parts = []
    for p in content:
        kind = p.get("type") if isinstance(p, dict) else type(p).__name__
        if kind not in TEXT_PARTS:
            raise bad_request(f"input[{i}].content: only text parts are supported, got {kind!r}",
                              param=f"input[{i}].content")  # fmt: skip
        text = p.get("text")
        if not isinstance(text, str):
            raise bad_request(f"input[{i}].content: a text part needs its text as a string",
                              param=f"input[{i}].content")  # fmt: skip
        parts.append(ContentPart("text", text))
    return parts


def _messages(req: ResponsesRequest, before: list[ChatMessage]) -> list[ChatMessage]:
    """The input as chat messages, after `before` (a stored conversation)."""
    if isinstance(req.input, str):
        items = [ChatMessageIn("user", req.input)]
    else:
        if not req.input:
            raise bad_request("input must not be empty", param="input")
        items = []
        for i, item in enumerate(req.input):
            if not isinstance(item, dict) or item.get("type", "message") != "message":
                kind = item.get("type") if isinstance(item, dict) else type(item).__name__
                raise bad_request(f"input[{i}]: only message items are supported, got {kind!r}",
                                  param=f"input[{i}]")  # fmt: skip
            items.append(ChatMessageIn(str(item.get("role", "")), _parts(i, item.get("content"))))
    return before + chat_messages(items)


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
            "parallel_tool_calls": False, "tool_choice": "none", "tools": [],
            "text": {"format": {"type": "text"}}, "truncation": "disabled",
            "previous_response_id": r.previous_response_id, "reasoning": None,
            "background": False,
        }  # fmt: skip


@routes.post("/v1/responses")
async def responses(request: web.Request) -> web.StreamResponse:
    ctx = ctx_of(request)
    req = decode_body(await read_body(request), ResponsesRequest)
    check_model(req.model, ctx.config.served_model_name)
    _refuse_unsupported(req)
    store = request.app[STORE]
    before: list[ChatMessage] = []
    if req.previous_response_id is not None:
        found = store.get(req.previous_response_id)
        if found is None:
            raise bad_request(f"no stored response {req.previous_response_id!r}",
                              param="previous_response_id")  # fmt: skip
        before = found.conversation
    conversation = _messages(req, before)
    num_inputs = len(conversation) - len(before)
    system = [ChatMessage("system", req.instructions)] if req.instructions else []
    messages = system + conversation
    check_max_tokens(req.max_output_tokens, ctx.limits, "max_output_tokens")
    clamp = req.max_output_tokens is None
    max_new = ctx.config.max_context_len if clamp else req.max_output_tokens
    sampling = sampling_from(req, max_new_tokens=max_new, return_logprob=False,
                             top_logprobs_num=0)  # fmt: skip
    ctx.engine.check_available()
    shape = _Shape(req, ctx.config.served_model_name)
    gen = GenerateRequest(shape.id, sampling, messages=messages, stream=req.stream,
                          priority=req.priority, arrival_ns=time.monotonic_ns(),
                          clamp_max_new_tokens=clamp)  # fmt: skip

    def keep(response: dict, text: str) -> None:
        if req.store:
            said = [*conversation, ChatMessage("assistant", text)]
            store.put(Stored(response, said, num_inputs))

    if req.stream:
        return await _stream(request, ctx, gen, shape, keep)
    a = Acc()
    async with generation(ctx, [gen]) as group:
        async for _, d in group:
            a.add(d)
    status, incomplete = _status(a)
    text = "".join(a.text)
    out = [shape.message(text, "completed" if status == "completed" else "incomplete")]
    final = shape.response(status, out, _usage(a), incomplete)
    keep(final, text)
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
    own = found.conversation[-1 - found.num_inputs : -1]
    items = [{"id": f"{rid}_in{i}", "type": "message", "role": m.role,
              "content": [{"type": "input_text", "text": m.content}]}
             for i, m in enumerate(own)]  # fmt: skip
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


async def _stream(request: web.Request, ctx, gen: GenerateRequest, shape: _Shape,
                  keep) -> web.StreamResponse:  # fmt: skip
    resp = await open_sse(request)
    seq = 0

    async def send(kind: str, **fields: Any) -> None:
        nonlocal seq
        body = json_encoder.encode({"type": kind, "sequence_number": seq, **fields})
        await resp.write(b"event: " + kind.encode() + b"\ndata: " + body + b"\n\n")
        seq += 1

    item = {"item_id": shape.msg_id, "output_index": 0, "content_index": 0}
    a = Acc()
    try:
        await send("response.created", response=shape.response("in_progress", []))
        await send("response.in_progress", response=shape.response("in_progress", []))
        await send("response.output_item.added", output_index=0,
                   item=shape.message("", "in_progress"))  # fmt: skip
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        await send("response.content_part.added", **item, part=part)
        async with generation(ctx, [gen]) as group:
            async for _, d in group:
                a.add(d)
                if d.text:
                    await send("response.output_text.delta", **item, delta=d.text, logprobs=[])
    except APIError as e:
        await send("error", code=e.code, message=e.message, param=e.param)
        return resp
    text = "".join(a.text)
    status, incomplete = _status(a)
    item_status = "completed" if status == "completed" else "incomplete"
    await send("response.output_text.done", **item, text=text, logprobs=[])
    await send("response.content_part.done", **item, part={**part, "text": text})
    final = shape.message(text, item_status)
    await send("response.output_item.done", output_index=0, item=final)
    kind = _FINAL_EVENT.get(status, "response.failed")
    response = shape.response(status, [final], _usage(a), incomplete)
    keep(response, text)
    await send(kind, response=response)
    return resp
