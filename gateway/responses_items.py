"""The Responses API's items and tools as the chat path takes them (responses_api.py).

Input items: `message` items (`role` and `content` as a string or `input_text` /
`output_text` parts), `function_call` items (`call_id`, `name`, `arguments`; a run of
them is one assistant turn with those tool calls) and `function_call_output` items
(`call_id`, `output`: a tool turn). Tools: `{"type": "function", "name", "description",
"parameters"}`, flat, as the Responses API writes them, nested under `function` for
the chat template. `stored_items` turns a stored response's own input back into items.
"""

from __future__ import annotations

from typing import Any

from shunter.bus.messages import ChatMessage
from shunter.gateway.errors import bad_request
from shunter.gateway.schemas import ChatMessageIn, ContentPart, FunctionCallIn, ToolCallIn
from shunter.gateway.validation import chat_messages

TEXT_PARTS = ("input_text", "output_text")


def _parts(i: int, content: Any) -> str | list[ContentPart]:
    """A message item's content: a string, or its text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"input[{i}].content must be a string or a list of parts",
                          param=f"input[{i}].content")  # fmt: skip
    parts = []
    for p in content:
        kind = p.get("type") if isinstance(p, dict) else type(p).__name__
        if kind not in TEXT_PARTS:
            raise bad_request(f"input[{i}].content: only text parts are supported, got {kind!r}",
                              param=f"input[{i}].content")  # fmt: skip
        text = p.get("text")
        if not isinstance(text, str):
            raise bad_request(f"input[{i}].content: a text part needs its text as a string",
                              param=f"input[{i}].content")  # fmt: skip
        parts.append(ContentPart("text", text))
    return parts


def _strings(i: int, item: dict, *names: str) -> list[str]:
    values = [item.get(n) for n in names]
    for n, v in zip(names, values, strict=True):
        if not isinstance(v, str):
            raise bad_request(f"input[{i}].{n} must be a string", param=f"input[{i}].{n}")
    return values  # type: ignore[return-value]


def input_messages(items: str | list[Any]) -> list[ChatMessage]:
    """A request's `input` as chat messages."""
    if isinstance(items, str):
        return chat_messages([ChatMessageIn("user", items)])
    if not items:
        raise bad_request("input must not be empty", param="input")
    out: list[ChatMessageIn] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else type(item).__name__
        if kind == "message":
            out.append(ChatMessageIn(str(item.get("role", "")), _parts(i, item.get("content"))))
        elif kind == "function_call":
            call_id, name, args = _strings(i, item, "call_id", "name", "arguments")
            call = ToolCallIn(FunctionCallIn(name, args), id=call_id)
            last = out[-1] if out else None
            if last is not None and last.role == "assistant" and last.tool_calls:
                last.tool_calls.append(call)  # one turn calls several
            else:
                out.append(ChatMessageIn("assistant", None, tool_calls=[call]))
        elif kind == "function_call_output":
            call_id, output = _strings(i, item, "call_id", "output")
            out.append(ChatMessageIn("tool", output, tool_call_id=call_id))
        else:
            raise bad_request(f"input[{i}]: message, function_call and function_call_output "
                              f"items are supported, got {kind!r}", param=f"input[{i}]")  # fmt: skip
    return chat_messages(out)


def chat_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """Responses tools ({type: function, name, ...}) in the chat form the templates take."""
    out = []
    for i, t in enumerate(tools):
        if not (isinstance(t, dict) and t.get("type") == "function"
                and isinstance(t.get("name"), str) and t["name"]):  # fmt: skip
            raise bad_request(f"tools[{i}] must be {{'type': 'function', 'name': ...}}",
                              param=f"tools[{i}]")  # fmt: skip
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        out.append({"type": "function", "function": fn})
    return out


def stored_items(response_id: str, own: list[ChatMessage]) -> list[dict]:
    """A stored response's own input messages as Responses items, oldest first."""
    items: list[dict] = []
    for m in own:
        if m.tool_calls:
            for c in m.tool_calls:
                fn = c.get("function") or {}
                items.append({"type": "function_call", "call_id": c.get("id", ""),
                              "name": fn.get("name", ""), "arguments": fn.get("arguments", "")})  # fmt: skip
        elif m.role == "tool":
            items.append({"type": "function_call_output", "call_id": m.tool_call_id or "",
                          "output": m.content})  # fmt: skip
        else:
            items.append({"type": "message", "role": m.role,
                          "content": [{"type": "input_text", "text": m.content}]})  # fmt: skip
    for i, item in enumerate(items):
        item["id"] = f"{response_id}_in{i}"
    return items
