"""Random request bodies against the real gateway (real tokenizer, scripted engine):
whatever arrives, the answer is a 2xx or a 4xx with an OpenAI error body, never a 5xx
and never a hang."""

from __future__ import annotations

import json

import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.integers(-3, 600),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12),
)  # fmt: skip
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)  # fmt: skip

FIELDS = {
    "/v1/completions": ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n",
                        "stop", "logprobs", "echo", "seed", "logit_bias", "stream", "priority",
                        "presence_penalty", "stop_token_ids", "stream_options", "min_p"],
    "/v1/chat/completions": ["model", "messages", "max_tokens", "max_completion_tokens", "n",
                             "logprobs", "top_logprobs", "stop", "seed", "stream", "tools",
                             "response_format", "temperature", "logit_bias"],
    "/generate": ["text", "input_ids", "sampling_params", "stream", "return_logprob",
                  "logprob_start_len", "top_logprobs_num", "rid", "priority"],
    "/v1/tokenize": ["prompt", "messages", "add_special_tokens"],
    "/v1/detokenize": ["tokens"],
    "/v1/responses": ["model", "input", "instructions", "max_output_tokens", "temperature",
                      "top_p", "stream", "store", "previous_response_id", "text", "tools",
                      "metadata", "tool_choice"],
    "/v1/score": ["query", "items", "label_token_ids", "apply_softmax", "item_first", "model"],
}  # fmt: skip

good_messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"]),
                           "content": st.text(max_size=20)}), max_size=3)  # fmt: skip


@st.composite
def bodies(draw):
    path = draw(st.sampled_from(sorted(FIELDS)))
    names = draw(st.lists(st.sampled_from(FIELDS[path]), unique=True, max_size=6))
    body = {}
    for name in names:
        if name == "messages" and draw(st.booleans()):
            body[name] = draw(good_messages)
        elif name in ("prompt", "text", "input", "query") and draw(st.booleans()):
            body[name] = draw(st.text(max_size=30))
        else:
            body[name] = draw(values)
    return path, body


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=bodies())
def test_random_bodies_never_5xx(stack, case):
    path, body = case
    r = requests.post(stack.url + path, data=json.dumps(body), timeout=20,
                      headers={"Content-Type": "application/json"})  # fmt: skip
    assert r.status_code < 500, (path, body, r.text)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    elif body.get("stream") is True and path == "/v1/responses":
        last = [ln for ln in r.text.splitlines() if ln.startswith("event: ")][-1]
        assert last in ("event: response.completed", "event: response.incomplete",
                        "event: response.failed", "event: error"), r.text[-300:]  # fmt: skip
    elif body.get("stream") is True:
        assert r.text.endswith("data: [DONE]\n\n")
