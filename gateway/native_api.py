"""SGLang's native /generate.

Input: `text` (a string or a batch of strings) or `input_ids` (a list of ids or a batch
of lists), `sampling_params` (one dict for all, or one per input), `stream`,
`return_logprob`, `logprob_start_len`, `top_logprobs_num`, `token_ids_logprob` (token
ids whose logprobs every reported position also gives: one list, or one per input),
`rid` (one, or one per input), `priority`. `sampling_params.n` > 1 expands an input
into n requests.

Output per request: `{"text", "output_ids", "meta_info": {"id", "finish_reason",
"prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency", ...logprobs}}`;
a batch (or n > 1) answers a list. `finish_reason` is None while running, then
`{"type": "stop", "matched": str | int}`, `{"type": "length", "length": n}` or
`{"type": "abort"}`. Logprob entries are `[logprob, token_id, text]` (text only with
`return_text_in_logprobs`, as in SGLang). With `return_logprob`, `token_ids_logprob`
adds `output_token_ids_logprobs` (and `input_token_ids_logprobs` from
`logprob_start_len`): per position, one entry per asked id, in the order asked. On the
bus they ride in each position's top-logprob list, after its top tokens.

Streaming sends `data: {...}\\n\\n` per delta with *cumulative* text and output_ids (as
SGLang does by default; with --incremental-streaming-output only what is new: text,
output_ids and the logprob lists), plus "index" in a batch, then `data: [DONE]\\n\\n`.
"""

from __future__ import annotations

import time

import msgspec
from aiohttp import web

from shunter.bus.messages import GenerateRequest, TextDelta
from shunter.gateway.app import (
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
from shunter.gateway.formats import Acc
from shunter.gateway.schemas import GenerateBody, NativeSamplingParams, decode_body
from shunter.gateway.validation import check_logprob_ids, check_max_tokens, check_n, sampling_from

routes = web.RouteTableDef()


def _inputs(body: GenerateBody) -> tuple[list[str | list[int]], bool]:
    """(one entry per input, whether the request is a batch)."""
    if (body.text is None) == (body.input_ids is None):
        raise bad_request("give exactly one of text or input_ids", param="text")
    if body.text is not None:
        if isinstance(body.text, str):
            return [body.text], False
        if not body.text:
            raise bad_request("text must not be an empty list", param="text")
        return list(body.text), True
    ids = body.input_ids
    assert ids is not None
    if not ids:
        raise bad_request("input_ids must not be empty", param="input_ids")

    def is_id(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**31

    if all(is_id(x) for x in ids):
        return [list(ids)], False
    if all(isinstance(x, list) and x and all(is_id(i) for i in x) for x in ids):
        return [list(x) for x in ids], True
    raise bad_request(
        "input_ids must be a non-empty list of token ids (in [0, 2^31)) or a list of such lists",
        param="input_ids",
    )


def finish_reason_of(d: TextDelta | None) -> dict | None:
    if d is None or d.finish_reason is None:
        return None
    if d.finish_reason == "length":
        return {"type": "length", "length": d.num_completion_tokens}
    if d.finish_reason == "stop":
        return {"type": "stop", "matched": d.matched_stop}
    return {"type": d.finish_reason}


def _asked_ids(body: GenerateBody, num_inputs: int) -> list[list[int]]:
    """token_ids_logprob as one id list per input (a flat list applies to each)."""
    raw = body.token_ids_logprob
    if not raw:
        return [[]] * num_inputs
    lists = raw if all(isinstance(x, list) for x in raw) else [raw] * num_inputs
    if len(lists) != num_inputs:
        raise bad_request(f"token_ids_logprob has {len(lists)} lists for {num_inputs} inputs",
                          param="token_ids_logprob")  # fmt: skip
    return [check_logprob_ids(ids, "token_ids_logprob") for ids in lists]


def _split(row: list, num_asked: int) -> tuple[list, list]:
    """A position's logprob list as (its top tokens, the asked ids): the ids come last."""
    cut = len(row) - num_asked
    return row[:cut], row[cut:]


def _entries(row: list, with_text: bool) -> list:
    return [[x.logprob, x.token_id, x.text if with_text else None] for x in row]


def _meta(rid: str, a: Acc, start_s: float, body: GenerateBody, start_len: int,
          asked: list[int]) -> dict:  # fmt: skip
    d = a.last
    meta = {
        "id": rid,
        "finish_reason": finish_reason_of(d),
        "prompt_tokens": d.num_prompt_tokens if d else 0,
        "completion_tokens": d.num_completion_tokens if d else 0,
        "cached_tokens": d.num_cached_tokens if d else 0,
        "e2e_latency": time.monotonic() - start_s,
    }
    if body.return_logprob:
        texts = a.token_texts if body.return_text_in_logprobs else [None] * len(a.token_ids)
        meta["output_token_logprobs"] = [
            [lp, tid, t] for lp, tid, t in zip(a.logprobs, a.token_ids, texts)
        ]
        k, with_text = body.top_logprobs_num, body.return_text_in_logprobs
        n = len(asked)
        meta["output_top_logprobs"] = (
            [_entries(_split(row, n)[0], with_text) for row in a.top_logprobs] if k > 0 else []
        )
        if asked:
            meta["output_token_ids_logprobs"] = [_entries(_split(row, n)[1], with_text)
                                                 for row in a.top_logprobs]  # fmt: skip
        if start_len >= 0 and a.prompt_ids:
            entries = a.prompt_entries(start_len)
            meta["input_token_logprobs"] = [
                [lp, tid, t if with_text else None] for lp, tid, t, _ in entries
            ]
            if k > 0:
                meta["input_top_logprobs"] = [_entries(_split(row, n)[0], with_text) if lp is not None
                                              else None for lp, _, _, row in entries]  # fmt: skip
            if asked:
                meta["input_token_ids_logprobs"] = [_entries(_split(row, n)[1], with_text) if lp is not None
                                                    else None for lp, _, _, row in entries]  # fmt: skip
    return meta


_OUTPUT_LISTS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")
_INPUT_LISTS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")


def _since(out: dict, a: Acc, sent: tuple[int, int, int]) -> tuple[dict, tuple[int, int, int]]:
    """A streamed item cut to what the client has not been sent yet
    (--incremental-streaming-output), and the new sent counts."""
    t0, i0, p0 = sent
    meta = out["meta_info"]
    out["text"] = "".join(a.text[t0:])
    out["output_ids"] = out["output_ids"][i0:]
    for key in _OUTPUT_LISTS:
        if key in meta:
            meta[key] = meta[key][i0:]
    num_prompt = len(meta.get("input_token_logprobs", ()))
    for key in _INPUT_LISTS:
        if key in meta:
            meta[key] = meta[key][p0:]
    return out, (len(a.text), len(a.token_ids), max(p0, num_prompt))


@routes.post("/generate")
async def generate(request: web.Request) -> web.StreamResponse:
    ctx = ctx_of(request)
    body = decode_body(await read_body(request), GenerateBody)
    inputs, batch = _inputs(body)
    if len(inputs) > ctx.limits.max_prompts:
        raise bad_request(f"at most {ctx.limits.max_prompts} inputs per request", param="text")
    sps = body.sampling_params
    if isinstance(sps, list):
        if len(sps) != len(inputs):
            raise bad_request(
                f"sampling_params has {len(sps)} entries for {len(inputs)} inputs",
                param="sampling_params",
            )
    else:
        sps = [sps or NativeSamplingParams()] * len(inputs)
    rids = body.rid
    if isinstance(rids, list):
        if len(rids) != len(inputs) or not all(rids):
            raise bad_request("rid needs one non-empty id per input", param="rid")
    else:
        if rids is not None and (batch or not rids):
            raise bad_request("rid must be one non-empty id per input", param="rid")
        rids = [rids or new_id()] if not batch else [new_id() for _ in inputs]
    if body.top_logprobs_num < 0 or body.top_logprobs_num > ctx.limits.max_top_logprobs:
        raise bad_request(
            f"top_logprobs_num must be in [0, {ctx.limits.max_top_logprobs}]",
            param="top_logprobs_num",
        )
    if body.logprob_start_len < -1:
        raise bad_request("logprob_start_len must be >= -1", param="logprob_start_len")
    want_lp = body.return_logprob or body.top_logprobs_num > 0
    asked_ids = _asked_ids(body, len(inputs)) if body.return_logprob else [[]] * len(inputs)
    gens: list[GenerateRequest] = []
    now_ns = time.monotonic_ns()
    for inp, sp, rid, asked in zip(inputs, sps, rids, asked_ids):
        check_n(sp.n, ctx.limits)
        check_max_tokens(sp.max_new_tokens, ctx.limits, "max_new_tokens", minimum=0)
        sampling = sampling_from(
            sp, max_new_tokens=sp.max_new_tokens, return_logprob=want_lp,
            top_logprobs_num=body.top_logprobs_num,
        )  # fmt: skip
        seed = sp.sampling_seed if sp.sampling_seed is not None else sp.seed
        sampling = msgspec.structs.replace(
            sampling, logprob_start_len=body.logprob_start_len if want_lp else -1,
            token_ids_logprob=asked,
        )  # fmt: skip
        for i in range(sp.n):
            s = msgspec.structs.replace(sampling, seed=draw_seed() if seed is None else seed + i)
            gens.append(GenerateRequest(
                rid if sp.n == 1 else f"{rid}-{i}", s,
                text=inp if isinstance(inp, str) else None,
                input_ids=inp if isinstance(inp, list) else None,
                stream=body.stream, priority=body.priority or 0, arrival_ns=now_ns,
            ))  # fmt: skip
    if len(gens) > ctx.limits.max_prompts:
        raise bad_request(
            f"{len(gens)} requests (inputs x n); at most {ctx.limits.max_prompts} per call",
            param="sampling_params.n",
        )
    many = batch or len(gens) > 1
    ctx.engine.check_available()
    start_s = time.monotonic()
    start_len = body.logprob_start_len
    accs = [Acc() for _ in gens]

    def item(k: int) -> dict:
        a = accs[k]
        out = {"text": "".join(a.text), "output_ids": list(a.token_ids),
               "meta_info": _meta(gens[k].request_id, a, start_s, body, start_len,
                                  gens[k].sampling.token_ids_logprob)}  # fmt: skip
        if many and body.stream:
            out["index"] = k
        return out

    if not body.stream:
        async with generation(ctx, gens) as group:
            async for k, d in group:
                accs[k].add(d)
        items = [item(k) for k in range(len(gens))]
        return json_response(items if many else items[0])
    resp = await open_sse(request)
    sent = [(0, 0, 0)] * len(gens)  # text pieces, output tokens, prompt entries sent
    try:
        async with generation(ctx, gens) as group:
            async for k, d in group:
                accs[k].add(d)
                out = item(k)
                if ctx.config.incremental_streaming_output:
                    out, sent[k] = _since(out, accs[k], sent[k])
                await sse_send(resp, out)
    except APIError as e:
        await sse_send(resp, e.body())
    await sse_done(resp)
    return resp
