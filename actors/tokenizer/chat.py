"""Chat templates: the model's own (tokenizer_config.json or GGUF metadata
`tokenizer.chat_template`) or an override given as a file path or as template text.

Rendering is Jinja through the HF tokenizer's `apply_chat_template` (its sandbox and its
helpers such as `raise_exception`), so a model's template behaves as it does in HF.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import Any

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


def render_chat(
    hf_tokenizer: Any,
    template: str | None,
    messages: Sequence[ChatMessage],
    *,
    add_generation_prompt: bool,
) -> str:
    """Apply `template` to the conversation and return the prompt text. Raises
    ChatTemplateError when there is no template or the template refuses the input."""
    if template is None:
        raise ChatTemplateError(
            "this model has no chat template; pass --chat-template or send a plain prompt"
        )
    conversation = [{"role": m.role, "content": m.content} for m in messages]
    try:
        text = hf_tokenizer.apply_chat_template(
            conversation,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
    except Exception as e:  # jinja raises many types; every one is the request's fault
        raise ChatTemplateError(f"chat template failed: {e}") from e
    if not isinstance(text, str):
        raise ChatTemplateError(f"chat template produced {type(text).__name__}, not text")
    return text
