"""Per-request records of `shunter bench serve` and the summary computed from them.

Pure: no I/O and no clock. The summary uses SGLang's bench_serving key names
(`mean_ttft_ms`, `p99_itl_ms`, `output_token_throughput`, ...), so reports of both
tools line up.

Definitions (successful requests only; failed ones are counted and their error texts
kept): TTFT = first content chunk - send; ITL = every gap between consecutive content
chunks; TPOT = (E2E - TTFT) / (output tokens - 1), for requests with > 1 token; E2E =
end of stream - send; throughputs divide by the run's duration (first send to last
end); `concurrency` = sum of E2E / duration, the mean number of requests in flight;
`cache_hit_rate` = prompt tokens the server reports as cached (usage
prompt_tokens_details.cached_tokens, or meta_info.cached_tokens) / prompt tokens.
"""

from __future__ import annotations

import math
from collections import Counter

import msgspec
import numpy as np

STATS = ("mean", "median", "std", "p90", "p99", "max")


class RequestResult(msgspec.Struct):
    """What one request measured; times in seconds."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0  # the server's usage figure when it sends one
    output_len: int = 0
    ttft_s: float = math.nan
    itl_s: list[float] = []
    e2e_s: float = math.nan
    start_s: float = 0.0  # send time, from the benchmark's start
    cached_len: int = 0  # prompt tokens the server reports as served from its prefix cache


def _stats(name: str, values_ms: list[float]) -> dict:
    if not values_ms:
        return {f"{s}_{name}_ms": None for s in STATS}
    v = np.asarray(values_ms, dtype=np.float64)  # [num_values]
    return {
        f"mean_{name}_ms": float(v.mean()), f"median_{name}_ms": float(np.median(v)),
        f"std_{name}_ms": float(v.std()), f"p90_{name}_ms": float(np.percentile(v, 90)),
        f"p99_{name}_ms": float(np.percentile(v, 99)), f"max_{name}_ms": float(v.max()),
    }  # fmt: skip


def summarize(results: list[RequestResult], duration_s: float) -> dict:
    """Throughputs and latency distributions of one run (failed requests count only as failed)."""
    ok = [r for r in results if r.success]
    num_in = sum(r.prompt_len for r in ok)
    num_out = sum(r.output_len for r in ok)
    num_cached = sum(r.cached_len for r in ok)
    d = duration_s if duration_s > 0 else math.nan
    out = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration_s,
        "total_input_tokens": num_in, "total_output_tokens": num_out,
        "request_throughput": len(ok) / d, "input_token_throughput": num_in / d,
        "output_token_throughput": num_out / d, "total_token_throughput": (num_in + num_out) / d,
        "concurrency": sum(r.e2e_s for r in ok) / d, "total_cached_tokens": num_cached,
        "cache_hit_rate": num_cached / num_in if num_in else None,
    }  # fmt: skip
    out.update(_stats("ttft", [r.ttft_s * 1e3 for r in ok if not math.isnan(r.ttft_s)]))
    out.update(_stats("tpot", [(r.e2e_s - r.ttft_s) / (r.output_len - 1) * 1e3
                               for r in ok if r.output_len > 1 and not math.isnan(r.ttft_s)]))  # fmt: skip
    out.update(_stats("itl", [x * 1e3 for r in ok for x in r.itl_s]))
    out.update(_stats("e2e", [r.e2e_s * 1e3 for r in ok]))
    errors = Counter(r.error for r in results if not r.success)
    out["errors"] = dict(errors.most_common(5))
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in out.items()}


def format_table(s: dict) -> str:
    def num(v) -> str:
        return "-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))

    rows = [("Backend", s.get("backend")), ("Dataset", s.get("dataset")),
            ("Request rate (req/s)", s.get("request_rate")),
            ("Max concurrency", s.get("max_concurrency")),
            ("Successful requests", s.get("completed")), ("Failed requests", s.get("failed")),
            ("Duration (s)", s.get("duration_s")),
            ("Total input tokens", s.get("total_input_tokens")),
            ("Total output tokens", s.get("total_output_tokens")),
            ("Request throughput (req/s)", s.get("request_throughput")),
            ("Input token throughput (tok/s)", s.get("input_token_throughput")),
            ("Output token throughput (tok/s)", s.get("output_token_throughput")),
            ("Mean concurrency", s.get("concurrency")),
            ("Prefix cache hit rate", s.get("cache_hit_rate"))]  # fmt: skip
    for m, title in (("e2e", "E2E latency"), ("ttft", "Time to first token"),
                     ("tpot", "Time per output token (excl. 1st)"), ("itl", "Inter-token latency")):  # fmt: skip
        rows.append((f"-- {title} (ms)", ""))
        rows += [
            (f"{st.capitalize()}", s.get(f"{st}_{m}_ms")) for st in ("mean", "median", "p90", "p99")
        ]
    for key in ("hf_output_token_throughput", "hf_request_throughput",
                "output_throughput_vs_hf", "request_throughput_vs_hf"):  # fmt: skip
        if key in s:
            rows.append((key, s[key]))
    lines = ["{:=^60}".format(" Serving Benchmark Result ")]
    lines += [f"{k:<44}{num(v) if v != '' else '':>16}" for k, v in rows]
    for err, count in (s.get("errors") or {}).items():
        lines.append(f"error x{count}: {err[:100]}")
    return "\n".join([*lines, "=" * 60])
