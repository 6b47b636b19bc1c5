"""Function calling against the real server: with --tool-call-parser a chat request
takes tools and tool turns through the model's own chat template (the answers of the
default model are text: the parsing itself is tests/gateway/test_tool_calls.py's);
without it tools are a 400 that names the option."""

from __future__ import annotations

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {}}}}]  # fmt: skip


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
