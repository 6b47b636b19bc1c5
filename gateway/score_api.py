"""SGLang's /v1/score: how likely each of a few label tokens is to come next after a
query joined with each item (classification, reranking, yes/no judges).

Input: `query` (text or token ids), `items` (one or a list, of the query's kind: texts,
or lists of token ids), `label_token_ids`, `apply_softmax` (False: each label's
probability under the whole vocabulary; True: renormalized over the labels alone),
`item_first` (item before query), `model`. Output: `{"scores": [[p per label, in the
order given] per item], "model", "usage", "object": "scoring"}`.

Theory of operation: each item becomes one greedy engine request of query + item
(texts joined as they are, id lists concatenated) that samples one token with
`token_ids_logprob` = the labels, so the labels' raw logprobs at the position after
the prompt come back in that token's top-logprob list (native_api.py). The requests
run together and share the query's KV through the prefix cache.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
from aiohttp import web

from shunter.bus.messages import GenerateRequest, SamplingParams
from shunter.gateway.app import ctx_of, generation, json_response, read_body
from shunter.gateway.engine import new_id
from shunter.gateway.errors import APIError, bad_request
from shunter.gateway.formats import Acc
from shunter.gateway.schemas import decode_body
from shunter.gateway.validation import check_logprob_ids, check_model, is_token_ids

routes = web.RouteTableDef()


class ScoreBody(msgspec.Struct, kw_only=True):
    query: str | list[Any] | None = None
    items: str | list[Any] | None = None
    label_token_ids: list[Any] | None = None
    apply_softmax: bool = False
    item_first: bool = False
    model: str | None = None


def _prompts(body: ScoreBody) -> list[str | list[int]]:
    """query joined with each item, in the order item_first asks for."""
    if body.query is None or body.items is None:
        missing = "query" if body.query is None else "items"
        raise bad_request("give both query and items", param=missing)
    items = [body.items] if isinstance(body.items, str) else body.items
    if not items:
        raise bad_request("items must not be empty", param="items")
    if isinstance(body.query, str):
        if not all(isinstance(it, str) for it in items):
            raise bad_request("a text query takes text items", param="items")
    elif not is_token_ids(body.query) or not all(is_token_ids(it) for it in items):
        raise bad_request("a token-id query takes items that are lists of token ids (>= 0)",
                          param="items")  # fmt: skip
    pairs = [(it, body.query) if body.item_first else (body.query, it) for it in items]
    return [a + b for a, b in pairs]


def _scores(a: Acc, softmax: bool) -> list[float]:
    """One item's label probabilities from its request's output (its one token's list)."""
    if not a.top_logprobs:  # ended before its token, as an abort ends it
        raise APIError(503, "a scoring request ended before it was scored; retry")
    logprobs = [x.logprob for x in a.top_logprobs[0]]
    if not softmax:
        return [math.exp(lp) for lp in logprobs]
    top = max(logprobs)
    weights = [math.exp(lp - top) for lp in logprobs]
    total = sum(weights)
    return [w / total for w in weights]


@routes.post("/v1/score")
async def score(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    body = decode_body(await read_body(request), ScoreBody)
    check_model(body.model, ctx.config.served_model_name)
    prompts = _prompts(body)
    labels = check_logprob_ids(body.label_token_ids, "label_token_ids")
    if len(prompts) > ctx.limits.max_prompts:
        raise bad_request(f"at most {ctx.limits.max_prompts} items per request", param="items")
    sampling = SamplingParams(max_new_tokens=1, temperature=0.0, return_logprob=True,
                              token_ids_logprob=labels, seed=0)  # fmt: skip
    rid = new_id()
    gens = [
        GenerateRequest(
            f"score-{rid}-{k}",
            sampling,
            text=p if isinstance(p, str) else None,
            input_ids=p if isinstance(p, list) else None,
        )
        for k, p in enumerate(prompts)
    ]
    ctx.engine.check_available()
    accs = [Acc() for _ in gens]
    async with generation(ctx, gens) as group:
        async for k, d in group:
            accs[k].add(d)
    scores = [_scores(a, body.apply_softmax) for a in accs]
    prompt_tokens = sum(a.last.num_prompt_tokens for a in accs if a.last)
    return json_response({
        "scores": scores,
        "model": ctx.config.served_model_name,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 0,
                  "total_tokens": prompt_tokens},
        "object": "scoring",
    })  # fmt: skip
