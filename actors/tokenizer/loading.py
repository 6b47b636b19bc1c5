"""Loading a tokenizer, and the facts the tokenizer core needs (eos ids, vocabulary
size, context length, chat template).

A model directory with `tokenizer.json` is read with the `tokenizers` library alone.
A GGUF file (or a directory without tokenizer.json) is converted once through HF
transformers (`AutoTokenizer.from_pretrained(..., gguf_file=...)`, seconds plus the
import of transformers) and the result is saved under the conversion cache
(`TokenizerConfig.cache_dir`, keyed by the source's path, size and mtime), so later
starts take about a second. Nothing is downloaded.

`TextCodec` is the only view of the tokenizer that the core sees: plain, deterministic
functions over ids and text. Loading reads files (blocking); call it from a worker
thread in async code.
"""

from __future__ import annotations

import functools
import hashlib
import json
import pathlib
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import structlog
import tokenizers

from shunter.actors.model_files import resolve_model
from shunter.actors.tokenizer.chat import render_chat, resolve_chat_template
from shunter.actors.tokenizer.config import TokenizerConfig
from shunter.bus.messages import ChatMessage

log = structlog.get_logger(actor="tokenizer")

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class TextCodec:
    """Token ids <-> text for one model (wraps a `tokenizers.Tokenizer`).

    `decode` implements spaces_between_special_tokens (join an added token to its
    neighbours with a space when special tokens are kept), which the fast tokenizer
    library does not do itself."""

    has_text = True

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        eos_token_ids: Sequence[int],
        context_len: int,
        chat_template: str | None,
        special_tokens: dict[str, str] | None = None,
        name: str = "",
    ) -> None:
        self.tk = tokenizer
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(set(eos_token_ids)))
        self.context_len = context_len
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        self.name = name
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self._added_ids: frozenset[int] = frozenset(tokenizer.get_added_tokens_decoder())

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.tk.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(
        self,
        ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> str:
        ids = list(ids)
        if skip_special_tokens or not spaces_between_special_tokens:
            return self.tk.decode(ids, skip_special_tokens=skip_special_tokens)
        if not any(i in self._added_ids for i in ids):
            return self.tk.decode(ids, skip_special_tokens=False)
        # Runs of ordinary tokens decode together; each added token stands alone.
        parts: list[str] = []
        run: list[int] = []
        for i in ids:
            if i in self._added_ids:
                if run:
                    parts.append(self.tk.decode(run, skip_special_tokens=False))
                    run = []
                parts.append(self.tk.decode([i], skip_special_tokens=False))
            else:
                run.append(i)
        if run:
            parts.append(self.tk.decode(run, skip_special_tokens=False))
        return " ".join(parts)

    def decode_fn(
        self, skip_special_tokens: bool, spaces_between_special_tokens: bool
    ) -> Callable[[Sequence[int]], str]:
        """`decode` with its flags bound, as cheap as possible (the detokenizer's hot path)."""
        if skip_special_tokens or not spaces_between_special_tokens:
            tk_decode = self.tk.decode
            return lambda ids: tk_decode(ids, skip_special_tokens=skip_special_tokens)
        return functools.partial(
            self.decode, skip_special_tokens=False, spaces_between_special_tokens=True
        )

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own (logprob entries); special tokens included."""
        return self.tk.decode([token_id], skip_special_tokens=False)

    def render_chat(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] = {},
        tools: Sequence[Mapping[str, Any]] = (),
    ) -> str:
        return render_chat(
            self.chat_template, messages, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, template_kwargs=template_kwargs,
            special_tokens=self.special_tokens, tools=tools,
        )  # fmt: skip


# -- model facts ---------------------------------------------------------------------------


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
    eos = [int(v) for v in (scalar("tokenizer.ggml.eos_token_id"),
                            scalar("tokenizer.ggml.eot_token_id")) if v is not None]  # fmt: skip
    return (int(ctx) if ctx is not None else None), eos


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


# -- tokenizer files -----------------------------------------------------------------------


def default_cache_dir() -> pathlib.Path:
    try:
        return pathlib.Path.home() / ".cache" / "shunter" / "tokenizers"
    except RuntimeError:  # no home directory (a bare service account)
        return pathlib.Path(tempfile.gettempdir()) / "shunter-tokenizers"


def _cache_key(source: pathlib.Path) -> str:
    st = source.stat()
    raw = f"{source.resolve()}|{st.st_size}|{st.st_mtime_ns}|v1".encode()
    return hashlib.sha256(raw).hexdigest()[:24]


def _convert_with_transformers(source: pathlib.Path, out_dir: pathlib.Path) -> None:
    """HF conversion (GGUF metadata or slow-tokenizer files) saved as tokenizer.json."""
    from transformers import AutoTokenizer

    if source.suffix == ".gguf":
        hf = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    else:
        hf = AutoTokenizer.from_pretrained(str(source))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=".convert-"))
    try:
        hf.save_pretrained(str(tmp))
        if not (tmp / "tokenizer.json").is_file():
            raise ValueError(f"{source}: the tokenizer has no fast (tokenizer.json) form")
        tmp.rename(out_dir)  # atomic: a reader sees all files or none
    except OSError:
        if not (out_dir / "tokenizer.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def tokenizer_files(source: pathlib.Path, cache_dir: pathlib.Path) -> pathlib.Path:
    """A directory holding tokenizer.json (+ tokenizer_config.json) for `source`."""
    if source.is_dir() and (source / "tokenizer.json").is_file():
        return source
    out = cache_dir / _cache_key(source)
    if not (out / "tokenizer.json").is_file():
        log.info("converting tokenizer (once; cached)", source=str(source), cache=str(out))
        _convert_with_transformers(source, out)
    return out


def _read_template(files: pathlib.Path, config: dict) -> str | None:
    jinja = files / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    t = config.get("chat_template")
    if isinstance(t, list):  # named templates: take the default one
        t = next((x.get("template") for x in t if x.get("name") == "default"), None)
    return t if isinstance(t, str) else None


def _special_tokens(config: dict) -> dict[str, str]:
    out = {}
    for name in _SPECIAL_NAMES:
        v = config.get(name)
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            out[name] = v
    return out


class IdsCodec:
    """A TextCodec with no tokenizer behind it (--skip-tokenizer-init): token ids pass
    through, and every text is empty. The core refuses what needs text (text and chat
    prompts, stop strings, tokenize queries) before any of it reaches here."""

    has_text = False
    chat_template = None
    special_tokens: dict[str, str] = {}

    def __init__(self, *, vocab_size: int, eos_token_ids: Sequence[int], context_len: int,
                 name: str = "") -> None:  # fmt: skip
        self.vocab_size = vocab_size
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(set(eos_token_ids)))
        self.context_len = context_len
        self.name = name

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        raise ValueError("no tokenizer is loaded (--skip-tokenizer-init)")

    def render_chat(self, *args, **kwargs) -> str:
        raise ValueError("no tokenizer is loaded (--skip-tokenizer-init)")

    def decode(self, ids: Sequence[int], **kwargs) -> str:
        return ""

    def token_text(self, token_id: int) -> str:
        return ""


def load_codec(config: TokenizerConfig) -> TextCodec | IdsCodec:
    """Load the tokenizer named by `config` (blocking; nothing is downloaded), or with
    skip_tokenizer_init an IdsCodec of the config's facts."""
    if config.skip_tokenizer_init:
        assert config.vocab_size is not None and config.context_len is not None
        return IdsCodec(vocab_size=config.vocab_size, eos_token_ids=config.eos_token_ids,
                        context_len=config.context_len, name=config.model_path or "")  # fmt: skip
    source = resolve_model(config.model_path)
    tok_source = resolve_model(config.tokenizer_path) if config.tokenizer_path else source
    cache = pathlib.Path(config.cache_dir) if config.cache_dir else default_cache_dir()
    files = tokenizer_files(pathlib.Path(tok_source.path), cache)
    tk = tokenizers.Tokenizer.from_file(str(files / "tokenizer.json"))
    cfg_file = files / "tokenizer_config.json"
    tok_config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    special = _special_tokens(tok_config)
    ctx, eos = _gguf_facts(source.path) if source.kind == "gguf" else _hf_dir_facts(source.path)
    if "eos_token" in special and tk.token_to_id(special["eos_token"]) is not None:
        eos.append(tk.token_to_id(special["eos_token"]))
    context_len = config.context_len or ctx
    if context_len is None:
        raise ValueError(
            f"the context length of {source.path} is not in its metadata; pass --context-length"
        )
    template = resolve_chat_template(config.chat_template, _read_template(files, tok_config))
    codec = TextCodec(
        tk, eos_token_ids=eos, context_len=context_len, chat_template=template,
        special_tokens=special, name=source.name,
    )  # fmt: skip
    log.info(
        "tokenizer loaded", path=tok_source.path, vocab_size=codec.vocab_size,
        eos_token_ids=list(codec.eos_token_ids), context_len=context_len,
        has_chat_template=template is not None,
    )  # fmt: skip
    return codec
