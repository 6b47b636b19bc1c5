"""OpenAI-compatible endpoints: /v1/completions, /v1/models, /v1/tokenize,
/v1/detokenize, and what /v1/chat/completions (chat_api.py) shares with them.

`n` and prompt lists expand into one engine request per choice, with ids `<id>-<k>`
(k = prompt_index * n + choice); choice k gets seed `seed + k` when a seed is given, a
fresh one otherwise. Streams are SSE `data: {json}\\n\\n` chunks ending in
`data: [DONE]\\n\\n`; an error after the stream has started arrives as
`data: {"error": {...}}` before [DONE]. Usage counts each prompt once and reports
`prompt_tokens_details.cached_tokens`.

Tokenize/detokenize go to the tokenizer actor over the bus (request/reply), so the
gateway holds no tokenizer of its own and stays free of model files.
"""

from __future__ import annotations

import math
import time
from typing import Any

import msgspec
from aiohttp import web

from shunter.bus.messages import (
    DetokenizeQuery,
    GenerateRequest,
    SamplingParams,
    TokenizeQuery,
)
from shunter.gateway.app import (
    Ctx,
    ctx_of,
    generation,
    json_response,
    open_sse,
    read_body,
    sse_done,
    sse_send,
)
from shunter.gateway.engine import draw_seed, new_id
from shunter.gateway.errors import APIError, bad_request
from shunter.gateway.formats import Acc, completion_logprobs, usage
from shunter.gateway.schemas import CompletionRequest, TokenId, decode_body
from shunter.gateway.validation import (
    chat_messages,
    check_max_tokens,
    check_model,
    check_n,
    completion_prompts,
    generation_prompt,
    sampling_from,
)

routes = web.RouteTableDef()


def seeded(sampling: SamplingParams, k: int) -> SamplingParams:
    """Choice k's sampling: seed + k when a seed was given, a fresh one otherwise."""
    seed = draw_seed() if sampling.seed is None else sampling.seed + k
    return msgspec.structs.replace(sampling, seed=seed)


def expand_ids(base_id: str, num: int) -> list[str]:
    """The engine request ids of `num` choices (the module docstring)."""
    return [base_id] if num == 1 else [f"{base_id}-{k}" for k in range(num)]


async def error_event(resp: web.StreamResponse, e: APIError) -> None:
    """An error after the stream started: its body as an event, then [DONE]."""
    await sse_send(resp, e.body())
    await sse_done(resp)


async def end_stream(resp: web.StreamResponse, req, head: dict, accs) -> web.StreamResponse:
    """The usage chunk (when asked for), then [DONE]."""
    if req.stream_options and req.stream_options.include_usage:
        await sse_send(resp, {**head, "choices": [], "usage": usage(accs, req.n)})
    await sse_done(resp)
    return resp


# -- /v1/completions ------------------------------------------------------------------------


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    ctx = ctx_of(request)
    req = decode_body(await read_body(request), CompletionRequest)
    check_model(req.model, ctx.config.served_model_name)
    check_n(req.n, ctx.limits)
    width = req.n if req.best_of is None else req.best_of  # candidates per prompt
    if width < req.n:
        raise bad_request(f"best_of ({width}) must be at least n ({req.n})", param="best_of")
    if width > req.n and req.stream:
        raise bad_request("best_of cannot be used with stream", param="best_of")
    if req.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    prompts = completion_prompts(req.prompt, ctx.limits)
    check_max_tokens(req.max_tokens, ctx.limits, "max_tokens", minimum=0 if req.echo else 1)
    lp = req.logprobs
    if lp is not None and not 0 <= lp <= ctx.limits.max_top_logprobs:
        raise bad_request(
            f"logprobs must be in [0, {ctx.limits.max_top_logprobs}]", param="logprobs"
        )
    clamp = req.max_tokens is None
    max_new = ctx.config.max_context_len if clamp else req.max_tokens
    sampling = sampling_from(  # best_of ranks candidates by their logprobs
        req, max_new_tokens=max_new, return_logprob=lp is not None or width > req.n,
        top_logprobs_num=lp or 0,
    )  # fmt: skip
    prompt_lps = req.echo and lp is not None
    if prompt_lps:  # echo with logprobs scores the prompt too (from position 0)
        sampling = msgspec.structs.replace(sampling, logprob_start_len=0)
    ctx.engine.check_available()
    echo_texts: list[str] = []
    if req.echo:
        for p in prompts:
            if isinstance(p, str):
                echo_texts.append(p)
            else:
                reply = await ctx.engine.detokenize(DetokenizeQuery(new_id("q-"), p))
                echo_texts.append(reply.text)
    base_id = req.rid or new_id("cmpl-")
    num = len(prompts) * width
    if num > ctx.limits.max_prompts:
        raise bad_request(
            f"{len(prompts)} prompts x {'best_of' if width > req.n else 'n'}={width} is {num} "
            f"choices; at most {ctx.limits.max_prompts} per request",
            param="best_of" if width > req.n else "n",
        )
    now_ns = time.monotonic_ns()
    gens = [
        GenerateRequest(
            rid, seeded(sampling, k),
            text=p if isinstance(p, str) else None,
            input_ids=p if isinstance(p, list) else None,
            stream=req.stream, priority=req.priority, arrival_ns=now_ns,
            clamp_max_new_tokens=clamp,
        )
        for k, rid in enumerate(expand_ids(base_id, num))
        for p in [prompts[k // width]]
    ]  # fmt: skip
    head = {"id": base_id, "object": "text_completion", "created": int(time.time()),
            "model": ctx.config.served_model_name}  # fmt: skip
    echo_of = (lambda k: echo_texts[k // req.n]) if req.echo else (lambda k: "")
    if req.stream:
        return await _stream_completions(request, ctx, req, gens, head, echo_of, lp, prompt_lps)
    accs = [Acc() for _ in gens]
    async with generation(ctx, gens) as group:
        async for k, d in group:
            accs[k].add(d)
    picked = _best(accs, width, req.n)
    choices = []
    for k, a in enumerate(picked):
        echo = echo_of(k)
        logprobs = None
        if prompt_lps:
            entries = a.prompt_entries(0)
            logprobs = completion_logprobs(
                [t for _, _, t, _ in entries] + a.token_texts,
                [x for x, _, _, _ in entries] + a.logprobs,
                _echo_tops(entries, a.top_logprobs, lp),
                0,
            )
        elif lp is not None:
            logprobs = completion_logprobs(a.token_texts, a.logprobs, a.top_logprobs, len(echo))
        choices.append({
            "index": k, "text": echo + "".join(a.text), "logprobs": logprobs,
            "finish_reason": a.last.finish_reason if a.last else None,
            "matched_stop": a.last.matched_stop if a.last else None,
        })  # fmt: skip
    return json_response({**head, "choices": choices, "usage": usage(accs, width)})


def _best(accs: list[Acc], width: int, n: int) -> list[Acc]:
    """Per prompt, the n of its `width` candidates with the highest mean logprob per
    token (best_of; all of them, in order, when width == n)."""
    if width == n:
        return accs
    out = []
    for i in range(0, len(accs), width):
        group = accs[i : i + width]
        mean = [sum(a.logprobs) / len(a.logprobs) if a.logprobs else -math.inf for a in group]
        order = sorted(range(width), key=lambda j: -mean[j])  # stable: earlier wins ties
        out += [group[j] for j in order[:n]]
    return out


def _echo_tops(entries: list, tops: list[list], num_top: int | None) -> list[list]:
    """The top_logprobs rows of an echoed prompt's entries followed by the output's
    (an empty row stands for null: the first prompt token has none)."""
    if not num_top:
        return []
    return [top for *_, top in entries] + tops


async def _stream_completions(
    request, ctx: Ctx, req, gens, head, echo_of, lp, prompt_lps
) -> web.StreamResponse:
    accs = [Acc() for _ in gens]
    sent_echo = [False] * len(gens)
    sent_chars = [0] * len(gens)  # text sent so far per choice: where text_offset goes on
    resp = await open_sse(request)
    try:
        async with generation(ctx, gens) as group:
            async for k, d in group:
                accs[k].add(d)
                if not d.text and d.finish_reason is None and not d.token_ids:
                    continue  # prompt-only progress (prompt logprobs), or held-back text
                text, tokens, lps, tops = d.text, d.token_texts, d.logprobs, d.top_logprobs
                if not sent_echo[k]:  # the first chunk carries the prompt
                    sent_echo[k] = True
                    text = echo_of(k) + text
                    if prompt_lps:
                        entries = accs[k].prompt_entries(0)
                        tokens = [t for _, _, t, _ in entries] + tokens
                        lps = [x for x, _, _, _ in entries] + lps
                        tops = _echo_tops(entries, tops, lp)
                logprobs = None
                if lp is not None:
                    logprobs = completion_logprobs(tokens, lps, tops, sent_chars[k])
                sent_chars[k] += len(text)
                choice = {"index": k, "text": text, "logprobs": logprobs,
                          "finish_reason": d.finish_reason, "matched_stop": d.matched_stop}  # fmt: skip
                await sse_send(resp, {**head, "choices": [choice], "usage": None})
    except APIError as e:
        await error_event(resp, e)
        return resp
    return await end_stream(resp, req, head, accs)


# -- models, tokenize, detokenize -----------------------------------------------------------


def _model_card(ctx: Ctx) -> dict:
    return {
        "id": ctx.config.served_model_name, "object": "model",
        "created": int(ctx.started_wall_s), "owned_by": "shunter",
        "root": ctx.config.model_path or ctx.config.served_model_name,
        "max_model_len": ctx.config.max_context_len,
    }  # fmt: skip


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    return json_response({"object": "list", "data": [_model_card(ctx_of(request))]})


@routes.get("/v1/models/{model_id:.+}")
async def get_model(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    check_model(request.match_info["model_id"], ctx.config.served_model_name)
    return json_response(_model_card(ctx))


class TokenizeBody(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    text: str | None = None
    messages: list = []
    add_special_tokens: bool = True
    add_generation_prompt: bool | None = None  # None: true unless continue_final_message
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeBody(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[TokenId]
    skip_special_tokens: bool = False


@routes.post("/v1/tokenize")
async def tokenize(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    body = decode_body(await read_body(request), TokenizeBody)
    check_model(body.model, ctx.config.served_model_name)
    text = body.prompt if body.prompt is not None else body.text
    if (text is None) == (not body.messages):
        raise bad_request("give exactly one of prompt or messages", param="prompt")
    messages = None
    if body.messages:
        from shunter.gateway.schemas import ChatMessageIn

        try:
            parsed = msgspec.convert(body.messages, list[ChatMessageIn])
        except msgspec.ValidationError as e:
            raise bad_request(f"invalid messages: {e}", param="messages") from None
        messages = chat_messages(parsed)
    add_gen = generation_prompt(body.add_generation_prompt, body.continue_final_message)
    reply = await ctx.engine.tokenize(
        TokenizeQuery(
            new_id("q-"), text, messages, body.add_special_tokens, add_gen,
            body.continue_final_message, body.chat_template_kwargs or {},
        )
    )  # fmt: skip
    return json_response(
        {"tokens": reply.tokens, "count": len(reply.tokens), "max_model_len": reply.max_model_len}
    )


@routes.post("/v1/detokenize")
async def detokenize(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    body = decode_body(await read_body(request), DetokenizeBody)
    check_model(body.model, ctx.config.served_model_name)
    reply = await ctx.engine.detokenize(
        DetokenizeQuery(new_id("q-"), body.tokens, body.skip_special_tokens)
    )
    return json_response({"text": reply.text})
