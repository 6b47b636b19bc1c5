"""OpenAI's /v1/chat/completions: messages through the chat template (tools, assistant
`tool_calls` and tool turns included), choices and streams as openai_api.py's module
docstring describes them, and an answer that is a tool call (`--tool-call-parser`)
returned as `message.tool_calls`, streamed as `delta.tool_calls` once whole.
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from shunter.bus.messages import ChatMessage, GenerateRequest
from shunter.gateway import tool_calls
from shunter.gateway.app import (
    Ctx,
    ctx_of,
    generation,
    json_response,
    open_sse,
    read_body,
    sse_send,
)
from shunter.gateway.engine import new_id
from shunter.gateway.errors import APIError, bad_request
from shunter.gateway.formats import Acc, chat_logprobs, usage
from shunter.gateway.openai_api import end_stream, error_event, expand_ids, seeded
from shunter.gateway.schemas import ChatCompletionRequest, decode_body
from shunter.gateway.tool_choice import check_tools, constrain_to_calls, tool_parser
from shunter.gateway.validation import (
    chat_messages,
    check_max_tokens,
    check_model,
    check_n,
    generation_prompt,
    sampling_from,
)

routes = web.RouteTableDef()


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    ctx = ctx_of(request)
    req = decode_body(await read_body(request), ChatCompletionRequest)
    check_model(req.model, ctx.config.served_model_name)
    check_n(req.n, ctx.limits)
    messages: list[ChatMessage] = chat_messages(req.messages)
    add_gen = generation_prompt(req.add_generation_prompt, req.continue_final_message)
    parser = tool_parser(req.tools, req.tool_choice, ctx.config.tool_call_parser, forced_ok=True)
    tools = check_tools(req.tools or []) if parser else []
    max_tokens = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    check_max_tokens(max_tokens, ctx.limits, param)
    num_top = req.top_logprobs or 0
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs needs logprobs to be true", param="top_logprobs")
        if not 0 <= num_top <= ctx.limits.max_top_logprobs:
            raise bad_request(f"top_logprobs must be in [0, {ctx.limits.max_top_logprobs}]",
                              param="top_logprobs")  # fmt: skip
    clamp = max_tokens is None
    sampling = sampling_from(
        req,
        max_new_tokens=ctx.config.max_context_len if clamp else max_tokens,
        return_logprob=req.logprobs,
        top_logprobs_num=num_top,
    )
    sampling = constrain_to_calls(
        sampling,
        req.tool_choice,
        parser,
        tools,
        req.parallel_tool_calls,
        "regex, json_schema or response_format",
    )
    ctx.engine.check_available()
    base_id = req.rid or new_id("chatcmpl-")
    now_ns = time.monotonic_ns()
    gens = [
        GenerateRequest(
            rid, seeded(sampling, k), messages=messages, stream=req.stream,
            priority=req.priority, arrival_ns=now_ns, clamp_max_new_tokens=clamp,
            add_generation_prompt=add_gen, continue_final_message=req.continue_final_message,
            chat_template_kwargs=req.chat_template_kwargs or {},
            tools=tools,
        )
        for k, rid in enumerate(expand_ids(base_id, req.n))
    ]  # fmt: skip
    created = int(time.time())
    model = ctx.config.served_model_name
    if req.stream:
        head = {
            "id": base_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
        }
        return await _stream_chat(request, ctx, req, gens, head, num_top, parser)
    accs = [Acc() for _ in gens]
    async with generation(ctx, gens) as group:
        async for k, d in group:
            accs[k].add(d)
    choices = []
    for k, a in enumerate(accs):
        logprobs = None
        if req.logprobs:
            logprobs = chat_logprobs(a.token_texts, a.logprobs, a.top_logprobs, num_top)
        message: dict[str, Any] = {"role": "assistant", "content": "".join(a.text)}
        finish = a.last.finish_reason if a.last else None
        if parser:
            content, calls = tool_calls.parse(parser, message["content"])
            if calls:
                ids = [new_id("call_") for _ in calls]
                message = {"role": "assistant", "content": content,
                           "tool_calls": tool_calls.openai_calls(calls, ids)}  # fmt: skip
                finish = "tool_calls"
        choices.append({
            "index": k, "message": message, "logprobs": logprobs, "finish_reason": finish,
            "matched_stop": a.last.matched_stop if a.last else None,
        })  # fmt: skip
    return json_response({
        "id": base_id, "object": "chat.completion", "created": created, "model": model,
        "choices": choices, "usage": usage(accs, req.n),
    })  # fmt: skip


async def _stream_chat(request, ctx: Ctx, req, gens, head, num_top,
                       parser: str | None) -> web.StreamResponse:  # fmt: skip
    accs = [Acc() for _ in gens]
    splitters = [tool_calls.Splitter(parser) if parser else None for _ in gens]
    resp = await open_sse(request)
    try:
        async with generation(ctx, gens) as group:
            for k in range(len(gens)):
                choice = {"index": k, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}  # fmt: skip
                await sse_send(resp, {**head, "choices": [choice], "usage": None})
            async for k, d in group:
                accs[k].add(d)
                split = splitters[k]
                text = split.push(d.text) if split else d.text
                if text or d.logprobs:
                    logprobs = None
                    if req.logprobs:
                        logprobs = chat_logprobs(d.token_texts, d.logprobs, d.top_logprobs, num_top)
                    choice = {"index": k, "delta": {"content": text}, "logprobs": logprobs,
                              "finish_reason": None}  # fmt: skip
                    await sse_send(resp, {**head, "choices": [choice], "usage": None})
                if d.finish_reason is not None:
                    finish = d.finish_reason
                    if split is not None:
                        finish = await _send_calls(resp, head, k, split) or finish
                    choice = {"index": k, "delta": {}, "logprobs": None,
                              "finish_reason": finish, "matched_stop": d.matched_stop}  # fmt: skip
                    await sse_send(resp, {**head, "choices": [choice], "usage": None})
    except APIError as e:
        await error_event(resp, e)
        return resp
    return await end_stream(resp, req, head, accs)


async def _send_calls(resp, head: dict, k: int, split: tool_calls.Splitter) -> str | None:
    """A streamed choice's held text and tool calls at its end; "tool_calls" when any."""
    rest, calls = split.finish()
    if rest:
        choice = {"index": k, "delta": {"content": rest}, "logprobs": None, "finish_reason": None}
        await sse_send(resp, {**head, "choices": [choice], "usage": None})
    ids = [new_id("call_") for _ in calls]
    for i, call in enumerate(tool_calls.openai_calls(calls, ids)):
        choice = {"index": k, "delta": {"tool_calls": [{"index": i, **call}]}, "logprobs": None,
                  "finish_reason": None}  # fmt: skip
        await sse_send(resp, {**head, "choices": [choice], "usage": None})
    return "tool_calls" if calls else None
