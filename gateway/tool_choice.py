"""A request's tools and tool_choice: the parser its answer goes through, and the
constraint a required, named or strict call puts on its output (the regexes are
tool_calls.py's). Each failure is a 400 naming its parameter, as in validation.py.
"""

from __future__ import annotations

from typing import Any

import msgspec

from shunter.bus.messages import SamplingParams
from shunter.gateway.errors import bad_request, require
from shunter.gateway.tool_calls import PARSERS


def tool_parser(tools: list[Any] | None, tool_choice: Any, parser: str | None, *,
                forced_ok: bool = False) -> str | None:  # fmt: skip
    """The tool-call parser a request's answer goes through (None: no tools), from its
    tools, its tool_choice and the server's --tool-call-parser. `forced_ok`: the
    endpoint constrains the answer for a required or named call (forced_call)."""
    if not forced_ok:
        require(tool_choice in (None, "auto", "none"), "tool_choice must be 'auto' or 'none' "
                "here (a required or named call is taken by /v1/chat/completions)",
                "tool_choice")  # fmt: skip
    forced = forced_call(tool_choice)
    require(forced is None or bool(tools), "tool_choice asks for a call but there are no tools",
            "tool_choice")  # fmt: skip
    if not tools or tool_choice == "none":
        return None
    require(parser is not None, "tools need a server started with --tool-call-parser "
            f"({', '.join(PARSERS)})", "tools")  # fmt: skip
    return parser


def forced_call(tool_choice: Any) -> str | None:
    """None when the model may answer freely ("auto", "none", absent); "" for a required
    call of any tool; the function's name for {"type": "function", "function":
    {"name": ...}}."""
    if tool_choice in (None, "auto", "none"):
        return None
    if tool_choice == "required":
        return ""
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    require(isinstance(fn, dict) and isinstance(fn.get("name"), str) and bool(fn["name"]),
            "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', "
            "'function': {'name': ...}}", "tool_choice")  # fmt: skip
    return fn["name"]


def constrain_to_calls(sampling: SamplingParams, tool_choice: Any, parser: str | None,
                       tools: list[dict[str, Any]], parallel_tool_calls: bool | None,
                       other: str) -> SamplingParams:  # fmt: skip
    """`sampling` with the answer constrained to calls in the parser's format when
    tool_choice asks for a required or named call (tool_calls.forced_regex; exactly
    one with parallel_tool_calls false), or, with "auto" and a strict tool, to prose and
    whole calls (tool_calls.strict_regex); 400 where another constraint (`other`) is
    given with a forced call or the calls cannot be written so."""
    forced = forced_call(tool_choice)
    if forced is None and parser is not None and tool_choice != "none" and not sampling.regex:
        from shunter.gateway import tool_calls

        try:
            strict = tool_calls.strict_regex(parser, tools)
        except ValueError as e:
            raise bad_request(str(e), param="tools") from None
        return msgspec.structs.replace(sampling, regex=strict) if strict else sampling
    if forced is None or parser is None:
        return sampling
    if sampling.regex:
        raise bad_request(f"a required or named tool call cannot be combined with {other}",
                          param="tool_choice")  # fmt: skip
    from shunter.gateway import tool_calls

    try:
        call_regex = tool_calls.forced_regex(parser, tools, forced or None,
                                             many=parallel_tool_calls is not False)  # fmt: skip
    except ValueError as e:
        raise bad_request(str(e), param="tool_choice") from None
    return msgspec.structs.replace(sampling, regex=call_regex)


def check_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """OpenAI function tools, each {type: "function", function: {name, ...}}."""
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        require(isinstance(fn, dict) and t.get("type", "function") == "function"
                and isinstance(fn.get("name"), str) and bool(fn["name"]),
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}",
                f"tools[{i}]")  # fmt: skip
    return list(tools)
