"""Loading a tokenizer: HF fast tokenizer from a model directory or a GGUF file, plus the
facts the tokenizer core needs (eos ids, vocabulary size, context length, chat template).

`TextCodec` is the only view of the tokenizer that the core sees: plain, deterministic
functions over ids and text. Loading reads files (blocking, seconds); call it from a
worker thread in async code.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence
from typing import Any

import structlog

from shunter.actors.model_files import ModelSource, resolve_model
from shunter.actors.tokenizer.chat import render_chat, resolve_chat_template
from shunter.actors.tokenizer.config import TokenizerConfig
from shunter.bus.messages import ChatMessage

log = structlog.get_logger(actor="tokenizer")


class TextCodec:
    """Token ids <-> text for one model (wraps an HF tokenizer).

    `decode` implements spaces_between_special_tokens itself: HF fast tokenizers ignore
    that flag, while SGLang's and OpenAI's behaviour joins a special token to its
    neighbours with a space when special tokens are kept."""

    def __init__(
        self,
        hf_tokenizer: Any,
        *,
        eos_token_ids: Sequence[int],
        context_len: int,
        chat_template: str | None,
        name: str = "",
    ) -> None:
        self.hf = hf_tokenizer
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(set(eos_token_ids)))
        self.context_len = context_len
        self.chat_template = chat_template
        self.name = name
        self.vocab_size: int = len(hf_tokenizer)
        self._added_ids: frozenset[int] = frozenset(hf_tokenizer.added_tokens_decoder)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(
        self,
        ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> str:
        if skip_special_tokens or not spaces_between_special_tokens:
            return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if not any(i in self._added_ids for i in ids):
            return self.hf.decode(list(ids), skip_special_tokens=False)
        # Runs of ordinary tokens decode together; each added token stands alone.
        parts: list[str] = []
        run: list[int] = []
        for i in ids:
            if i in self._added_ids:
                if run:
                    parts.append(self.hf.decode(run, skip_special_tokens=False))
                    run = []
                parts.append(self.hf.decode([i], skip_special_tokens=False))
            else:
                run.append(i)
        if run:
            parts.append(self.hf.decode(run, skip_special_tokens=False))
        return " ".join(parts)

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own (logprob entries); special tokens included."""
        return self.hf.decode([token_id], skip_special_tokens=False)

    def render_chat(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool) -> str:
        return render_chat(
            self.hf, self.chat_template, messages, add_generation_prompt=add_generation_prompt
        )


def _gguf_facts(path: str) -> tuple[int | None, list[int]]:
    """(context length, eos ids) from GGUF metadata."""
    import gguf

    reader = gguf.GGUFReader(path)

    def scalar(key: str) -> Any:
        field = reader.fields.get(key)
        if field is None or not field.data:
            return None
        return field.parts[field.data[0]][0].item()

    arch_field = reader.fields.get("general.architecture")
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode() if arch_field else "llama"
    ctx = scalar(f"{arch}.context_length")
    eos = [v for v in (scalar("tokenizer.ggml.eos_token_id"),) if v is not None]
    eot = scalar("tokenizer.ggml.eot_token_id")
    if eot is not None:
        eos.append(eot)
    return (int(ctx) if ctx is not None else None), [int(e) for e in eos]


def _hf_dir_facts(path: str) -> tuple[int | None, list[int]]:
    """(context length, eos ids) from config.json and generation_config.json."""
    d = pathlib.Path(path)
    ctx: int | None = None
    eos: list[int] = []
    for name in ("config.json", "generation_config.json"):
        f = d / name
        if not f.is_file():
            continue
        data = json.loads(f.read_text())
        if name == "config.json":
            ctx = data.get("max_position_embeddings") or ctx
        e = data.get("eos_token_id")
        if isinstance(e, int):
            eos.append(e)
        elif isinstance(e, list):
            eos.extend(int(x) for x in e)
    return ctx, eos


def load_codec(config: TokenizerConfig) -> TextCodec:
    """Load the tokenizer named by `config` (blocking; nothing is downloaded)."""
    from transformers import AutoTokenizer

    source: ModelSource = resolve_model(config.model_path)
    tok_source = resolve_model(config.tokenizer_path) if config.tokenizer_path else source
    if tok_source.kind == "gguf":
        p = pathlib.Path(tok_source.path)
        hf = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    else:
        hf = AutoTokenizer.from_pretrained(tok_source.path)
    ctx, eos = _gguf_facts(source.path) if source.kind == "gguf" else _hf_dir_facts(source.path)
    if hf.eos_token_id is not None:
        eos.append(int(hf.eos_token_id))
    context_len = config.context_len or ctx
    if context_len is None:
        raise ValueError(
            f"the context length of {source.path} is not in its metadata; pass --context-length"
        )
    template = resolve_chat_template(config.chat_template, getattr(hf, "chat_template", None))
    log.info(
        "tokenizer loaded",
        path=tok_source.path,
        vocab_size=len(hf),
        eos_token_ids=sorted(set(eos)),
        context_len=context_len,
        has_chat_template=template is not None,
    )
    return TextCodec(
        hf, eos_token_ids=eos, context_len=context_len, chat_template=template, name=source.name
    )
