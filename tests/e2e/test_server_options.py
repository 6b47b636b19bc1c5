"""SGLang server options on a real server: --kv-events-config publishes the prefix
cache's events to a ZMQ subscriber, --allow-auto-truncate serves a prompt longer than
--context-length, --log-level-http and --decode-log-interval write their lines, and
priority scheduling with LFU eviction serves requests as the shared server does."""

from __future__ import annotations

import json
import time

import msgspec
import zmq


def test_options_on_a_server_of_their_own(start_server, call, tmp_path):
    endpoint = f"ipc://{tmp_path}/kv-events"
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 20_000)
    args = ("--kv-events-config", json.dumps({"publisher": "zmq", "endpoint": endpoint}),
            "--allow-auto-truncate", "--context-length", "64", "--log-level-http", "info",
            "--decode-log-interval", "2", "--enable-priority-scheduling",
            "--radix-eviction-policy", "lfu", "--prefill-max-requests", "2")  # fmt: skip
    try:
        with start_server(tmp_path / "srv", "embedded", *args) as server:
            sub.connect(endpoint)
            time.sleep(0.5)  # a SUB socket misses what was sent before it joined
            long_prompt = " ".join(["word"] * 200)
            status, out = call(server, "/v1/completions", {
                "prompt": long_prompt, "max_tokens": 8, "temperature": 0, "priority": 3})  # fmt: skip
            assert status == 200, out
            assert out["usage"]["prompt_tokens"] == 63  # cut to context - 1, start kept
            assert out["usage"]["completion_tokens"] == 1  # what the context leaves
            status, out = call(server, "/generate", {  # (sampled: an EOS may come early)
                "text": "The capital of France is",
                "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}})  # fmt: skip
            assert status == 200 and out["meta_info"]["completion_tokens"] == 6, out
            _, seq, payload = sub.recv_multipart()
            batch = msgspec.msgpack.decode(payload)
            kinds = [e[0] for e in batch[1]]
            assert int.from_bytes(seq, "big") == 0 and kinds == ["BlockStored"], batch
            stored = batch[1][0]
            assert len(stored[3]) == len(stored[1]) * stored[4]  # token ids: whole pages
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                events = server.log_events()
                http = [e for e in events if e.get("event") == "http"]
                decode = [e for e in events if e.get("event") == "decode batch"]
                if http and decode:
                    break
                time.sleep(0.2)
            assert any(e["path"] == "/v1/completions" and e["status"] == 200 for e in http), http
            assert decode and {"running", "queued", "token_usage", "gen_tok_s"} <= set(decode[-1])
    finally:
        sub.close(0)
