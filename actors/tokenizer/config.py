"""Configuration of the tokenizer actor (a frozen Struct, validated on construction)."""

from __future__ import annotations

import msgspec


class TokenizerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What the tokenizer actor needs to start; `shunter serve` builds it from server args."""

    model_path: str | None = None
    """--model-path: a directory or .gguf file; None means the default model."""

    tokenizer_path: str | None = None
    """--tokenizer-path: where the tokenizer files are, when not beside the model."""

    chat_template: str | None = None
    """--chat-template: a file holding a Jinja template, or the template text itself.
    None uses the model's own template (tokenizer_config.json or GGUF metadata)."""

    context_len: int | None = None
    """Longest sequence (prompt + output) in tokens; None reads it from the model."""

    stream_interval: int = 1
    """--stream-interval: a streamed request gets a delta every this many tokens (the
    first and the last delta are never held back)."""

    non_stream_interval: int = 32
    """The same for requests that are not streamed (their client sees only the end, so
    fewer, larger deltas cost less); at least stream_interval."""

    cache_dir: str | None = None
    """Where converted tokenizers (from GGUF metadata) are kept between starts; None is
    ~/.cache/shunter/tokenizers."""

    skip_tokenizer_init: bool = False
    """--skip-tokenizer-init: load no tokenizer; prompts must be token ids and outputs
    carry no text. The vocabulary size and eos ids then come from the fields below
    (the executor's, as `shunter serve` passes them) and context_len must be set."""

    vocab_size: int | None = None
    """The model's vocabulary size (only with skip_tokenizer_init)."""

    eos_token_ids: tuple[int, ...] = ()
    """The model's eos ids (only with skip_tokenizer_init)."""

    actor_id: str = "tokenizer"
    """Instance name on the bus (Ready.actor_id, Envelope.publisher_id)."""

    max_stop_strings: int = 32
    """More stop strings than this in one request is an invalid request."""

    max_stop_len_chars: int = 256
    """A longer stop string is an invalid request (it bounds the held-back text)."""

    allow_auto_truncate: bool = False
    """--allow-auto-truncate: a prompt as long as the context is cut to its first
    context_len - 1 tokens, and max_new_tokens to what then fits, instead of a 400."""

    num_prompt_context_tokens: int = 5
    """Prompt tokens kept as leading context for detokenizing the first output tokens
    (some decoders drop a leading space when a piece is decoded on its own)."""

    def __post_init__(self) -> None:
        if self.context_len is not None and self.context_len < 2:
            raise ValueError(f"context_len must be >= 2, got {self.context_len}")
        if self.stream_interval < 1 or self.non_stream_interval < 1:
            raise ValueError(
                f"stream intervals must be >= 1, got {self.stream_interval}, "
                f"{self.non_stream_interval}"
            )
        if self.max_stop_strings < 0:
            raise ValueError(f"max_stop_strings must be >= 0, got {self.max_stop_strings}")
        if self.max_stop_len_chars < 1:
            raise ValueError(f"max_stop_len_chars must be >= 1, got {self.max_stop_len_chars}")
        if self.num_prompt_context_tokens < 0:
            raise ValueError(
                f"num_prompt_context_tokens must be >= 0, got {self.num_prompt_context_tokens}"
            )
        if self.skip_tokenizer_init and (self.vocab_size is None or self.context_len is None):
            raise ValueError("skip_tokenizer_init needs vocab_size and context_len")
        if not self.actor_id:
            raise ValueError("actor_id must not be empty")
