"""`shunter bench serve`: an online serving benchmark against any OpenAI-compatible URL.

Theory of operation
    1. A request list comes from a synthetic dataset (ops/bench_datasets.py), seeded.
    2. Requests arrive on a Poisson schedule (`--request-rate`, exponential gaps from a
       seeded RNG; inf sends them all at once) and wait on a semaphore of
       `--max-concurrency` slots before they go out, as SGLang's bench_serving does.
    3. Each request streams (SSE) from /v1/completions (backend openai, prompts as
       token ids unless --prompt-format text), /v1/chat/completions (openai-chat, text)
       or SGLang's native /generate (sglang). Timestamps are taken when each SSE event
       is parsed: TTFT = first chunk carrying content - send; ITL = gaps between
       content chunks; E2E = end of stream - send; TPOT = (E2E - TTFT) / (tokens - 1).
       Output tokens come from the usage the server streams (stream_options.include_usage,
       or meta_info for /generate), else from the number of content chunks.
    4. A request fails on a non-200 status, an error event inside the stream, a stream
       that ends without [DONE], or a transport error; its error text is kept and the
       most common texts are reported.
    5. The summary is printed as a table, then as one JSON object on the LAST stdout
       line; --output-file writes it with every request's record, --plot draws a PNG.
    6. `--hf-baseline` (or `--backend hf`) runs HF transformers on the same request list
       (ops/bench_hf.py) and reports shunter/HF throughput ratios.

Invariants
    - never more than --max-concurrency requests in flight;
    - completed + failed == number of requests sent (warm-up requests are not counted).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time

import aiohttp
import msgspec
import numpy as np
import structlog
from tqdm import tqdm

from shunter.ops import bench_datasets as ds
from shunter.ops import logging as shunter_logging
from shunter.ops.bench_metrics import RequestResult, format_table, summarize

log = structlog.get_logger("shunter.bench_serve")

BACKENDS = ("openai", "openai-chat", "sglang", "hf")
PATHS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions", "sglang": "/generate"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--backend", choices=BACKENDS, default="openai",
                   help="openai: /v1/completions; openai-chat: /v1/chat/completions; "
                        "sglang: native /generate; hf: HF transformers only, no server")  # fmt: skip
    g.add_argument("--base-url", default=None, help="server URL (default http://HOST:PORT)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=30000)
    g.add_argument("--model", default=None, help="model name sent (default: ask /v1/models)")
    g.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    g.add_argument("--model-path", default=None,
                   help="local model for the tokenizer and the HF baseline (default: SmolLM2-135M)")  # fmt: skip
    g.add_argument("--vocab-size", type=int, default=None,
                   help="draw prompt ids from [0, N) without loading a tokenizer (id prompts only)")  # fmt: skip
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", choices=ds.DATASETS, default="random")
    g.add_argument("--num-prompts", type=int, default=100)
    g.add_argument("--seed", type=int, default=1)
    g.add_argument("--prompt-format", choices=("ids", "text"), default="ids",
                   help="how prompts go out (openai-chat always sends text)")  # fmt: skip
    g.add_argument("--random-input-len", type=int, default=256)
    g.add_argument("--random-output-len", type=int, default=64)
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [max(1, int(LEN*RATIO)), LEN]; 1.0 = fixed")  # fmt: skip
    g.add_argument("--gsp-num-groups", type=int, default=4)
    g.add_argument("--gsp-prompts-per-group", type=int, default=8)
    g.add_argument("--gsp-system-prompt-len", type=int, default=512)
    g.add_argument("--gsp-question-len", type=int, default=64)
    g.add_argument("--gsp-output-len", type=int, default=64)
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals (default inf: all at once)")  # fmt: skip
    g.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    g.add_argument("--max-tokens", type=int, default=None,
                   help="every request asks for exactly this many output tokens")  # fmt: skip
    g.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos and min_tokens = max_tokens so lengths are exact")  # fmt: skip
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    g.add_argument("--warmup-requests", type=int, default=1)
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    g = p.add_argument_group("output")
    g.add_argument("--output-file", default=None, help="write the summary and every request (JSON)")
    g.add_argument(
        "--plot", default=None, metavar="FILE.png", help="TTFT/ITL CDFs and E2E over time"
    )
    g.add_argument("--disable-tqdm", action="store_true")
    g.add_argument("--log-level", default="info", help="logs go to stderr; stdout is the report")
    g = p.add_argument_group("HF transformers baseline")
    g.add_argument("--hf-baseline", action="store_true", help="also run HF on the same requests")
    g.add_argument("--hf-batch-size", type=int, default=8, help="static batch size of HF generate")
    g.add_argument("--hf-dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    g.add_argument("--hf-threads", type=int, default=None, help="torch threads (default: torch's)")
    g.add_argument("--hf-device", default="cpu", help="where HF runs: cpu, cuda, cuda:N")


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


def _client_config(args: argparse.Namespace, model: str | None) -> ClientConfig:
    extra = json.loads(args.extra_body) if args.extra_body else {}
    if not isinstance(extra, dict):
        raise ValueError("--extra-body must be a JSON object")
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    return ClientConfig(
        base_url, args.backend, model, args.api_key, args.ignore_eos, args.temperature, extra,
        args.request_rate, args.max_concurrency, args.seed, args.request_timeout,
    )  # fmt: skip


async def _serve(args: argparse.Namespace, requests: list[ds.BenchRequest]) -> BenchRun:
    cfg = _client_config(args, None)
    model = args.model
    if model is None and cfg.backend != "sglang":
        model = await discover_model(cfg.base_url, cfg.api_key)
    cfg = msgspec.structs.replace(cfg, model=model)
    log.info("benchmark starting", url=cfg.base_url, backend=cfg.backend, model=model,
             num_requests=len(requests))  # fmt: skip
    return await run_benchmark(requests, cfg, num_warmup=args.warmup_requests,
                               progress=not args.disable_tqdm)  # fmt: skip


def run(args: argparse.Namespace) -> int:
    try:
        shunter_logging.configure(args.log_level, "console")
        if args.warmup_requests < 0:
            raise ValueError("--warmup-requests must be >= 0")
        if args.backend != "hf":
            _client_config(args, None)  # bad load arguments fail before any tokenizer loads
        from shunter.ops.bench_hf import load_tokenizer

        requests = ds.from_args(args, load_tokenizer)
    except ValueError as e:
        print(f"bench serve: {e}", file=sys.stderr)
        return 2
    rate = args.request_rate
    summary: dict = {
        "backend": args.backend, "dataset": args.dataset_name, "num_prompts": len(requests),
        "seed": args.seed, "request_rate": "inf" if math.isinf(rate) else rate,
        "max_concurrency": args.max_concurrency,
    }  # fmt: skip
    served = hf = None
    if args.backend != "hf":
        try:
            served = asyncio.run(_serve(args, requests))
        except (TimeoutError, ValueError, aiohttp.ClientError) as e:
            print(f"bench serve: cannot use the server: {e}", file=sys.stderr)
            return 2
        except RuntimeError as e:
            print(f"bench serve: {e}", file=sys.stderr)
            return 1
        summary.update(summarize(served.results, served.duration_s))
        summary["max_in_flight"] = served.max_in_flight
    if args.backend == "hf" or args.hf_baseline:
        from shunter.ops.bench_hf import run_hf

        try:
            hf = run_hf(requests, model_path=args.model_path, batch_size=args.hf_batch_size,
                        dtype=args.hf_dtype, num_threads=args.hf_threads, device=args.hf_device,
                        progress=not args.disable_tqdm)  # fmt: skip
        except ValueError as e:
            print(f"bench serve: HF baseline: {e}", file=sys.stderr)
            return 2
        hf_summary = summarize(hf.results, hf.duration_s)
        if served is None:
            summary.update(hf_summary)
        summary.update(
            hf_batch_size=hf.batch_size, hf_dtype=args.hf_dtype, hf_device=args.hf_device,
            hf_duration_s=hf.duration_s,
            hf_request_throughput=hf_summary["request_throughput"],
            hf_output_token_throughput=hf_summary["output_token_throughput"],
            hf_median_ttft_ms=hf_summary["median_ttft_ms"],
            hf_median_e2e_ms=hf_summary["median_e2e_ms"],
        )  # fmt: skip
        if served is not None and hf_summary["output_token_throughput"]:
            ours = summary["output_token_throughput"] or 0.0
            summary["output_throughput_vs_hf"] = ours / hf_summary["output_token_throughput"]
            summary["request_throughput_vs_hf"] = (
                summary["request_throughput"] or 0.0
            ) / hf_summary["request_throughput"]
    return _report(args, summary, served, hf)


def _report(args: argparse.Namespace, summary: dict, served: BenchRun | None, hf) -> int:
    print(format_table(summary), flush=True)
    main_results = served.results if served is not None else hf.results
    if args.output_file:
        record = {"summary": summary, "requests": main_results}
        if served is not None and hf is not None:
            record["hf_requests"] = hf.results
        with open(args.output_file, "wb") as f:  # msgspec writes NaN (never measured) as null
            f.write(msgspec.json.encode(record) + b"\n")
    if args.plot:
        from shunter.ops.bench_plot import write_plot

        label = "HF transformers" if served is None else "server"
        baseline = hf.results if (served is not None and hf is not None) else None
        write_plot(args.plot, main_results, summary, label=label, baseline=baseline)
    print(json.dumps(summary), flush=True)
    return 0 if summary["completed"] else 1
