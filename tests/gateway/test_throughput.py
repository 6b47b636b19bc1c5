"""How much the gateway + tokenizer cost per token: many concurrent streaming requests
against the scripted engine (which itself costs almost nothing). Heavy tier."""

from __future__ import annotations

import concurrent.futures
import json
import time

import pytest
import requests


@pytest.mark.heavy
def test_streaming_throughput_through_gateway_and_tokenizer(stack):
    num_requests, num_tokens = 64, 64
    body = {"model": "smollm2", "prompt": "x", "max_tokens": num_tokens, "stream": True,
            "ignore_eos": True}  # fmt: skip

    def one(_):
        t0 = time.monotonic()
        r = requests.post(stack.url + "/v1/completions", json=body, stream=True, timeout=60)
        first = None
        n = 0
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                first = first or time.monotonic() - t0
                n += bool(json.loads(line[6:])["choices"])
        return first, time.monotonic() - t0, n

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(num_requests) as pool:
        results = list(pool.map(one, range(num_requests)))
    wall = time.monotonic() - t0
    total = num_requests * num_tokens
    assert all(n >= 1 for _, _, n in results)
    ttfts = sorted(r[0] for r in results)
    print(f"\n{num_requests} streams x {num_tokens} tokens in {wall:.2f} s: "
          f"{total / wall:.0f} tokens/s through gateway+tokenizer, "
          f"TTFT p50 {ttfts[len(ttfts) // 2] * 1000:.0f} ms")  # fmt: skip
    assert total / wall > 500  # a generous floor for a shared 2-core machine
