"""The same gateway and tokenizer actors over ZMQ ipc through a real broker (each actor
its own ZmqBus), with the scripted engine: the actors do not depend on the transport."""

from __future__ import annotations

import openai
import pytest
import requests


@pytest.fixture(scope="module")
def zstack(stack_factory):
    return stack_factory(transport="zmq")


def test_openai_round_trip_over_zmq(zstack):
    client = openai.OpenAI(base_url=zstack.url + "/v1", api_key="x", max_retries=0, timeout=20)
    r = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "hi"}]
    )
    assert r.choices[0].message.content == zstack.reply
    chunks = list(client.completions.create(model="smollm2", prompt="x", stream=True, max_tokens=5))
    assert "".join(c.choices[0].text for c in chunks) == zstack.codec.decode(
        zstack.engine.reply_ids[:5]
    )
    assert chunks[-1].choices[0].finish_reason == "length"


def test_queries_and_health_over_zmq(zstack):
    r = requests.post(zstack.url + "/v1/tokenize", json={"prompt": "hello"}, timeout=10).json()
    assert r["tokens"] == zstack.codec.encode("hello")
    assert requests.get(zstack.url + "/health", timeout=10).status_code == 200
    r = requests.post(zstack.url + "/flush_cache", timeout=10)
    assert r.status_code == 200, r.text
