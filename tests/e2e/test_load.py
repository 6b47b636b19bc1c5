"""End to end under load and churn: many concurrent streams, and a client that goes away
mid-stream (its KV must come back: nothing running, no page in use, census intact)."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import time

import openai
import pytest

from shunter.bus.log import LogReader
from shunter.bus.messages import AbortRequest, Census, CensusBroken, SequenceReleased


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.MULTILINE)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def _wait_idle(server, timeout_s=30.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        status, body = server.get("/metrics")
        assert status == 200
        text = body.decode()
        idle = (_metric(text, "sglang:num_running_reqs") == 0
                and _metric(text, "sglang:num_queue_reqs") == 0
                and _metric(text, "sglang:num_used_pages") == 0)  # fmt: skip
        if idle or time.monotonic() > deadline:
            return text if idle else ""
        time.sleep(0.2)


def _messages(server, types):
    return [m for _, m in LogReader(server.events_dir).messages() if isinstance(m, types)]


def test_disconnect_mid_stream_aborts_and_frees_the_kv(server):
    rid = f"disconnect-{time.monotonic_ns()}"
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    body = {"text": "Tell me a very long story.", "rid": rid, "stream": True,
            "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True, "temperature": 0}}  # fmt: skip
    conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    first = resp.read1(65536)
    assert first.startswith(b"data: ")
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    assert _wait_idle(server), "the engine still holds the request's KV after the disconnect"
    time.sleep(0.5)  # the recorder flushes within 200 ms
    aborts = [m for m in _messages(server, (AbortRequest,)) if m.request_id == rid]
    assert aborts and aborts[0].reason == "disconnect"
    released = [m for m in _messages(server, (SequenceReleased,)) if m.request_id == rid]
    assert [r.reason for r in released] == ["aborted"]
    assert len(released[0].token_ids) < 1000  # stopped early, not run to the end
    assert _messages(server, (CensusBroken,)) == []
    assert all(c.ok for c in _messages(server, (Census,)))


@pytest.mark.heavy
def test_64_concurrent_streams_all_complete(server):
    async def one(client, model, i):
        stream = await client.completions.create(
            model=model, prompt=f"Request {i}: list some colors.", max_tokens=16,
            temperature=0.7, seed=i, stream=True,
        )  # fmt: skip
        text, finish = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def main():
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none",
                                    timeout=300, max_retries=0)  # fmt: skip
        model = (await client.models.list()).data[0].id
        results = await asyncio.gather(*(one(client, model, i) for i in range(64)))
        await client.close()
        return results

    t0 = time.monotonic()
    results = asyncio.run(main())
    assert len(results) == 64
    assert all(finish in ("length", "stop") for _, finish in results), results
    assert sum(1 for text, _ in results if text) >= 60
    assert _wait_idle(server), "pages still in use after every stream finished"
    print(f"64 streams x 16 tokens in {time.monotonic() - t0:.1f} s")
