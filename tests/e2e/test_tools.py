"""Function calling against the real server: with --tool-call-parser a chat request
takes tools and tool turns through the model's own chat template (the answers of the
default model are text: the parsing itself is tests/gateway/test_tool_calls.py's);
without it tools are a 400 that names the option."""

from __future__ import annotations

import json

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {}}}}]  # fmt: skip
CITY = {"type": "object", "required": ["city"],
        "properties": {"city": {"type": "string", "maxLength": 20}}}  # fmt: skip
CITY_TOOLS = [{"type": "function", "function": {"name": n, "parameters": CITY}}
              for n in ("get_weather", "get_time")]  # fmt: skip


def test_tools_need_the_parser_and_run_with_it(server, start_server, call, tmp_path):
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS,
            "max_tokens": 4, "temperature": 0}  # fmt: skip
    status, out = call(server, "/v1/chat/completions", body)
    assert status == 400 and "--tool-call-parser" in out["error"]["message"], out
    with start_server(tmp_path / "tools", "embedded", "--tool-call-parser", "qwen25") as s:
        status, out = call(s, "/v1/chat/completions", body)
        assert status == 200, out
        choice = out["choices"][0]
        assert isinstance(choice["message"]["content"], str)
        assert choice["finish_reason"] in ("stop", "length", "tool_calls")
        turns = [*body["messages"],
                 {"role": "assistant", "content": None, "tool_calls": [{
                     "id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{}"}}]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]  # fmt: skip
        status, out = call(s, "/v1/chat/completions", {**body, "messages": turns})
        assert status == 200 and out["usage"]["prompt_tokens"] > 0, out
        # tool_choice "required": the answer is constrained to calls, so even this
        # model, which never writes one of its own accord, answers with one
        # (parallel_tool_calls false: exactly one call; this model would go on calling)
        forced = {**body, "tools": CITY_TOOLS, "tool_choice": "required", "max_tokens": 64,
                  "parallel_tool_calls": False}  # fmt: skip
        for extra in ({}, {"tool_choice": {"type": "function", "function": {"name": "get_time"}}}):
            status, out = call(s, "/v1/chat/completions", {**forced, **extra})
            assert status == 200, out
            choice = out["choices"][0]
            assert choice["finish_reason"] == "tool_calls", choice
            calls = choice["message"]["tool_calls"]
            assert calls and all(
                c["function"]["name"] in ("get_weather", "get_time") for c in calls
            )
            args = json.loads(calls[0]["function"]["arguments"])
            assert isinstance(args["city"], str) and len(args["city"]) <= 20
            if extra:
                assert [c["function"]["name"] for c in calls] == ["get_time"]
        # a strict tool with tool_choice auto: prose, or whole calls of the tools
        strict = [{"type": "function", "function": {**t["function"], "strict": True}}
                  for t in CITY_TOOLS]  # fmt: skip
        status, out = call(s, "/v1/chat/completions", {**body, "tools": strict, "max_tokens": 48})
        assert status == 200, out
        for c in out["choices"][0]["message"].get("tool_calls") or []:
            assert isinstance(json.loads(c["function"]["arguments"])["city"], str)
        # the Responses API takes the same choices (a named one in its own shape)
        resp_tools = [{"type": "function", "name": t["function"]["name"],
                       "parameters": CITY} for t in CITY_TOOLS]  # fmt: skip
        for choice in ("required", {"type": "function", "name": "get_time"}):
            status, out = call(s, "/v1/responses", {
                "input": "Weather in Paris?", "tools": resp_tools, "tool_choice": choice,
                "parallel_tool_calls": False, "max_output_tokens": 64, "temperature": 0})  # fmt: skip
            assert status == 200, out
            items = [o for o in out["output"] if o["type"] == "function_call"]
            assert len(items) == 1 and items[0]["name"] in ("get_weather", "get_time"), out
            assert isinstance(json.loads(items[0]["arguments"])["city"], str)
            if isinstance(choice, dict):
                assert items[0]["name"] == "get_time"
            assert out["parallel_tool_calls"] is False


def test_a_required_call_in_the_pythonic_format(start_server, call, tmp_path):
    """--tool-call-parser pythonic: tool_choice "required" holds the answer to a Python
    list of calls whose keyword arguments are literals of the parameters' schema."""
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": CITY_TOOLS,
            "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 64,
            "temperature": 0}  # fmt: skip
    with start_server(tmp_path / "pythonic", "embedded", "--tool-call-parser", "pythonic") as s:
        status, out = call(s, "/v1/chat/completions", body)
        assert status == 200, out
        choice = out["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        (c,) = choice["message"]["tool_calls"]
        assert c["function"]["name"] in ("get_weather", "get_time")
        args = json.loads(c["function"]["arguments"])
        assert isinstance(args["city"], str) and len(args["city"]) <= 20
        # strict tools with tool_choice auto: prose, or calls whose arguments fit
        strict = [{"type": "function", "function": {**t["function"], "strict": True}}
                  for t in CITY_TOOLS]  # fmt: skip
        status, out = call(s, "/v1/chat/completions",
                           {**body, "tools": strict, "tool_choice": "auto", "max_tokens": 48})  # fmt: skip
        assert status == 200, out
        for c in out["choices"][0]["message"].get("tool_calls") or []:
            assert isinstance(json.loads(c["function"]["arguments"])["city"], str)
