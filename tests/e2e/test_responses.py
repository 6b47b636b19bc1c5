"""OpenAI's Responses API (/v1/responses) through the `openai` package against the real
server: the answer equals the chat endpoint's for the same conversation (greedy),
streamed or not, continued from a stored response or not; a cut-off answer is
"incomplete"; stored responses are retrieved and deleted; what is not served is a
400."""

from __future__ import annotations

import re

import openai
import pytest


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", timeout=300,
                         max_retries=0)  # fmt: skip


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _chat(client, model, messages, n):
    out = client.chat.completions.create(model=model, messages=messages, max_tokens=n,
                                         temperature=0)  # fmt: skip
    return out.choices[0]


def test_a_response_is_the_chat_answer(client, model):
    want = _chat(client, model, [{"role": "system", "content": "Answer briefly."},
                          {"role": "user", "content": "Name a color."}], 12)  # fmt: skip
    r = client.responses.create(model=model, input="Name a color.",
                                instructions="Answer briefly.", max_output_tokens=12,
                                temperature=0)  # fmt: skip
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == want.message.content
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    if want.finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed" and r.incomplete_details is None
    assert r.usage.output_tokens >= 1
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_message_items_and_a_stream_give_the_same_text(client, model):
    items = [
        {"role": "user", "content": "Say hello."},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Again."}]},
    ]
    want = _chat(client, model, [{"role": "user", "content": "Say hello."},
                          {"role": "assistant", "content": "Hello!"},
                          {"role": "user", "content": "Again."}], 3)  # fmt: skip
    r = client.responses.create(model=model, input=items, max_output_tokens=3,
                                temperature=0)  # fmt: skip
    assert r.output_text == want.message.content
    events = list(client.responses.create(model=model, input=items, max_output_tokens=3,
                                          temperature=0, stream=True))  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == want.message.content == events[-1].response.output_text
    assert events[-1].response.status == "incomplete"


def test_stored_responses_continue_and_go(client, model):
    first = client.responses.create(model=model, input="Name a fruit.", max_output_tokens=6,
                                    temperature=0, instructions="Be brief.")  # fmt: skip
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    second = client.responses.create(model=model, input="And a vegetable?", temperature=0,
                                     max_output_tokens=6, previous_response_id=first.id)  # fmt: skip
    assert second.previous_response_id == first.id
    want = _chat(client, model, [{"role": "user", "content": "Name a fruit."},
                                 {"role": "assistant", "content": first.output_text},
                                 {"role": "user", "content": "And a vegetable?"}], 6)  # fmt: skip
    assert second.output_text == want.message.content  # instructions not carried over
    items = client.responses.input_items.list(second.id, order="asc").data
    assert [(i.role, i.content[0].text) for i in items] == [("user", "And a vegetable?")]
    items = client.responses.input_items.list(first.id).data
    assert [(i.role, i.content[0].text) for i in items] == [("user", "Name a fruit.")]
    streamed = list(client.responses.create(model=model, input="Hi", max_output_tokens=2,
                                            temperature=0, stream=True))  # fmt: skip
    final = streamed[-1].response
    assert client.responses.retrieve(final.id).output_text == final.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)
    unstored = client.responses.create(model=model, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_a_json_schema_text_format_constrains_the_answer(client, model):
    """text.format json_schema (the Responses API's structured output): the answer
    parses with the schema's shape, and the response echoes the format."""
    import json

    schema = {"type": "object", "required": ["city", "rainy"],
              "properties": {"city": {"type": "string", "maxLength": 20},
                             "rainy": {"type": "boolean"}}}  # fmt: skip
    r = client.responses.create(
        model=model, input="The weather in Paris as JSON.", max_output_tokens=48,
        text={"format": {"type": "json_schema", "name": "weather", "schema": schema}},
    )  # fmt: skip
    data = json.loads(r.output_text)
    assert isinstance(data["city"], str) and isinstance(data["rainy"], bool)
    assert r.text.format.type == "json_schema" and r.text.format.name == "weather"


def test_a_structural_tag_text_format_keeps_to_it(client, model):
    """text.format structural_tag, both forms: the format object (a const_string, an
    `or`, a const_string) and the older structures/triggers form (free text and tagged
    calls whose bodies keep to their schema, or a prefix of such a text where
    max_output_tokens cut it); each is echoed back."""
    import regex

    from shunter.actors.grammar.json_schema import schema_regex

    fmt = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "The answer is "},
        {"type": "or", "elements": [{"type": "const_string", "value": v} for v in ("yes", "no")]},
        {"type": "const_string", "value": "."}]}}  # fmt: skip
    r = client.responses.create(model=model, input="Is the sky blue?", max_output_tokens=16,
                                temperature=0, text={"format": fmt})  # fmt: skip
    assert re.fullmatch(r"The answer is (yes|no)\.", r.output_text), r.output_text
    assert r.status == "completed" and r.text.format.type == "structural_tag"
    schema = {"type": "object", "required": ["city"],
              "properties": {"city": {"type": "string", "maxLength": 12}}}  # fmt: skip
    older = {"type": "structural_tag", "triggers": ["<f="],
             "structures": [{"begin": "<f=w>", "schema": schema, "end": "</f>"}]}  # fmt: skip
    r = client.responses.create(model=model, input="Call <f=w> for Paris.", temperature=0,
                                max_output_tokens=48, text={"format": older})  # fmt: skip
    free = r"(?:(?!<f=)[\s\S])*"
    call = re.escape("<f=w>") + schema_regex(schema) + re.escape("</f>")
    whole = f"{free}(?:{call}{free})*"
    cut = r.status == "incomplete"
    assert regex.fullmatch(whole, r.output_text, partial=cut), r.output_text
    assert r.text.format.type == "structural_tag"


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"previous_response_id": "resp_x"}, "previous_response_id"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
         "input[0].arguments"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
         "input[0].content"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "string",
                                                                          "pattern": "(?=a)"}}}},
         "text"),
        ({"text": {"format": {"type": "xml"}}}, "text"),
        ({"input": []}, "input"),
        ({"text": {"format": "json"}}, "text.format"),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": None}]}]},
         "input[0].content"),
        ({"input": [{"role": 5, "content": "hi"}]}, "messages[0].role"),
        ({"input": ["hi"]}, "input[0]"),
        ({"input": [{"role": "user", "content": {"a": 1}}]}, "input[0].content"),
        ({"tool_choice": "required"}, "tool_choice"),  # no tools to call
        ({"n": 2}, "n"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ],
)  # fmt: skip
def test_what_is_not_served_is_a_400(client, model, extra, param):
    body = {"model": model, "input": "hi", "max_output_tokens": 2, **extra}
    beyond = {k: body.pop(k) for k in ("n",) if k in body}  # not in the SDK's signature
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**body, extra_body=beyond)
    assert e.value.body["param"] == param
