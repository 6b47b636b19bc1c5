"""`shunter bench serve`: an online serving benchmark against any OpenAI-compatible URL.

Theory of operation
    1. A request list comes from a synthetic dataset (ops/bench_datasets.py), seeded;
       prompts go out as token ids unless --prompt-format text (openai-chat: always text).
    2. The load generator (ops/bench_client.py) warms the server up, then sends the list
       on a Poisson schedule (`--request-rate`) under `--max-concurrency`, streaming each
       request (SSE) from /v1/completions (backend openai), /v1/chat/completions
       (openai-chat) or SGLang's native /generate (sglang), and times every chunk. A
       failed request keeps its error text; the most common texts are reported.
    3. The summary (ops/bench_metrics.py: TTFT, ITL, E2E, TPOT, throughputs) is printed
       as a table, then as one JSON object on the LAST stdout line; --output-file writes
       it with every request's record, --plot draws a PNG.
    4. `--hf-baseline` (or `--backend hf`) runs HF transformers on the same request list
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

import aiohttp
import msgspec
import structlog

from shunter.ops import bench_datasets as ds
from shunter.ops import logging as shunter_logging
from shunter.ops.bench_client import BenchRun, ClientConfig, discover_model, run_benchmark
from shunter.ops.bench_metrics import format_table, summarize

log = structlog.get_logger("shunter.bench_serve")

BACKENDS = ("openai", "openai-chat", "sglang", "hf")


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
    g.add_argument("--gsp-order", choices=ds.GSP_ORDERS, default="grouped",
                   help="requests group by group, or one of each group in turn")  # fmt: skip
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
