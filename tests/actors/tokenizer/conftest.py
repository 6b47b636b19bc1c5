"""The real tokenizer of the default model, loaded once per test session (~5 s)."""

from __future__ import annotations

import json
import pathlib

import pytest

REFERENCE = pathlib.Path(__file__).resolve().parents[2] / "data" / "smollm2_greedy_reference.json"


@pytest.fixture(scope="session")
def codec():
    from shunter.actors.tokenizer.config import TokenizerConfig
    from shunter.actors.tokenizer.loading import load_codec

    return load_codec(TokenizerConfig())


@pytest.fixture(scope="session")
def reference():
    if not REFERENCE.is_file():
        pytest.skip(f"{REFERENCE} is not on this machine")
    return json.loads(REFERENCE.read_text())
