"""Tool calls in a chat answer's text, as a model family writes them (SGLang's
`--tool-call-parser`), and the OpenAI shapes they are returned in.

Formats (PARSERS):
- "qwen25", alias "hermes" (Qwen2.5/Qwen3, Hermes and the many models trained on its
  format): each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
  the text before the first call is the message's content.
- "llama3" (Llama 3.1/3.2 JSON tool calling): the whole answer is a JSON object
  `{"name": ..., "parameters": {...}}`, or several joined by ";".
- "mistral": the whole answer is `[TOOL_CALLS]` (a special token, so usually skipped
  from the text) and a JSON array of `{"name": ..., "arguments": {...}}`.
- "pythonic" (Llama 3.2/4 and others): the whole answer is a Python list of calls with
  keyword arguments, `[get_weather(city="Paris"), now()]`, read with `ast` (literals
  only: nothing is evaluated); a forced call's arguments are Python literals of its
  schema (json_schema.keyword_args_regex).

Theory of operation: `parse` reads a finished answer into (content, calls). A call
whose JSON does not parse, or lacks a name, leaves the whole answer as content with
no calls (an answer cut off by max_tokens mid-call is text, not a broken call).
Streaming, `Splitter.push` releases content as it comes and holds text from where a
call may begin (for qwen25 the tail that could be the start of `<tool_call>`, for
llama3 an answer whose first character is `{`, for mistral and pythonic `[`);
`finish` parses what was held.

Invariants: pure (no clock, no ids: the caller names the calls); the content
released while streaming plus `finish`'s content equals `parse`'s content whenever
there are no calls.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

PARSERS = ("qwen25", "hermes", "llama3", "mistral", "pythonic")
_WHOLE = {"llama3": "{", "mistral": "[", "pythonic": "["}  # the answer is the calls
_MISTRAL_TAG = "[TOOL_CALLS]"
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"

Call = tuple[str, str]  # (function name, arguments as JSON text)


def parse(parser: str, text: str) -> tuple[str | None, list[Call]]:
    """(content, calls) of a finished answer; content None when only calls remain."""
    if parser in _WHOLE:
        read = {"llama3": _llama3, "mistral": _mistral, "pythonic": _pythonic}[parser]
        calls = read(text)
        return (None, calls) if calls else (text, [])
    start = text.find(_OPEN)
    if start < 0:
        return text, []
    calls = []
    rest = text[start:]
    while rest.strip():
        if not rest.lstrip().startswith(_OPEN):
            return text, []  # text after a call: not a call we can stand behind
        body = rest.lstrip()[len(_OPEN) :]
        end = body.find(_CLOSE)
        raw = body if end < 0 else body[:end]
        call = _call(raw, "arguments")
        if call is None:
            return text, []
        calls.append(call)
        rest = "" if end < 0 else body[end + len(_CLOSE) :]
    content = text[:start].strip()
    return content or None, calls


def _llama3(text: str) -> list[Call]:
    body = text.strip()
    if not body.startswith("{"):
        return []
    calls = []
    for part in _split_top_level(body):
        call = _call(part, "parameters", "arguments")
        if call is None:
            return []
        calls.append(call)
    return calls


def _mistral(text: str) -> list[Call]:
    body = text.strip().removeprefix(_MISTRAL_TAG).strip()
    if not body.startswith("["):
        return []
    try:
        items = json.loads(body)
    except ValueError:
        return []
    if not isinstance(items, list) or not items:
        return []
    calls = []
    for item in items:
        call = _call(json.dumps(item), "arguments", "parameters")
        if call is None:
            return []
        calls.append(call)
    return calls


def _pythonic(text: str) -> list[Call]:
    body = text.strip()
    if not body.startswith("["):
        return []
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError):
        return []
    if not isinstance(tree, ast.List) or not tree.elts:
        return []
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                and all(k.arg for k in node.keywords)):  # fmt: skip
            return []
        try:
            args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        except (ValueError, TypeError, SyntaxError):
            return []
        calls.append((node.func.id, json.dumps(args, ensure_ascii=False)))
    return calls


def _split_top_level(text: str) -> list[str]:
    """`{...}; {...}` -> the objects' texts (a ';' inside a string or object is kept)."""
    parts, depth, quote, escape, begin = [], 0, False, False, 0
    for i, ch in enumerate(text):
        if quote:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                quote = False
        elif ch == '"':
            quote = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == ";" and depth == 0:
            parts.append(text[begin:i])
            begin = i + 1
    parts.append(text[begin:])
    return [p for p in parts if p.strip()]


def _call(raw: str, *arg_keys: str) -> Call | None:
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = next((obj[k] for k in arg_keys if k in obj), {})
    if isinstance(args, str):  # already JSON text
        return obj["name"], args
    return obj["name"], json.dumps(args, ensure_ascii=False)


class Splitter:
    """A streamed answer's content released as it comes, calls held (module docstring)."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self.text = ""  # everything so far
        self.sent = 0  # characters of it released as content

    def push(self, delta: str) -> str:
        self.text += delta
        if self.parser in _WHOLE:
            stripped = self.text.lstrip()
            if not stripped or stripped.startswith(_WHOLE[self.parser]):
                return ""  # maybe a call: held to the end
            return self._release(len(self.text))
        at = self.text.find(_OPEN, self.sent)
        if at >= 0:
            return self._release(at)
        return self._release(len(self.text) - _partial_suffix(self.text, _OPEN))

    def finish(self) -> tuple[str, list[Call]]:
        """(content not released yet, calls) at the end of the answer."""
        _, calls = parse(self.parser, self.text)
        if not calls:
            return self._release(len(self.text), held_space=False), []
        at = 0 if self.parser in _WHOLE else self.text.find(_OPEN)
        return self._release(max(at, self.sent)), calls

    def _release(self, upto: int, *, held_space: bool = True) -> str:
        """Text up to `upto` not sent yet; trailing whitespace stays held (it may end up
        just before a call, where it is dropped) unless `held_space` is False."""
        if held_space:
            while upto > self.sent and self.text[upto - 1].isspace():
                upto -= 1
        out = self.text[self.sent : upto]
        self.sent = max(self.sent, upto)
        return out


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that `marker` starts with (held back)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def openai_calls(calls: list[Call], ids: list[str]) -> list[dict]:
    """OpenAI's message.tool_calls for `calls`, named by `ids`."""
    return [{"id": i, "type": "function", "function": {"name": name, "arguments": args}}
            for (name, args), i in zip(calls, ids, strict=True)]  # fmt: skip


def strict_regex(parser: str, tools: list[dict[str, Any]]) -> str:
    """With tool_choice "auto" and a tool marked `"strict": true` (OpenAI's promise that
    a call's arguments match its parameters): a strict tool's arguments are shaped by
    its parameters, another's are any JSON object (Python literals for pythonic). For
    qwen25/hermes the answer is free text in which each `<tool_call>` opens a whole
    call of one of the tools (a structural tag, actors/grammar/structural_tag.py). For
    the formats whose answer is only calls (llama3, mistral, pythonic) it is either
    prose whose first non-blank character is not the one calls begin with (`{` or `[`),
    or calls only. "" when no tool is strict."""
    fns = [t["function"] for t in tools]
    if parser not in PARSERS or not any(f.get("strict") is True for f in fns):
        return ""
    loose = {"type": "object"}
    if parser in _WHOLE:
        shaped = [{"type": "function", "function": {**f, "parameters": f.get("parameters") or
                   {"type": "object", "properties": {}}} if f.get("strict") is True else
                   {**f, "parameters": loose}} for f in fns]  # fmt: skip
        try:
            calls = forced_regex(parser, shaped, None)
        except ValueError as e:
            raise ValueError(f"strict tools: {e}") from None
        return r"\s*(?:" + calls + r"|[^\s" + re.escape(_WHOLE[parser]) + r"][\s\S]*)?"
    from shunter.actors.grammar.structural_tag import structural_tag_regex

    structures = [{
        "begin": _OPEN + "\n" + '{"name": ' + json.dumps(f["name"]) + ', "arguments": ',
        "schema": (f.get("parameters") or {"type": "object", "properties": {}})
        if f.get("strict") is True else loose,
        "end": "}\n" + _CLOSE,
    } for f in fns]  # fmt: skip
    try:
        return structural_tag_regex({"triggers": [_OPEN], "structures": structures})
    except ValueError as e:
        raise ValueError(f"strict tools: {e}") from None


def forced_regex(parser: str, tools: list[dict[str, Any]], name: str | None, *,
                 many: bool = True) -> str:  # fmt: skip
    """A regex of the answers that are calls in `parser`'s format, each call's arguments
    shaped by its function's `parameters` (actors/grammar/json_schema.py): one or more
    calls of any of the tools (tool_choice "required", name None; exactly one unless
    `many`) or one call of the function `name`. ValueError for what cannot be written
    so."""
    from shunter.actors.grammar.json_schema import keyword_args_regex, schema_regex

    fns = [t["function"] for t in tools]
    if name is not None:
        fns = [f for f in fns if f["name"] == name]
        if not fns:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
    if parser == "pythonic":  # [name(key=value, ...), ...] with Python literals
        pycalls = []
        for f in fns:
            try:
                args = keyword_args_regex(
                    f.get("parameters") or {"type": "object", "properties": {}}
                )
            except ValueError as e:
                raise ValueError(f"function {f['name']!r}: {e}") from None
            pycalls.append(re.escape(f["name"]) + r"\(" + args + r"\)")
        one = pycalls[0] if len(pycalls) == 1 else "(?:" + "|".join(pycalls) + ")"
        return r"\[" + one + (r"(?:,[ ]?" + one + ")*" if many and name is None else "") + r"\]"
    key = "parameters" if parser == "llama3" else "arguments"
    calls = []
    for f in fns:
        try:
            args = schema_regex(f.get("parameters") or {"type": "object", "properties": {}})
        except ValueError as e:
            raise ValueError(f"function {f['name']!r}: {e}") from None
        calls.append(r'\{"name":[ ]?' + re.escape(json.dumps(f["name"])) + r',[ ]?"' + key
                     + r'":[ ]?' + args + r"\}")  # fmt: skip
    call = calls[0] if len(calls) == 1 else "(?:" + "|".join(calls) + ")"
    many = many and name is None
    if parser in ("qwen25", "hermes"):
        one = re.escape(_OPEN) + r"\n" + call + r"\n" + re.escape(_CLOSE)
        return one + r"(?:\n" + one + ")*" if many else one
    if parser == "llama3":
        return call + r"(?:;[ ]?" + call + ")*" if many else call
    return r"\[" + call + (r"(?:,[ ]?" + call + ")*" if many else "") + r"\]"
