"""Prometheus metrics with SGLang's names (`sglang:*`, label `model_name`), rendered as
the text exposition format (version 0.0.4) by hand: the set is small and fixed.

Request-level figures (tokens, time to first token, inter-token latency, end-to-end
latency) are measured at the gateway from delta arrival times; engine-level gauges
(running and queued requests, KV usage, cache hit rate, throughput) come from the
scheduler's periodic `SchedulerStats`. The KV cache's pages per tier and state, and its
copies between tiers, come from the cache manager's `CacheStats` under `shunter:*`
names (SGLang exports no such set): `shunter:kv_pages{tier,state}`,
`shunter:prefix_hit_tokens_total{tier}`, `shunter:kv_pages_copied_total{direction}`,
`shunter:kv_copies_failed_total` and `shunter:kv_pages_evicted_total`; with a file
store, `shunter:store_blocks`, `shunter:store_blocks_copied_total{direction}` and
`shunter:store_blocks_evicted_total`.
"""

from __future__ import annotations

import bisect
import math

from shunter.bus.messages import CacheStats, SchedulerStats

# Bucket bounds (seconds), close to SGLang's.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 15.0, 20.0, 25.0, 30.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06,
               0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)  # fmt: skip
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               90.0, 120.0, 180.0, 300.0, 600.0)  # fmt: skip


class Histogram:
    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]) -> None:
        self.name = name
        self.doc = doc
        self.bounds = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        if math.isnan(value):
            return
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def render(self, labels: str) -> list[str]:
        lines = [f"# HELP {self.name} {self.doc}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, n in zip(self.bounds, self.counts):
            cumulative += n
            lines.append(f'{self.name}_bucket{{{labels},le="{bound}"}} {cumulative}')
        lines.append(f'{self.name}_bucket{{{labels},le="+Inf"}} {self.count}')
        lines.append(f"{self.name}_sum{{{labels}}} {_num(self.sum)}")
        lines.append(f"{self.name}_count{{{labels}}} {self.count}")
        return lines


def _num(x: float) -> str:
    return repr(float(x)) if isinstance(x, float) else str(x)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Metrics:
    """Every metric the gateway exports; `render()` is the /metrics body."""

    def __init__(self, model_name: str) -> None:
        self.labels = f'model_name="{_escape(model_name)}"'
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.cached_tokens_total = 0
        self.num_requests_total = 0
        self.num_finished_total: dict[str, int] = {}  # finish reason -> count
        self.num_failed_total = 0
        self.ttft = Histogram(
            "sglang:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS
        )
        self.itl = Histogram(
            "sglang:inter_token_latency_seconds", "Time between output tokens.", ITL_BUCKETS
        )
        self.tpot = Histogram(
            "sglang:time_per_output_token_seconds",
            "Mean time per output token of each finished request (after the first).",
            ITL_BUCKETS,
        )
        self.e2e = Histogram(
            "sglang:e2e_request_latency_seconds", "End-to-end request latency.", E2E_BUCKETS
        )
        self.num_in_flight = 0
        self.stats: SchedulerStats | None = None
        self.cache: CacheStats | None = None

    # -- updates (called by the gateway's engine client) ---------------------------------

    def request_started(self, num: int = 1) -> None:
        self.num_requests_total += num
        self.num_in_flight += num

    def first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def tokens(self, num_tokens: int, interval_s: float) -> None:
        """A delta of num_tokens arrived interval_s after the previous one."""
        if num_tokens > 0:
            per = interval_s / num_tokens
            for _ in range(min(num_tokens, 64)):
                self.itl.observe(per)

    def request_finished(
        self,
        finish_reason: str,
        *,
        num_prompt_tokens: int,
        num_completion_tokens: int,
        num_cached_tokens: int,
        e2e_s: float,
        decode_s: float,
    ) -> None:
        self.num_in_flight -= 1
        self.prompt_tokens_total += num_prompt_tokens
        self.generation_tokens_total += num_completion_tokens
        self.cached_tokens_total += num_cached_tokens
        self.num_finished_total[finish_reason] = self.num_finished_total.get(finish_reason, 0) + 1
        self.e2e.observe(e2e_s)
        if num_completion_tokens > 1:
            self.tpot.observe(decode_s / (num_completion_tokens - 1))

    def request_failed(self) -> None:
        self.num_in_flight -= 1
        self.num_failed_total += 1

    # -- exposition ----------------------------------------------------------------------

    def render(self) -> str:
        lb = self.labels
        out: list[str] = []

        def metric(name: str, kind: str, doc: str, value: float, labels: str = lb) -> None:
            out.extend(
                [
                    f"# HELP {name} {doc}",
                    f"# TYPE {name} {kind}",
                    f"{name}{{{labels}}} {_num(value)}",
                ]
            )

        metric(
            "sglang:prompt_tokens_total",
            "counter",
            "Prompt tokens processed.",
            self.prompt_tokens_total,
        )
        metric(
            "sglang:generation_tokens_total",
            "counter",
            "Output tokens generated.",
            self.generation_tokens_total,
        )
        metric(
            "sglang:cached_tokens_total",
            "counter",
            "Prompt tokens served from the prefix cache.",
            self.cached_tokens_total,
        )
        metric(
            "sglang:num_requests_total", "counter", "Requests received.", self.num_requests_total
        )
        metric(
            "sglang:num_failed_requests_total",
            "counter",
            "Requests that ended in an error.",
            self.num_failed_total,
        )
        out += [
            "# HELP sglang:num_finished_requests_total Finished requests by finish reason.",
            "# TYPE sglang:num_finished_requests_total counter",
        ]
        for reason, n in sorted(self.num_finished_total.items()):
            out.append(f'sglang:num_finished_requests_total{{{lb},reason="{_escape(reason)}"}} {n}')
        s = self.stats
        metric(
            "sglang:num_in_flight_reqs",
            "gauge",
            "Requests the gateway is waiting on.",
            self.num_in_flight,
        )
        metric(
            "sglang:num_running_reqs",
            "gauge",
            "Requests in the running batch.",
            s.num_running if s else 0,
        )
        metric(
            "sglang:num_queue_reqs",
            "gauge",
            "Requests waiting to be admitted.",
            s.num_waiting if s else 0,
        )
        metric(
            "sglang:num_used_pages", "gauge", "KV cache pages in use.", s.num_used_pages if s else 0
        )
        usage = s.num_used_pages / s.num_total_pages if s and s.num_total_pages else 0.0
        metric("sglang:token_usage", "gauge", "Fraction of the KV cache in use.", float(usage))
        metric(
            "sglang:cache_hit_rate",
            "gauge",
            "Prefix cache hit rate.",
            float(s.cache_hit_rate) if s else 0.0,
        )
        metric(
            "sglang:gen_throughput",
            "gauge",
            "Generation throughput (tokens/s).",
            float(s.gen_throughput_tok_s) if s else 0.0,
        )
        out += self._render_cache()
        for h in (self.ttft, self.itl, self.tpot, self.e2e):
            out += h.render(lb)
        return "\n".join(out) + "\n"  # fmt: skip

    def _render_cache(self) -> list[str]:
        """The `shunter:*` KV cache families from the latest CacheStats (none before the
        first; the host rows only with a host tier)."""
        c = self.cache
        if c is None:
            return []
        lb, out = self.labels, []

        def family(name: str, kind: str, doc: str, rows: list[tuple[str, int]]) -> None:
            out.extend([f"# HELP {name} {doc}", f"# TYPE {name} {kind}"])
            out.extend(
                f"{name}{{{lb}{',' + extra if extra else ''}}} {_num(v)}" for extra, v in rows
            )

        host = c.num_host_pages > 0
        pages = [
            ('tier="device",state="free"', c.num_free),
            ('tier="device",state="cached"', c.num_in_tree),
            ('tier="device",state="in_use"', c.num_pages - c.num_free - c.num_in_tree),
        ]
        if host:
            pages += [
                ('tier="host",state="free"', c.num_host_free),
                ('tier="host",state="cached"', c.num_host_in_tree),
                ('tier="host",state="writing"', c.num_host_writing),
            ]
        family("shunter:kv_pages", "gauge", "KV cache pages by tier and state.", pages)
        hits = [('tier="device"', c.num_hit_tokens - c.num_host_hit_tokens)]
        store = c.store_block_tokens > 0
        if host:  # (tokens read back from the file store reach the device through the host)
            hits.append(('tier="host"', max(c.num_host_hit_tokens - c.num_store_hit_tokens, 0)))
        if store:
            hits.append(('tier="store"', c.num_store_hit_tokens))
        family(
            "shunter:prefix_hit_tokens_total",
            "counter",
            "Prompt tokens found in the prefix cache, by the tier that held them.",
            hits,
        )
        if host:
            family(
                "shunter:kv_pages_copied_total",
                "counter",
                "KV pages copied between the device and the host tier.",
                [
                    ('direction="to_host"', c.num_spilled_pages),
                    ('direction="to_device"', c.num_loaded_pages),
                ],
            )
            family(
                "shunter:kv_copies_failed_total",
                "counter",
                "Copies between the KV tiers that failed.",
                [("", c.num_copies_failed + c.num_store_copies_failed)],
            )
        if store:
            family(
                "shunter:store_blocks",
                "gauge",
                "Blocks the file store below the host tier holds.",
                [("", c.num_store_blocks)],
            )
            family(
                "shunter:store_blocks_copied_total",
                "counter",
                "Blocks written to the file store and read back from it.",
                [
                    ('direction="to_store"', c.num_stored_blocks),
                    ('direction="from_store"', c.num_fetched_blocks),
                ],
            )
            family(
                "shunter:store_blocks_evicted_total",
                "counter",
                "Blocks deleted from the file store to keep it under its size cap.",
                [("", c.num_store_blocks_evicted)],
            )
        family(
            "shunter:kv_pages_evicted_total",
            "counter",
            "Device KV pages evicted from the prefix cache.",
            [("", c.num_evicted_pages)],
        )
        return out  # fmt: skip
