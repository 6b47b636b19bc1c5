"""Raw HTTP against the real gateway (real tokenizer, scripted engine; see conftest.py):
validation classes, SSE framing, native /generate, disconnects, health, metrics."""

from __future__ import annotations

import itertools
import json
import socket
import time

import pytest
import requests

CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}


def _post(stack, path, body=None, *, raw=None, **kw):
    data = raw if raw is not None else json.dumps(body)
    return requests.post(stack.url + path, data=data, timeout=20,
                         headers={"Content-Type": "application/json"}, **kw)  # fmt: skip


def _assert_error(r, status, param=None, code=None, words=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    if words is not None:
        assert words in err["message"], err
    return err


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "words"),
    [
        ("/v1/chat/completions", "{not json", 400, None, "not valid JSON"),
        ("/v1/chat/completions", "", 400, None, "empty"),
        ("/v1/chat/completions", "[1, 2]", 400, None, "object"),
        ("/v1/chat/completions", {"model": "smollm2"}, 400, None, "messages"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": "ten"}, 400, "max_tokens", "int"),
        ("/v1/chat/completions", {**CHAT, "temperature": -1}, 400, "temperature", None),
        ("/v1/chat/completions", {**CHAT, "top_p": 0}, 400, "top_p", None),
        ("/v1/chat/completions", {**CHAT, "n": 1000}, 400, "n", None),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, 400, "max_tokens", None),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 10**6}, 400, "max_completion_tokens", "context length"),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 3}, 400, "top_logprobs", "logprobs"),
        ("/v1/chat/completions", {**CHAT, "logit_bias": {"abc": 1}}, 400, "logit_bias", None),
        ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages", None),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", None),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, None, "text"),
        ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400, "tools", None),
        ("/v1/chat/completions", {**CHAT, "stop": [""]}, 400, "stop", None),
        ("/v1/completions", {"model": "smollm2"}, 400, "prompt", None),
        ("/v1/completions", {"prompt": []}, 400, "prompt", None),
        ("/v1/completions", {"prompt": [1, "a"]}, 400, "prompt", None),
        ("/v1/completions", {"prompt": "x", "logprobs": 99}, 400, "logprobs", None),
        ("/v1/completions", {"prompt": "x", "n": 3, "best_of": 2}, 400, "best_of", None),
        ("/v1/completions", {"prompt": "x", "ebnf": "root ::= a"}, 400, "ebnf", "not defined"),
        ("/v1/completions", {"prompt": "x", "structural_tag": {}}, 400, "structural_tag",
         "triggers"),
        ("/v1/completions", {"prompt": "x", "structural_tag": {"format": {"type": "sparkle"}}}, 400,
         "structural_tag", "format.type 'sparkle'"),
        ("/v1/chat/completions", {**CHAT, "response_format": {"type": "structural_tag", "format": {
            "type": "sequence", "elements": [{"type": "const_string", "value": "a"}, {"type": "tag",
            "begin": {"type": "token", "token": 5}, "content": {"type": "any_text"}, "end": "</t>"}]}}},
         400, "response_format", "format.elements[1].begin is a token format"),
        ("/generate", {"text": "x", "sampling_params": {"structural_tag": json.dumps(
            {"type": "structural_tag", "format": {"type": "any_text", "max_chars": 8}})}}, 400,
         "structural_tag", "format.max_chars"),
        ("/v1/completions", {"prompt": "x", "json_schema": {"type": "object", "patternProperties": {}}}, 400,
         "json_schema", "patternProperties"),
        ("/generate", {"text": "x", "sampling_params": {"json_schema": "[1]"}}, 400, "json_schema", None),
        ("/v1/completions", {"prompt": ["a"] * 200, "n": 2}, 400, "n", "400 choices"),
        ("/generate", {"text": ["a"] * 200, "sampling_params": {"n": 2}}, 400, "sampling_params.n", None),
        ("/generate", {"sampling_params": {}}, 400, "text", "exactly one"),
        ("/generate", {"text": "x", "input_ids": [1]}, 400, "text", "exactly one"),
        ("/generate", {"input_ids": [[1], []]}, 400, "input_ids", None),
        ("/generate", {"text": ["a", "b"], "sampling_params": [{}]}, 400, "sampling_params", None),
        ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": -1}}, 400, "max_new_tokens", None),
        ("/generate", {"text": "x", "sampling_params": {"top_k": 0}}, 400, "top_k", None),
        ("/generate", {"text": "x", "top_logprobs_num": -1}, 400, "top_logprobs_num", None),
        ("/v1/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, 400, None, "exactly one"),
        ("/v1/detokenize", {"tokens": "abc"}, 400, "tokens", None),
    ],
)  # fmt: skip
def test_invalid_input_is_a_clear_4xx(stack, path, body, status, param, words):
    r = _post(stack, path, raw=body) if isinstance(body, str) else _post(stack, path, body)
    _assert_error(r, status, param=param, words=words)


@pytest.mark.parametrize(
    ("path", "body", "code", "words"),
    [
        ("/v1/completions", {"prompt": ""}, "invalid_request", "empty"),
        ("/v1/completions", {"prompt": [49152]}, "invalid_request", "vocabulary"),
        ("/v1/completions", {"prompt": [5] * 600}, "context_length_exceeded", "600 tokens"),
        ("/v1/completions", {"prompt": [5] * 400, "max_tokens": 200}, "context_length_exceeded", "600 were"),
        ("/generate", {"text": "", "sampling_params": {"max_new_tokens": 1}}, "invalid_request", "empty"),
        ("/v1/detokenize", {"tokens": [10**7]}, None, "vocabulary"),
    ],
)  # fmt: skip
def test_tokenizer_rejections_are_400(stack, path, body, code, words):
    _assert_error(_post(stack, path, body), 400, code=code, words=words)


def test_unknown_model_route_and_method(stack):
    _assert_error(_post(stack, "/v1/chat/completions", {**CHAT, "model": "nope"}), 404,
                  param="model", code="model_not_found")  # fmt: skip
    _assert_error(requests.get(stack.url + "/v1/nothing", timeout=5), 404, words="no such endpoint")
    _assert_error(requests.get(stack.url + "/v1/chat/completions", timeout=5), 405)


def test_unknown_fields_are_ignored(stack):
    r = _post(stack, "/v1/chat/completions", {**CHAT, "max_tokens": 1, "frobnicate": True})
    assert r.status_code == 200, r.text


def _sse_events(resp) -> list[bytes]:
    body = b"".join(resp.iter_content(None))
    assert body.endswith(b"data: [DONE]\n\n")
    events = body.split(b"\n\n")
    assert events[-1] == b""
    assert all(e.startswith(b"data: ") for e in events[:-1]), events
    return [e[len(b"data: ") :] for e in events[:-1]]


def test_sse_framing_openai_and_native(stack):
    r = _post(stack, "/v1/chat/completions", {**CHAT, "stream": True}, stream=True)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    events = _sse_events(r)
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    r = _post(stack, "/generate", {"text": "hi", "stream": True,
                                   "sampling_params": {"max_new_tokens": 5}}, stream=True)  # fmt: skip
    chunks = [json.loads(e) for e in _sse_events(r)[:-1]]
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))  # cumulative
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert chunks[-1]["output_ids"] == stack.engine.reply_ids[:5]


def test_incremental_streaming_output_sends_only_what_is_new(stack, stack_factory):
    body = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 6},
            "return_logprob": True, "top_logprobs_num": 2}  # fmt: skip
    whole = [json.loads(e) for e in _sse_events(_post(stack, "/generate", body, stream=True))[:-1]]
    s = stack_factory(incremental_streaming_output=True)
    parts = [json.loads(e) for e in _sse_events(_post(s, "/generate", body, stream=True))[:-1]]
    last = whole[-1]
    assert "".join(p["text"] for p in parts) == last["text"]
    assert [i for p in parts for i in p["output_ids"]] == last["output_ids"]
    for key in ("output_token_logprobs", "output_top_logprobs"):
        got = [x for p in parts for x in p["meta_info"][key]]
        assert got == last["meta_info"][key], key
        assert all(len(p["meta_info"][key]) == len(p["output_ids"]) for p in parts)
    assert parts[-1]["meta_info"]["finish_reason"] == last["meta_info"]["finish_reason"]
    assert parts[-1]["meta_info"]["completion_tokens"] == 6


def test_native_generate_single_batch_and_logprobs(stack):
    r = _post(stack, "/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 3},
                                   "return_logprob": True, "top_logprobs_num": 1, "rid": "my-rid",
                                   "return_text_in_logprobs": True})  # fmt: skip
    out = r.json()
    meta = out["meta_info"]
    assert meta["id"] == "my-rid" and meta["completion_tokens"] == 3
    assert meta["prompt_tokens"] == len(stack.codec.encode("hello"))
    assert out["output_ids"] == stack.engine.reply_ids[:3]
    assert out["text"] == stack.codec.decode(out["output_ids"])
    assert meta["output_token_logprobs"][0] == [
        -0.25,
        out["output_ids"][0],
        stack.codec.token_text(out["output_ids"][0]),
    ]
    assert len(meta["output_top_logprobs"][0]) == 1
    assert meta["e2e_latency"] > 0
    r = _post(stack, "/generate", {"text": "one two three", "return_logprob": True,
                                   "logprob_start_len": 1, "sampling_params": {"max_new_tokens": 1}})  # fmt: skip
    ids = stack.codec.encode("one two three")
    entries = r.json()["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == ids[1:]
    assert [e[0] for e in entries] == [-1.0] * (len(ids) - 1)
    assert all(e[2] is None for e in entries)  # no texts unless return_text_in_logprobs
    r = _post(
        stack, "/generate", {"input_ids": [[5, 6], [7]], "sampling_params": {"max_new_tokens": 50}}
    )
    outs = r.json()
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [2, 1]
    assert all(o["text"] == stack.reply for o in outs)
    assert outs[0]["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    r = _post(stack, "/generate", {"text": "x", "sampling_params": {"stop": "I am", "n": 2}})
    outs = r.json()
    assert [o["text"] for o in outs] == ["Hello! "] * 2
    assert outs[0]["meta_info"]["finish_reason"] == {"type": "stop", "matched": "I am"}


def test_a_format_object_structural_tag_reaches_the_engine_as_its_pattern(stack):
    """Chat's response_format, an extra field of /v1/completions and SGLang's
    sampling_params (as JSON text) all carry the format-object form through."""
    from shunter.actors.grammar.structural_tag import structural_tag_regex

    tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f="],
           "tags": [{"begin": "<f=now>", "content": {"type": "any_text"}, "end": "</f>"}]}}  # fmt: skip
    pattern = structural_tag_regex(tag)
    for path, body in (
        ("/v1/chat/completions", {**CHAT, "max_tokens": 2, "response_format": tag}),
        ("/v1/completions", {"prompt": "x", "max_tokens": 2, "structural_tag": tag}),
        ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2,
                                                        "structural_tag": json.dumps(tag)}}),
    ):  # fmt: skip
        r = _post(stack, path, body)
        assert r.status_code == 200, r.text
        assert stack.engine.seen[-1].sampling.regex == pattern, path


def test_tokenize_detokenize_roundtrip(stack):
    r = _post(stack, "/v1/tokenize", {"prompt": "hello world"}).json()
    assert r["tokens"] == stack.codec.encode("hello world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 512
    assert _post(stack, "/v1/detokenize", {"tokens": r["tokens"]}).json() == {"text": "hello world"}
    r = _post(stack, "/v1/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert r["tokens"][0] == 1


def test_client_disconnect_aborts_the_request(stack):
    body = json.dumps({**CHAT, "messages": [{"role": "user", "content": "SLOW please"}],
                       "stream": True, "rid": "gone-1"}).encode()  # fmt: skip
    s = socket.create_connection(("127.0.0.1", stack.port), timeout=10)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)  # fmt: skip
    got = b""
    while b"data: " not in got:  # the stream started
        chunk = s.recv(4096)
        assert chunk, got
        got += chunk
    s.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if any(a.request_id == "gone-1" for a in stack.engine.aborts):
            break
        time.sleep(0.02)
    (abort,) = [a for a in stack.engine.aborts if a.request_id == "gone-1"]
    assert abort.reason == "disconnect"
    assert "gone-1" not in stack.engine.running


def test_health_metrics_info_and_flush(stack):
    assert requests.get(stack.url + "/health", timeout=5).status_code == 200

    def scrape():
        text = requests.get(stack.url + "/metrics", timeout=5).text
        return text, {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line and not line.startswith("#") and "_bucket" not in line}  # fmt: skip

    _, before = scrape()
    assert requests.get(stack.url + "/health_generate", timeout=5).status_code == 200
    _, after = scrape()
    for name in ("sglang:num_requests_total", "sglang:prompt_tokens_total",
                 "sglang:e2e_request_latency_seconds_count"):  # fmt: skip
        assert after[name] == before[name], name  # probes are not counted
    _post(stack, "/v1/chat/completions", {**CHAT, "max_tokens": 4})
    text, values = scrape()
    ctype = requests.get(stack.url + "/metrics", timeout=5).headers["Content-Type"]
    assert ctype == "text/plain; version=0.0.4; charset=utf-8"
    assert values["sglang:prompt_tokens_total"] > 0
    assert values["sglang:generation_tokens_total"] >= 4
    assert values["sglang:time_to_first_token_seconds_count"] >= 1
    assert values["sglang:e2e_request_latency_seconds_count"] >= 1
    assert values["sglang:cache_hit_rate"] == 0.25  # from the scripted SchedulerStats
    assert 'model_name="smollm2"' in text
    assert "# TYPE sglang:inter_token_latency_seconds histogram" in text
    info = requests.get(stack.url + "/get_model_info", timeout=5).json()
    assert info["model_path"] == "/models/smollm2.gguf" and info["is_generation"] is True
    sinfo = requests.get(stack.url + "/get_server_info", timeout=5).json()
    assert sinfo["max_context_len"] == 512 and sinfo["internal_states"][0]["cache_hit_rate"] == 0.25
    assert sinfo["gateway"]["num_requests"] >= 1 and sinfo["gateway"]["shutting_down"] is False
    r = _post(stack, "/flush_cache", raw="")
    assert r.status_code == 200 and "7 pages" in r.text


def test_health_is_503_when_the_scheduler_is_stuck(stack):
    stack.engine.answer_pings = False
    try:
        r = requests.get(stack.url + "/health", timeout=5)
        _assert_error(r, 503, code="unhealthy")
    finally:
        stack.engine.answer_pings = True
    assert requests.get(stack.url + "/health", timeout=5).status_code == 200


def test_admin_abort_ends_a_running_request(stack):
    import threading

    result = {}

    def slow():
        result["r"] = _post(stack, "/generate", {"text": "SLOW", "rid": "adm-1"})

    t = threading.Thread(target=slow)
    t.start()
    deadline = time.monotonic() + 5
    while "adm-1" not in stack.engine.running and time.monotonic() < deadline:
        time.sleep(0.02)
    r = _post(stack, "/abort_request", {"rid": "adm-1"})
    assert r.json()["aborted"] == ["adm-1"]
    t.join(5)
    assert result["r"].json()["meta_info"]["finish_reason"] == {"type": "abort"}
    deadline = time.monotonic() + 5
    while "adm-1" in stack.engine.running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert any(a.request_id == "adm-1" and a.reason == "admin" for a in stack.engine.aborts)


def test_a_request_id_in_flight_cannot_be_reused(stack):
    import threading

    t = threading.Thread(target=lambda: _post(stack, "/generate", {"text": "SLOW", "rid": "dup-1"}))
    t.start()
    deadline = time.monotonic() + 5
    while "dup-1" not in stack.engine.running and time.monotonic() < deadline:
        time.sleep(0.02)
    r = _post(stack, "/generate", {"text": "x", "rid": "dup-1"})
    _assert_error(r, 400, param="rid", code="duplicate_request_id")
    assert _post(stack, "/abort_request", {"rid": "dup-1"}).json()["num_aborted"] == 1
    t.join(5)


def test_log_level_http_logs_one_line_per_request_at_that_level(stack_factory):
    import time
    import urllib.request

    import structlog

    s = stack_factory(log_level_http="warning")
    with structlog.testing.capture_logs() as logs:
        with urllib.request.urlopen(s.url + "/v1/models", timeout=10) as r:
            assert r.status == 200
        deadline = time.monotonic() + 5
        while not [e for e in logs if e["event"] == "http"] and time.monotonic() < deadline:
            time.sleep(0.01)
    (line,) = [e for e in logs if e["event"] == "http"]
    assert (line["path"], line["status"], line["method"]) == ("/v1/models", 200, "GET")
    assert line["log_level"] == "warning" and line["ms"] >= 0
