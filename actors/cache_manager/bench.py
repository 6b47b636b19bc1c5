"""Radix cache benchmark on a shared-prefix workload (used by `shunter bench scheduler`).

Workload: `num_prefixes` system prompts of `prefix_len` tokens; each request is one of
them plus a fresh `suffix_len`-token question, and finishes with `output_len` generated
tokens. Two figures:

- tree: one op = `match` of the prompt plus `insert` of prompt + output into the bare
  RadixTree (the per-request work of the tree alone);
- core: one request's whole life through CacheManagerCore messages: Tokenized ->
  Matched, LeaseRequest -> LeaseGranted, SequenceReleased (insert, dedupe, unlock), with
  a pool small enough that leases evict; KV events off, as under load in production
  they are usually off too.
"""

from __future__ import annotations

import random
import time

import msgspec

from shunter.actors.cache_manager.config import CacheConfig
from shunter.actors.cache_manager.core import CacheManagerCore
from shunter.actors.cache_manager.radix import RadixTree
from shunter.bus.messages import LeaseRequest, SamplingParams, SequenceReleased, Tokenized


class RadixBenchResult(msgspec.Struct, frozen=True, kw_only=True):
    num_requests: int
    page_size: int
    tree_ops_per_s: float  # match + insert pairs per second, bare tree
    tree_match_us: float
    tree_insert_us: float
    core_requests_per_s: float  # Tokenized + LeaseRequest + SequenceReleased per second
    hit_rate: float  # matched tokens / prompt tokens, core run
    num_evicted_pages: int


def _workload(num_requests, num_prefixes, prefix_len, suffix_len, output_len, seed):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(32000) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    out = []
    for _ in range(num_requests):
        prompt = rng.choice(prefixes) + [rng.randrange(32000) for _ in range(suffix_len)]
        out.append((prompt, [rng.randrange(32000) for _ in range(output_len)]))
    return out


def radix_bench(
    num_requests: int = 2000,
    *,
    num_prefixes: int = 8,
    prefix_len: int = 512,
    suffix_len: int = 64,
    output_len: int = 32,
    page_size: int = 1,
    seed: int = 0,
) -> RadixBenchResult:
    work = _workload(num_requests, num_prefixes, prefix_len, suffix_len, output_len, seed)

    tree = RadixTree(page_size, hash_blocks=False)
    next_page = 0
    t_match = t_insert = 0.0
    for prompt, output in work:
        full = prompt + output
        full = full[: len(full) - len(full) % page_size]
        t0 = time.perf_counter()
        tree.match("", prompt)
        t1 = time.perf_counter()
        num_pages = len(full) // page_size
        tree.insert("", full, list(range(next_page, next_page + num_pages)))
        t2 = time.perf_counter()
        next_page += num_pages
        t_match += t1 - t0
        t_insert += t2 - t1

    # pool: every prefix plus about 64 requests' own tokens, so the tail gets evicted
    per_req = -(-(suffix_len + output_len) // page_size) + 1
    num_pool = num_prefixes * (-(-prefix_len // page_size)) + 64 * per_req
    core = CacheManagerCore(
        CacheConfig(num_pages=num_pool, page_size=page_size, emit_kv_events=False)
    )
    sp = SamplingParams()
    t0 = time.perf_counter()
    for i, (prompt, output) in enumerate(work):
        rid = f"r{i}"
        (m,) = core.handle(Tokenized(rid, prompt, sp))
        full = prompt + output
        need = -(-len(full) // page_size) - len(m.prefix_pages)
        grant = core.handle(LeaseRequest(i, need))[-1]
        core.handle(SequenceReleased(rid, full, m.prefix_pages + grant.pages))
    t_core = time.perf_counter() - t0
    stats = core.statistics()
    n = len(work)
    return RadixBenchResult(
        num_requests=n,
        page_size=page_size,
        tree_ops_per_s=n / (t_match + t_insert),
        tree_match_us=t_match / n * 1e6,
        tree_insert_us=t_insert / n * 1e6,
        core_requests_per_s=n / t_core,
        hit_rate=stats.hit_rate,
        num_evicted_pages=stats.num_evicted_pages,
    )


if __name__ == "__main__":
    for ps in (1, 16):
        print(msgspec.json.encode(radix_bench(page_size=ps)).decode())
