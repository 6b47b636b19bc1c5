"""API keys, and what clients see when an actor dies (real gateway and tokenizer,
scripted engine; see conftest.py)."""

from __future__ import annotations

import json
import threading
import time

import openai
import pytest
import requests

from shunter.bus.messages import ActorDied

CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def keyed(stack_factory):
    return stack_factory(api_key="user-key", admin_api_key="admin-key")


def _get(stack, path, key=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.get(stack.url + path, headers=headers, timeout=10)


def _post(stack, path, body, key=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.post(stack.url + path, json=body, headers=headers, timeout=10)


@pytest.mark.parametrize("path", ["/v1/models", "/health", "/get_model_info", "/metrics"])
def test_every_endpoint_needs_the_key(keyed, path):
    for key in (None, "wrong-key"):
        r = _get(keyed, path, key)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert _get(keyed, path, "user-key").status_code == 200
    assert _get(keyed, path, "admin-key").status_code == 200


def test_openai_client_with_and_without_key(keyed):
    good = openai.OpenAI(base_url=keyed.url + "/v1", api_key="user-key", max_retries=0)
    assert good.chat.completions.create(**CHAT).choices[0].message.content
    bad = openai.OpenAI(base_url=keyed.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(**CHAT)


def test_admin_endpoints_need_the_admin_key(keyed):
    for key in (None, "user-key"):
        r = _post(keyed, "/abort_request", {"abort_all": True}, key)
        assert r.status_code == 401 and "admin" in r.json()["error"]["message"]
    r = _post(keyed, "/abort_request", {"abort_all": True}, "admin-key")
    assert r.status_code == 200 and r.json()["success"] is True


def test_actor_died_fails_in_flight_requests_and_health(stack_factory):
    s = stack_factory()
    result = {}

    def stream():
        body = {**CHAT, "messages": [{"role": "user", "content": "SLOW"}], "stream": True,
                "max_tokens": 400}  # fmt: skip
        r = requests.post(s.url + "/v1/chat/completions", json=body, stream=True, timeout=20)
        result["events"] = b"".join(r.iter_content(None)).split(b"\n\n")

    def plain():
        body = {**CHAT, "messages": [{"role": "user", "content": "SLOW too"}], "max_tokens": 400}
        result["plain"] = requests.post(s.url + "/v1/chat/completions", json=body, timeout=20)

    threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 5
    while len(s.engine.running) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(s.engine.running) == 2
    s.publish(ActorDied("executor.0", "segfault"))
    for t in threads:
        t.join(10)
        assert not t.is_alive()
    # The non-streaming request gets a 503 with the reason.
    r = result["plain"]
    assert r.status_code == 503
    assert "executor.0 died (segfault)" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "actor_died"
    # The stream ends with an error event, then [DONE].
    events = result["events"]
    assert events[-2:] == [b"data: [DONE]", b""]
    assert json.loads(events[-3][len(b"data: ") :])["error"]["code"] == "actor_died"
    # From now on the server says it is unhealthy and refuses new work, without hanging.
    assert requests.get(s.url + "/health", timeout=5).status_code == 503
    r = requests.post(s.url + "/v1/chat/completions", json=CHAT, timeout=5)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"


def test_silent_engine_times_out_with_504_and_abort(stack_factory):
    s = stack_factory(request_timeout_s=0.3)
    body = {**CHAT, "messages": [{"role": "user", "content": "MUTE"}], "rid": "mute-1"}
    t0 = time.monotonic()
    r = requests.post(s.url + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    assert time.monotonic() - t0 < 5
    deadline = time.monotonic() + 5
    while not s.engine.aborts and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [a.request_id for a in s.engine.aborts] == ["mute-1"]


def test_non_streaming_disconnect_aborts(stack_factory):
    import socket

    s = stack_factory()
    body = json.dumps({**CHAT, "messages": [{"role": "user", "content": "SLOW"}],
                       "max_tokens": 400, "rid": "quiet-1"}).encode()  # fmt: skip
    sock = socket.create_connection(("127.0.0.1", s.port), timeout=10)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)  # fmt: skip
    deadline = time.monotonic() + 5
    while "quiet-1" not in s.engine.running and time.monotonic() < deadline:
        time.sleep(0.02)
    sock.close()
    while not s.engine.aborts and time.monotonic() < deadline + 5:
        time.sleep(0.02)
    assert [(a.request_id, a.reason) for a in s.engine.aborts] == [("quiet-1", "disconnect")]


def test_shutdown_refuses_new_requests(stack_factory):
    from shunter.bus.messages import Shutdown

    s = stack_factory()
    assert requests.post(s.url + "/v1/chat/completions", json=CHAT, timeout=10).status_code == 200
    s.publish(Shutdown("SIGTERM", 5.0))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        r = requests.post(s.url + "/v1/chat/completions", json=CHAT, timeout=10)
        if r.status_code != 200:
            break
        time.sleep(0.02)
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
