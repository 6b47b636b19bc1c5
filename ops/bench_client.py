"""The load generator of `shunter bench serve`: a request list, sent streaming over HTTP.

Theory of operation
    1. Requests arrive on a Poisson schedule (`request_rate`, exponential gaps from a
       seeded RNG; inf sends them all at once) and wait on a semaphore of
       `max_concurrency` slots before they go out, as SGLang's bench_serving does.
       Warm-up requests (the first request's prompt rotated by half, so they cache no
       prefix of the list) go out before, all at once, untimed; one failing ends the
       run with RuntimeError.
    2. Each request streams (SSE) from /v1/completions (backend openai),
       /v1/chat/completions (openai-chat, text prompts only) or SGLang's native /generate
       (sglang). Timestamps are taken when each SSE event is parsed: TTFT = first chunk
       carrying content - send; ITL = gaps between content chunks; E2E = end of stream -
       send (TPOT and the rest are derived in ops/bench_metrics.py). Output tokens come
       from the usage the server streams (stream_options.include_usage, or meta_info for
       /generate), else from the number of content chunks; prompt and cached tokens
       likewise come from the usage when there is one.
    3. A request fails on a non-200 status, an error event inside the stream, a stream
       that ends without [DONE], or a transport error (an event over `max_event_bytes`
       included); its error text is kept in its RequestResult and nothing is raised.

Invariants
    - never more than `max_concurrency` requests in flight (BenchRun.max_in_flight is
      the most there were);
    - one RequestResult per request, in the order of the list, success or not.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time

import aiohttp
import msgspec
import numpy as np
from tqdm import tqdm

from shunter.ops import bench_datasets as ds
from shunter.ops.bench_metrics import RequestResult

PATHS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions", "sglang": "/generate"}


class ClientConfig(msgspec.Struct, frozen=True):
    base_url: str
    backend: str = "openai"
    model: str | None = None
    api_key: str | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    extra_body: dict = {}
    request_rate: float = math.inf
    max_concurrency: int | None = None
    seed: int = 1
    request_timeout_s: float = 600.0
    max_event_bytes: int = 1 << 24  # /generate streams cumulative output ids and text per event

    def __post_init__(self) -> None:
        if self.backend not in PATHS:
            raise ValueError(f"backend {self.backend!r} has no HTTP endpoint")
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0, got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")


class BenchRun(msgspec.Struct, frozen=True):
    results: list[RequestResult]
    duration_s: float
    max_in_flight: int


def arrival_offsets(num: int, request_rate: float, seed: int) -> list[float]:
    """Send times (s from the start) of a Poisson process: the first at 0."""
    if math.isinf(request_rate):
        return [0.0] * num
    gaps = np.random.default_rng([seed, 1]).exponential(1.0 / request_rate, size=num)  # [num]
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]).tolist()[:num]


def payload(cfg: ClientConfig, req: ds.BenchRequest) -> dict:
    """The JSON body of one streaming request."""
    n, prompt = req.output_len, req.prompt_text if req.prompt_text is not None else req.prompt_ids
    if cfg.backend == "sglang":
        sp: dict = {"max_new_tokens": n, "temperature": cfg.temperature}
        if cfg.ignore_eos:
            sp.update(ignore_eos=True, min_new_tokens=n)
        key = "text" if isinstance(prompt, str) else "input_ids"
        body = {key: prompt, "sampling_params": sp, "stream": True}
    else:
        body = {"max_tokens": n, "temperature": cfg.temperature, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        if cfg.backend == "openai-chat":
            if not isinstance(prompt, str):
                raise ValueError("the openai-chat backend needs text prompts")
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if cfg.ignore_eos:
            body.update(ignore_eos=True, min_tokens=n)
        if cfg.model is not None:
            body["model"] = cfg.model
    return {**body, **cfg.extra_body}


class _Stream:
    """Folds one request's SSE events into a RequestResult."""

    def __init__(self, backend: str, result: RequestResult, sent_s: float) -> None:
        self.backend, self.r, self.sent_s = backend, result, sent_s
        self.last_s = math.nan
        self.num_chunks = 0
        self.num_ids = 0  # /generate streams cumulative output_ids
        self.usage_tokens: int | None = None

    def feed(self, obj: dict, now_s: float) -> None:
        if "error" in obj:
            err = obj["error"]
            raise _Failed(err.get("message", str(err)) if isinstance(err, dict) else str(err))
        if self.backend == "sglang":
            ids, meta = obj.get("output_ids") or [], obj.get("meta_info") or {}
            content = len(ids) > self.num_ids or (not ids and bool(obj.get("text")))
            self.num_ids = max(self.num_ids, len(ids))
            if "completion_tokens" in meta:
                self.usage_tokens = meta["completion_tokens"]
                self.r.prompt_len = meta.get("prompt_tokens", self.r.prompt_len)
                self.r.cached_len = meta.get("cached_tokens", 0) or 0
        else:
            content = False
            for c in obj.get("choices") or []:
                content |= bool(c.get("text") or (c.get("delta") or {}).get("content"))
            usage = obj.get("usage")
            if usage:
                self.usage_tokens = usage.get("completion_tokens")
                self.r.prompt_len = usage.get("prompt_tokens", self.r.prompt_len)
                details = usage.get("prompt_tokens_details") or {}
                self.r.cached_len = details.get("cached_tokens", 0) or 0
        if content:
            self.num_chunks += 1
            if self.num_chunks == 1:
                self.r.ttft_s = now_s - self.sent_s
            else:
                self.r.itl_s.append(now_s - self.last_s)
            self.last_s = now_s

    def finish(self, now_s: float) -> None:
        self.r.e2e_s = now_s - self.sent_s
        self.r.output_len = self.usage_tokens if self.usage_tokens is not None else self.num_chunks
        self.r.success = True


class _Failed(Exception):
    pass


async def _error_text(resp: aiohttp.ClientResponse) -> str:
    text = (await resp.text(errors="replace")).strip()
    try:
        err = json.loads(text).get("error", text)
        text = err.get("message", text) if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        pass
    return f"HTTP {resp.status}: {text[:300]}"


async def send_one(
    session: aiohttp.ClientSession, cfg: ClientConfig, req: ds.BenchRequest, t0: float
) -> RequestResult:
    """Send one streaming request and time its chunks; never raises for a bad response."""
    r = RequestResult(prompt_len=req.prompt_len)
    sent = time.perf_counter()
    r.start_s = sent - t0
    stream = _Stream(cfg.backend, r, sent)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    try:
        body = payload(cfg, req)
        async with session.post(cfg.base_url + PATHS[cfg.backend], json=body,
                                headers=headers) as resp:  # fmt: skip
            if resp.status != 200:
                raise _Failed(await _error_text(resp))
            done = False
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue  # blank separators and SSE comments
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                stream.feed(json.loads(data), time.perf_counter())
            if not done:
                raise _Failed("stream ended without [DONE]")
        stream.finish(time.perf_counter())
    except _Failed as e:
        r.error = str(e)
    except Exception as e:  # one request's failure, whatever it is, must not end the run
        r.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return r


async def run_benchmark(
    requests: list[ds.BenchRequest], cfg: ClientConfig, *, num_warmup: int = 0,
    progress: bool = False,
) -> BenchRun:  # fmt: skip
    """Warm up, then send every request on the arrival schedule under the concurrency bound."""
    offsets = arrival_offsets(len(requests), cfg.request_rate, cfg.seed)
    sem = asyncio.Semaphore(cfg.max_concurrency or len(requests) or 1)
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
    in_flight = max_in_flight = 0
    bar = tqdm(total=len(requests), disable=not progress, file=sys.stderr, desc="requests")
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout, read_bufsize=cfg.max_event_bytes
    ) as session:
        if num_warmup and requests:
            warm = ds.warmup_request(requests[0])
            t = time.perf_counter()
            for w in await asyncio.gather(
                *(send_one(session, cfg, warm, t) for _ in range(num_warmup))
            ):
                if not w.success:
                    raise RuntimeError(f"warm-up request failed: {w.error}")
        t0 = time.perf_counter()

        async def one(i: int) -> RequestResult:
            nonlocal in_flight, max_in_flight
            await asyncio.sleep(max(0.0, t0 + offsets[i] - time.perf_counter()))
            async with sem:
                in_flight += 1
                max_in_flight = max(max_in_flight, in_flight)
                try:
                    return await send_one(session, cfg, requests[i], t0)
                finally:
                    in_flight -= 1
                    bar.update(1)

        results = await asyncio.gather(*(one(i) for i in range(len(requests))))
        duration = time.perf_counter() - t0
    bar.close()
    return BenchRun(list(results), duration, max_in_flight)


async def discover_model(base_url: str, api_key: str | None) -> str:
    """The first model /v1/models lists."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=30)
    async with (
        aiohttp.ClientSession(timeout=timeout) as s,
        s.get(base_url + "/v1/models", headers=headers) as resp,
    ):
        if resp.status != 200:
            raise ValueError(f"{base_url}/v1/models: {await _error_text(resp)} (give --model)")
        data = (await resp.json()).get("data") or []
    if not data:
        raise ValueError(f"{base_url}/v1/models lists no model (give --model)")
    return data[0]["id"]
