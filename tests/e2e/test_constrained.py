"""Constrained decoding end to end on the real server and model: `regex`,
`json_schema`, `ebnf` and `structural_tag` (SGLang's /generate, and as extra fields or
response_format types of chat), `response_format` json_schema and json_object
through the `openai` client; the output matches whole or parses, streamed or not; the
forms that are not supported are 400s that name their parameter."""

from __future__ import annotations

import json
import re

import openai
import pytest

from tests.e2e.conftest import call_json as post


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", timeout=300,
                         max_retries=0)  # fmt: skip


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "likes": {"type": "array", "items": {"enum": ["tea", "coffee", "cake"]}, "maxItems": 3},
        "badge": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
        "born": {"type": "string", "format": "date"},
    },
    "required": ["name", "age", "likes", "badge", "born"],
}


def test_generate_with_a_regex_ends_on_a_whole_match(server):
    status, out = post(server, "/generate", {
        "text": "Is the sky blue? Answer yes or no.\nAnswer:",
        "sampling_params": {"temperature": 0, "max_new_tokens": 16, "regex": " ?(yes|no)"},
    })  # fmt: skip
    assert status == 200, out
    assert re.fullmatch(" ?(yes|no)", out["text"]), out["text"]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chat_json_schema_output_parses_and_has_the_schema_shape(client, model, temperature):
    r = client.chat.completions.create(
        model=model, temperature=temperature, seed=3, max_tokens=96,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    )  # fmt: skip
    data = json.loads(r.choices[0].message.content)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(data["name"], str) and len(data["name"]) <= 24
    assert isinstance(data["age"], int) and 18 <= data["age"] <= 99
    assert set(data["likes"]) <= {"tea", "coffee", "cake"} and len(data["likes"]) <= 3
    assert re.fullmatch("[A-Z]{3}-[0-9]{2}", data["badge"]), data
    assert re.fullmatch("[0-9]{4}-[0-9]{2}-[0-9]{2}", data["born"]), data


def test_streamed_json_object_parses_or_is_a_json_prefix_cut_by_the_length(client, model):
    """Strings have no bound in json_object, so max_tokens may end the output inside
    one (finish_reason "length", as OpenAI's API warns); what came is still a prefix of
    a JSON object."""
    import regex

    from shunter.actors.grammar.json_schema import json_object

    chunks = list(client.chat.completions.create(
        model=model, temperature=0, max_tokens=200, stream=True,
        messages=[{"role": "user", "content": "Give me a small JSON object about Paris."}],
        response_format={"type": "json_object"},
    ))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    if finish == "stop":
        assert isinstance(json.loads(text), dict), text
    else:
        assert finish == "length" and regex.fullmatch(json_object(), text, partial=True), text


def test_generate_json_schema_as_sglang_takes_it(server):
    status, out = post(server, "/generate", {
        "text": "A person in JSON:", "sampling_params": {
            "temperature": 0, "max_new_tokens": 96, "json_schema": json.dumps(PERSON)},
    })  # fmt: skip
    assert status == 200, out
    assert set(json.loads(out["text"])) == set(PERSON["properties"])


CAPITALS = """root ::= city | description
city ::= "London" | "Paris" | "Berlin" | "Rome"
description ::= city " is " status
status ::= "the capital of " country
country ::= "England" | "France" | "Germany" | "Italy"
"""
CAPITALS_RE = "(London|Paris|Berlin|Rome)( is the capital of (England|France|Germany|Italy))?"


def test_generate_and_chat_with_an_ebnf_grammar_derive_a_sentence_of_it(server, client, model):
    status, out = post(server, "/generate", {
        "text": "The capital of France is", "sampling_params": {
            "temperature": 0, "max_new_tokens": 32, "ebnf": CAPITALS}})  # fmt: skip
    assert status == 200, out
    assert re.fullmatch(CAPITALS_RE, out["text"]), out["text"]
    r = client.chat.completions.create(
        model=model, temperature=1.0, seed=4, max_tokens=32, extra_body={"ebnf": CAPITALS},
        messages=[{"role": "user", "content": "Name a European capital."}])  # fmt: skip
    assert re.fullmatch(CAPITALS_RE, r.choices[0].message.content), r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"


def test_chat_with_a_structural_tag_answers_in_prose_or_well_formed_calls(client, model):
    from shunter.actors.grammar.json_schema import schema_regex

    schema = {"type": "object", "required": ["city"],
              "properties": {"city": {"type": "string", "maxLength": 20}}}  # fmt: skip
    tag = {"type": "structural_tag", "triggers": ["<function="], "structures": [
        {"begin": "<function=get_weather>", "schema": schema, "end": "</function>"}]}  # fmt: skip
    r = client.chat.completions.create(
        model=model, temperature=0, max_tokens=48, response_format=tag,
        messages=[{"role": "user", "content": "Call <function=get_weather> for Paris."}],
    )  # fmt: skip
    text = r.choices[0].message.content
    free = r"(?:(?!<function=)[\s\S])*"
    call = re.escape("<function=get_weather>") + schema_regex(schema) + re.escape("</function>")
    if r.choices[0].finish_reason == "stop":
        assert re.fullmatch(f"{free}(?:{call}{free})*", text), text
    else:  # cut by max_tokens: what came is a prefix of such a text
        import regex

        assert regex.fullmatch(f"{free}(?:{call}{free})*", text, partial=True), text


def test_chat_and_generate_with_a_format_object_structural_tag_keep_to_it(server, client, model):
    """The format-object form (xgrammar's): a fixed lead-in then exactly one call on chat,
    a sequence of a const_string, an `or` and a const_string on /generate (SGLang's
    sampling_params.structural_tag, as JSON text)."""
    from shunter.actors.grammar.json_schema import schema_regex

    schema = {"type": "object", "required": ["city"],
              "properties": {"city": {"type": "string", "maxLength": 20}}}  # fmt: skip
    call = {"type": "tag", "begin": "<function=get_weather>", "end": "</function>",
            "content": {"type": "json_schema", "json_schema": schema}}  # fmt: skip
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "Calling: "},
        {"type": "triggered_tags", "triggers": ["<function="], "tags": [call],
         "at_least_one": True, "stop_after_first": True}]}}  # fmt: skip
    r = client.chat.completions.create(
        model=model, temperature=0, max_tokens=64, response_format=tag,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
    )  # fmt: skip
    text = r.choices[0].message.content
    whole = (
        re.escape("Calling: <function=get_weather>")
        + schema_regex(schema)
        + re.escape("</function>")
    )
    assert r.choices[0].finish_reason == "stop", text
    assert re.fullmatch(whole, text), text
    answer = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "The answer is "},
        {"type": "or", "elements": [{"type": "const_string", "value": v} for v in ("yes", "no")]},
        {"type": "const_string", "value": "."}]}}  # fmt: skip
    status, out = post(server, "/generate", {
        "text": "Is the sky blue?", "sampling_params": {
            "temperature": 0, "max_new_tokens": 16, "structural_tag": json.dumps(answer)}})  # fmt: skip
    assert status == 200, out
    assert re.fullmatch(r"The answer is (yes|no)\.", out["text"]), out["text"]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"regex": "a(?=b)"}, None, "lookaround"),
        ({"json_schema": {"type": "string", "pattern": "a(?=b)"}}, "json_schema", "lookaround"),
        ({"ebnf": "root ::= 'a' b"}, "ebnf", "not defined"),
        (
            {"structural_tag": {"type": "structural_tag", "triggers": ["<f"]}},
            "structural_tag",
            "structures",
        ),
        (
            {
                "response_format": {
                    "type": "structural_tag",
                    "format": {
                        "type": "triggered_tags",
                        "triggers": ["<f"],
                        "tags": [{"begin": "<g>", "content": {"type": "any_text"}, "end": "</g>"}],
                    },
                }
            },
            "response_format",
            "format.tags[0].begin '<g>' starts with none of the triggers",
        ),
        ({"regex": "a", "json_schema": {"type": "integer"}}, "json_schema", "at most one"),
        ({"response_format": {"type": "xml"}}, "response_format", "xml"),
    ],
)
def test_unsupported_constraints_are_400s_that_say_why(server, body, param, words):
    status, err = post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body})  # fmt: skip
    assert status == 400, err
    assert set(err["error"]) == {"message", "type", "param", "code"}, err  # OpenAI's shape
    assert words in err["error"]["message"]
    if param:
        assert err["error"]["param"] == param
