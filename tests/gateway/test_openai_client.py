"""The OpenAI API through the real `openai` client, against the real gateway and
tokenizer with a scripted engine (see conftest.py)."""

from __future__ import annotations

import json
import pathlib

import openai
import pytest

REFERENCE = pathlib.Path(__file__).resolve().parents[1] / "data" / "smollm2_greedy_reference.json"


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=20)


def test_chat_completion_with_scripted_engine(client, stack):
    r = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Give me three tips for staying healthy."}],
    )
    (choice,) = r.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == stack.reply
    assert choice.finish_reason == "stop"
    assert r.object == "chat.completion" and r.model == "smollm2"
    # The real tokenizer applied the model's chat template: same ids as the reference.
    if REFERENCE.is_file():
        ref = json.loads(REFERENCE.read_text())["prompts"][0]
        assert stack.engine.seen[-1].input_ids == ref["input_ids"]
        assert r.usage.prompt_tokens == len(ref["input_ids"])
    assert r.usage.completion_tokens == len(stack.codec.encode(stack.reply)) + 1  # + eos
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_chunks_and_usage(client, stack):
    chunks = list(
        client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == stack.reply
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert all(c.id == chunks[0].id for c in chunks)


def test_chat_continues_the_final_message_when_asked(client, stack):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello, my"}]
    client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=2,
                                   extra_body={"continue_final_message": True})  # fmt: skip
    text = stack.codec.decode(stack.engine.seen[-1].input_ids, skip_special_tokens=False)
    assert text.endswith("assistant\nHello, my")  # left open, no generation prompt
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=2, extra_body={
            "continue_final_message": True, "add_generation_prompt": True})  # fmt: skip
    assert e.value.body["param"] == "continue_final_message"


def test_second_identical_prompt_reports_cached_tokens(client):
    msgs = [{"role": "user", "content": "cache me please"}]
    first = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=2)
    second = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1
    assert second.choices[0].finish_reason == "length"
    assert second.usage.completion_tokens == 2


def test_completions_n_echo_logprobs(client, stack):
    r = client.completions.create(
        model="smollm2", prompt="Say hi:", n=3, echo=True, logprobs=2, max_tokens=4, seed=7
    )
    assert len(r.choices) == 3
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    prefix = "".join(stack.codec.decode([i]) for i in stack.codec.encode(stack.reply)[:4])
    num_prompt = len(stack.codec.encode("Say hi:"))
    for c in r.choices:
        assert c.text == "Say hi:" + prefix
        assert c.finish_reason == "length"
        # echo + logprobs: the prompt's tokens come first (the first one unscored)
        assert len(c.logprobs.tokens) == num_prompt + 4
        assert c.logprobs.token_logprobs[num_prompt:] == [-0.25] * 4
        assert c.logprobs.token_logprobs[0] is None
        assert len(c.logprobs.top_logprobs[num_prompt]) == 2
        assert c.logprobs.text_offset[num_prompt] == len("Say hi:")
    seeds = sorted(t.sampling.seed for t in stack.engine.seen[-3:])
    assert seeds == [7, 8, 9]
    assert {t.request_id.rsplit("-", 1)[1] for t in stack.engine.seen[-3:]} == {"0", "1", "2"}
    # Prompt tokens are counted once per prompt, not once per choice.
    assert r.usage.prompt_tokens == len(stack.codec.encode("Say hi:"))
    assert r.usage.completion_tokens == 12


def test_completions_stream_with_stop_string(client):
    stream = client.completions.create(
        model="smollm2", prompt="x", stream=True, stop=["scripted"], max_tokens=50
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks)
    assert text == "Hello! I am a "
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_token_id_prompts_and_batches(client, stack):
    ids = stack.codec.encode("Tell me")
    r = client.completions.create(model="smollm2", prompt=[ids, ids[:1]], max_tokens=1, echo=True)
    assert len(r.choices) == 2
    assert r.choices[0].text.startswith("Tell me")
    assert stack.engine.seen[-1].input_ids in (ids, ids[:1])


def test_models_and_unknown_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["smollm2"]
    assert client.models.retrieve("smollm2").id == "smollm2"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert e.value.body["code"] == "model_not_found"


def test_client_errors_are_bad_requests(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2", prompt="x", max_tokens=100000)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2", prompt=[10**6], max_tokens=2)
    assert "vocabulary" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2", prompt=[5] * 600, max_tokens=2)
    assert e.value.body["code"] == "context_length_exceeded"


def test_echo_with_logprobs_scores_the_prompt(client, stack):
    prompt_ids = stack.codec.encode("Once upon a time")
    r = client.completions.create(model="smollm2", prompt="Once upon a time", echo=True,
                                  logprobs=1, max_tokens=2)  # fmt: skip
    lp = r.choices[0].logprobs
    n = len(prompt_ids)
    assert lp.tokens[:n] == [stack.codec.token_text(i) for i in prompt_ids]
    assert lp.token_logprobs[:n] == [None] + [-1.0] * (n - 1)
    assert lp.token_logprobs[n:] == [-0.25, -0.25]
    assert lp.top_logprobs[0] is None and len(lp.top_logprobs[n]) == 1
    assert stack.engine.seen[-1].sampling.logprob_start_len == 0


def test_streamed_echo_with_logprobs_matches_the_unstreamed_one(client, stack):
    kw = {"model": "smollm2", "prompt": "Once upon", "echo": True, "logprobs": 1, "max_tokens": 3}
    whole = client.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw)]
    assert "".join(c.text for c in chunks) == whole.text
    tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
    lps = [x for c in chunks if c.logprobs for x in c.logprobs.token_logprobs]
    assert tokens == whole.logprobs.tokens and lps == whole.logprobs.token_logprobs
    offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    assert offsets == whole.logprobs.text_offset  # cumulative, as in one response
    assert chunks[0].text.startswith("Once upon")
