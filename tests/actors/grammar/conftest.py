"""The real tokenizer of the default model, for the token-level automata's tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def codec():
    from shunter.actors.tokenizer.config import TokenizerConfig
    from shunter.actors.tokenizer.loading import load_codec

    return load_codec(TokenizerConfig())
