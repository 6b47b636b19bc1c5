"""Chat templates: the model's own (tokenizer_config.json, chat_template.jinja or GGUF
metadata `tokenizer.chat_template`) or an override given as a file path or as template
text.

Rendering follows HF transformers' conventions (a sandboxed Jinja environment with
trim_blocks and lstrip_blocks, `raise_exception`, a `tojson` filter that keeps non-ASCII
text, the special tokens as variables), so a model's template renders as it does there.
`strftime_now` is deliberately not provided: rendering must not read the clock (replay
determinism), and templates that use it fall back to their own default date.
"""

from __future__ import annotations

import contextlib
import functools
import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

from shunter.bus.messages import ChatMessage


class ChatTemplateError(ValueError):
    """A template could not be found, read or rendered; the message says why."""


def resolve_chat_template(override: str | None, model_template: str | None) -> str | None:
    """The template to use: `override` (a readable file, or text that looks like Jinja),
    else the model's own, else None (chat requests are then refused)."""
    if override is None:
        return model_template or None
    if "{{" in override or "{%" in override:
        return override
    path = pathlib.Path(override).expanduser()
    if path.is_file():
        text = path.read_text(encoding="utf-8")
        if not text.strip():
            raise ChatTemplateError(f"--chat-template {override}: the file is empty")
        return text
    raise ChatTemplateError(
        f"--chat-template {override!r}: neither a readable file nor Jinja template text "
        "(a template contains '{{' or '{%')"
    )


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)  # fmt: skip


@functools.lru_cache(maxsize=8)
def compile_template(template: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template does not parse: {e}") from None


def _message(m: ChatMessage) -> dict[str, Any]:
    """A message as chat templates take it."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [_call(c) for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _call(call: Mapping[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        with contextlib.suppress(ValueError):  # not JSON: the template gets the text
            fn["arguments"] = json.loads(args)
    return {**call, "function": fn}


def render_chat(
    template: str | None,
    messages: Sequence[ChatMessage],
    *,
    add_generation_prompt: bool,
    continue_final_message: bool = False,
    template_kwargs: Mapping[str, Any] = {},
    special_tokens: Mapping[str, str] = {},
    tools: Sequence[Mapping[str, Any]] = (),
) -> str:
    """Apply `template` to the conversation and return the prompt text. Raises
    ChatTemplateError when there is no template or the template refuses the input.

    continue_final_message: the text ends right after the last message's content, so
    the model goes on with it (an assistant reply begun by the client) rather than
    after its end-of-turn; the content must appear in the rendered text.
    template_kwargs: extra template variables (`enable_thinking`, say); the names the
    renderer sets itself (messages, add_generation_prompt, ...) win over them.
    tools: function tools for the template's `tools` (None when there are none), as
    HF templates take them; an assistant message's tool calls go to the template with
    their JSON arguments decoded (HF's convention), a tool message with its call id."""
    if template is None:
        raise ChatTemplateError(
            "this model has no chat template; pass --chat-template or send a plain prompt"
        )
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError(
            "continue_final_message and add_generation_prompt cannot both be true"
        )
    conversation = [_message(m) for m in messages]
    try:
        text = compile_template(template).render(**{
            **template_kwargs, "messages": conversation,
            "add_generation_prompt": add_generation_prompt, "tools": list(tools) or None,
            "documents": None,
            **special_tokens,
        })  # fmt: skip
    except ChatTemplateError:
        raise
    except Exception as e:  # jinja raises many types; every one is the request's fault
        raise ChatTemplateError(f"chat template failed: {e}") from e
    if not continue_final_message:
        return text
    final = messages[-1].content.strip() if messages else ""
    at = text.rfind(final) if final else -1
    if at < 0:
        raise ChatTemplateError(
            "continue_final_message: the last message's content does not appear in the "
            "rendered conversation (it must be non-empty text the template keeps)"
        )
    return text[: at + len(final)]
