"""Tool-call parsing (gateway/tool_calls.py): each format's calls are read from finished
answers; anything that is not a whole call stays text; streamed, content is released
as it comes and a call is never sent as text, wherever the deltas cut the marker."""

from __future__ import annotations

import json

import pytest

from shunter.gateway.tool_calls import Splitter, forced_regex, openai_calls, parse

QWEN_TWO = ('Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>')  # fmt: skip


def test_qwen25_calls_and_their_content():
    content, calls = parse("qwen25", QWEN_TWO)
    assert content == "Let me check."
    assert calls == [("weather", '{"city": "Paris"}'), ("time", "{}")]
    assert parse("hermes", QWEN_TWO) == (content, calls)
    only = '<tool_call>{"name": "f", "arguments": {"x": [1, 2]}}</tool_call>'
    assert parse("qwen25", only) == (None, [("f", '{"x": [1, 2]}')])
    unclosed = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}'  # the stop ate the tag
    assert parse("qwen25", unclosed) == (None, [("f", '{"x": 1}')])


@pytest.mark.parametrize(
    "text",
    [
        "No tools needed: 2 + 2 = 4.",
        '<tool_call>\n{"name": "f", "arguments": {"x": ',  # cut off mid-call
        "<tool_call>not json</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f"}</tool_call> and then more words',
    ],
)  # fmt: skip
def test_what_is_not_a_whole_call_stays_text(text):
    assert parse("qwen25", text) == (text, [])


def test_llama3_json_calls():
    one = '{"name": "weather", "parameters": {"city": "Paris; France"}}'
    assert parse("llama3", one) == (None, [("weather", '{"city": "Paris; France"}')])
    two = one + '; {"name": "time", "arguments": {"tz": "UTC"}}'
    assert parse("llama3", two)[1] == [("weather", '{"city": "Paris; France"}'),
                                       ("time", '{"tz": "UTC"}')]  # fmt: skip
    for text in ("Hello there.", '{"not": "a call"}', '{"name": "f", "parameters": {'):
        assert parse("llama3", text) == (text, [])


def test_mistral_json_array_calls():
    two = '[{"name": "weather", "arguments": {"city": "Paris"}}, {"name": "time", "arguments": {}}]'
    want = [("weather", '{"city": "Paris"}'), ("time", "{}")]
    assert parse("mistral", two) == (None, want)
    assert parse("mistral", "[TOOL_CALLS] " + two) == (None, want)  # the tag kept as text
    for text in ("[a link](http://x) to read", "[]", '[{"arguments": {}}]', "Plain."):
        assert parse("mistral", text) == (text, [])


def test_pythonic_calls_are_read_not_run():
    text = '[get_weather(city="Paris", days=[1, 2]), now()]'
    assert parse("pythonic", text) == (None, [("get_weather", '{"city": "Paris", "days": [1, 2]}'),
                                               ("now", "{}")])  # fmt: skip
    for bad in ("[f(1)]", "[__import__('os').system('x')]", "[f(a=g())]", "[x]", "[f(a=1)",
                "Plain [f(a=1)] text"):  # fmt: skip
        assert parse("pythonic", bad) == (bad, [])


@pytest.mark.parametrize("parser, text", [("qwen25", QWEN_TWO), ("qwen25", "Plain <tool text."),
                                          ("llama3", '{"name": "f", "parameters": {"a": 1}}'),
                                          ("llama3", "Plain text {not json}"),
                                          ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {}}]'),
                                          ("mistral", "[a link](x) then text"),
                                          ("pythonic", '[f(a="x;y")]')])  # fmt: skip
@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_streaming_releases_content_and_holds_calls(parser, text, size):
    s = Splitter(parser)
    sent = "".join(s.push(text[i : i + size]) for i in range(0, len(text), size))
    rest, calls = s.finish()
    content, want_calls = parse(parser, text)
    assert calls == want_calls
    if calls:
        assert "<tool_call" not in sent + rest and '"name"' not in sent + rest
        assert (sent + rest).strip() == (content or "")
    else:
        assert sent + rest == text


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "now"}}


@pytest.mark.parametrize(
    ("parser", "answer"),
    [
        ("qwen25", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                   '"days": 2}}\n</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}'
                   '\n</tool_call>'),
        ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
                   '{"name": "now", "parameters": {}}'),
        ("mistral", '[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
                    '{"name": "now", "arguments": {}}]'),
        ("pythonic", '[get_weather(city="Paris", days=2), now()]'),
    ],
)  # fmt: skip
def test_a_required_call_pattern_takes_the_formats_calls_and_nothing_else(parser, answer):
    """tool_choice "required": one or more calls in the parser's format, whose arguments
    have their function's shape; a named call: that function's, once."""
    import re

    pattern = forced_regex(parser, [WEATHER, CLOCK], None)
    assert re.fullmatch(pattern, answer)
    assert [name for name, _ in parse(parser, answer)[1]] == ["get_weather", "now"]
    assert not re.fullmatch(pattern, "It is sunny.")
    assert not re.fullmatch(pattern, answer.replace('"days": 2', '"days": "two"')
                            .replace("days=2", 'days="two"'))  # fmt: skip
    named = forced_regex(parser, [WEATHER, CLOCK], "now")
    assert not re.fullmatch(named, answer)  # two calls, and one of another function
    one = forced_regex(parser, [WEATHER, CLOCK], None, many=False)  # parallel_tool_calls false
    assert not re.fullmatch(one, answer)
    assert re.fullmatch(one, forced_answer(parser, "now"))
    assert re.fullmatch(named, forced_answer(parser, "now"))
    with pytest.raises(ValueError, match="not among the tools"):
        forced_regex(parser, [WEATHER], "now")


def forced_answer(parser: str, name: str) -> str:
    call = json.dumps({"name": name, "parameters" if parser == "llama3" else "arguments": {}})
    return {"qwen25": f"<tool_call>\n{call}\n</tool_call>", "llama3": call,
            "mistral": f"[{call}]", "pythonic": f"[{name}()]"}[parser]  # fmt: skip


def test_pythonic_call_arguments_are_python_literals_of_their_schema():
    import re

    fn = {"type": "function", "function": {"name": "book", "parameters": {
        "type": "object", "required": ["when"], "properties": {
            "when": {"type": "string", "format": "date"}, "vip": {"type": "boolean"},
            "note": {"type": ["string", "null"]}, "tags": {"type": "array", "items": {"enum": [1, True, None]}}}}}}  # fmt: skip
    pattern = forced_regex("pythonic", [fn], "book")
    good = '[book(when="2025-01-31", vip=True, note=None, tags=[1, True, None])]'
    assert re.fullmatch(pattern, good)
    assert parse("pythonic", good)[1] == [("book", '{"when": "2025-01-31", "vip": true, '
                                                   '"note": null, "tags": [1, true, null]}')]  # fmt: skip
    assert re.fullmatch(pattern, '[book(when="2025-01-31")]')  # the optional ones left out
    for bad in ('[book(vip=True)]', '[book(when="2025-01-31", vip=true)]',
                '[book(when="2025-13-01")]', '[book(when="2025-01-31", note=null)]'):  # fmt: skip
        assert not re.fullmatch(pattern, bad), bad


def test_a_required_call_is_refused_where_it_cannot_be_written():
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
           "properties": {"x": {"type": "string", "format": "isbn"}}}}}  # fmt: skip
    with pytest.raises(ValueError, match=r"function 'f'.*format 'isbn'"):
        forced_regex("qwen25", [bad], None)


def test_openai_shape():
    out = openai_calls([("f", '{"a": 1}')], ["call_1"])
    assert out == [{"id": "call_1", "type": "function",
                    "function": {"name": "f", "arguments": '{"a": 1}'}}]  # fmt: skip
    assert json.loads(out[0]["function"]["arguments"]) == {"a": 1}


# -- through the gateway (real HTTP, the openai client, the scripted engine) ----------------

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip


@pytest.fixture(scope="module")
def tool_client(stack_factory):
    import openai

    s = stack_factory(tool_call_parser="qwen25")
    return openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=30)


def _ask(client, text, **kw):
    kw.setdefault("tools", TOOLS)
    return client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": text}], **kw
    )


def test_a_tool_call_comes_back_as_one(tool_client):
    out = _ask(tool_client, "TOOLCALL What is the weather in Paris?").choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content == "Checking."
    (call,) = out.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    plain = _ask(tool_client, "Hello").choices[0]  # no call in the answer: text as it is
    assert plain.message.tool_calls is None and plain.finish_reason == "stop"
    raw = _ask(tool_client, "TOOLCALL again", tool_choice="none").choices[0]
    assert raw.message.tool_calls is None and "<tool_call>" in raw.message.content


def test_a_streamed_tool_call_never_shows_as_text(tool_client):
    content, calls, finish = "", {}, None
    for chunk in _ask(tool_client, "TOOLCALL weather?", stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for c in delta.tool_calls or []:
            calls.setdefault(c.index, []).append(c)
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Checking." and finish == "tool_calls"
    (call,) = calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_a_conversation_with_tool_turns_runs(tool_client):
    out = tool_client.chat.completions.create(model="smollm2", tools=TOOLS, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ])  # fmt: skip
    assert out.choices[0].message.content and out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0]"),
    ],
)  # fmt: skip
def test_what_tools_cannot_do_here_is_a_400(tool_client, extra, param):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        _ask(tool_client, "Hello", **extra)
    assert e.value.body["param"] == param


def test_the_server_flag_names_the_gateway_parsers():
    from shunter.gateway.tool_calls import PARSERS
    from shunter.ops.server_args import TOOL_CALL_PARSERS
    from shunter.ops.server_cli import parse_server_args

    assert TOOL_CALL_PARSERS == PARSERS
    assert parse_server_args(["--tool-call-parser", "hermes"]).tool_call_parser == "hermes"
    with pytest.raises((SystemExit, ValueError)):
        parse_server_args(["--tool-call-parser", "nope"])


RESPONSE_TOOLS = [{"type": "function", "name": "get_weather",
                   "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]  # fmt: skip


def test_responses_return_calls_as_function_call_items(tool_client):
    r = tool_client.responses.create(model="smollm2", input="TOOLCALL weather?",
                                     tools=RESPONSE_TOOLS)  # fmt: skip
    assert r.status == "completed" and [o.type for o in r.output] == ["message", "function_call"]
    assert r.output_text == "Checking."
    call = r.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    # the call's answer continues the stored conversation
    follow = tool_client.responses.create(model="smollm2", previous_response_id=r.id,
                                          tools=RESPONSE_TOOLS, input=[{
        "type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])  # fmt: skip
    items = tool_client.responses.input_items.list(follow.id).data
    assert [(i.type, i.call_id, i.output) for i in items] == [
        ("function_call_output", call.call_id, "sunny")]  # fmt: skip
    plain = tool_client.responses.create(model="smollm2", input="Hello", tools=RESPONSE_TOOLS)
    assert [o.type for o in plain.output] == ["message"] and plain.output_text


def test_responses_stream_a_call_as_its_events(tool_client):
    events = list(tool_client.responses.create(model="smollm2", input="TOOLCALL weather?",
                                               tools=RESPONSE_TOOLS, stream=True))  # fmt: skip
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == "Checking."  # the call never streams as text
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == {"city": "Paris"}
    final = events[-1].response
    assert [o.type for o in final.output] == ["message", "function_call"]
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_strict_tools_hold_auto_answers_to_prose_and_whole_calls():
    from shunter.actors.grammar.token_fsm import constraint_nfa
    from shunter.gateway.tool_calls import strict_regex

    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    assert strict_regex("qwen25", [WEATHER, CLOCK]) == ""  # no strict tool: unconstrained
    accepts = constraint_nfa(strict_regex("qwen25", [strict, CLOCK])).fullmatch
    good = ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris", "days": 2}}\n</tool_call>')  # fmt: skip
    assert accepts("It is sunny in Paris.") and accepts(good)
    assert accepts('<tool_call>\n{"name": "now", "arguments": {"any": [1]}}\n</tool_call>')
    assert parse("qwen25", good)[1] == [("get_weather", '{"city": "Paris", "days": 2}')]
    for bad in (good.replace('"days": 2', '"days": "two"'), good[:-3],
                '<tool_call>\n{"name": "lookup", "arguments": {}}\n</tool_call>'):  # fmt: skip
        assert not accepts(bad), bad


@pytest.mark.parametrize(
    ("parser", "call", "other", "bad"),
    [
        ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}',
         '{"name": "now", "parameters": {"any": [1]}}',
         '{"name": "get_weather", "parameters": {"city": "Paris", "days": "two"}}'),
        ("mistral", '[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]',
         '[{"name": "now", "arguments": {"any": [1]}}]',
         '[{"name": "get_weather", "arguments": {"city": 3}}]'),
        ("pythonic", '[get_weather(city="Paris", days=2)]', '[now(any=[1])]',
         '[get_weather(city="Paris", days="two")]'),
    ],
)  # fmt: skip
def test_strict_tools_in_call_only_formats_allow_prose_or_whole_calls(parser, call, other, bad):
    """llama3, mistral and pythonic answers are calls only: with a strict tool the answer
    is prose not starting as calls do, or calls whose strict arguments fit the schema."""
    from shunter.actors.grammar.token_fsm import constraint_nfa
    from shunter.gateway.tool_calls import strict_regex

    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    assert strict_regex(parser, [WEATHER, CLOCK]) == ""
    accepts = constraint_nfa(strict_regex(parser, [strict, CLOCK])).fullmatch
    for good in ("It is sunny in Paris.", "", "  \n", "Sure: " + call, call, " " + call, other):
        assert accepts(good), good
    assert parse(parser, call)[1][0][0] == "get_weather"
    for no in (bad, call[:-1], call + " and more", call[0] + " not a call"):
        assert not accepts(no), no
    two = {"llama3": call + "; " + call, "mistral": call[:-1] + ", " + call[1:],
           "pythonic": call[:-1] + ", " + call[1:]}[parser]  # fmt: skip
    assert accepts(two) and not accepts(two.replace("Paris", "Paris" + chr(34)))
