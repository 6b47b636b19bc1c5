"""The warm-up script (warmup.py): each attention path once, on distinct pages, rows
closed at the end; nothing when the pool or the context is too small. Running it on
a real core is in test_executor_core.py."""

from __future__ import annotations

import pytest

from shunter.actors.executor.warmup import warmup_batches
from shunter.bus.messages import LAST_SAMPLED


def _modes(batches) -> list[str]:
    """The runner's attention mode of each batch with entries (runner.py's rule)."""
    out = []
    for b in batches:
        if not b.rows:
            continue
        lens = [s + n for s, n in zip(b.start_pos, b.num_new_tokens, strict=True)]
        if all(n == 1 for n in b.num_new_tokens):
            out.append("decode")
        elif list(b.num_new_tokens) == lens:
            out.append("prefill")
        else:
            out.append("extend")
    return out


@pytest.mark.parametrize("page_size", [1, 16])
def test_steps_take_every_attention_path_on_distinct_pages(page_size):
    bs = warmup_batches(page_size, 1000, 256, 4096, 8)
    assert _modes(bs) == ["prefill", "extend", "extend", "decode"]
    mixed = bs[1]  # a decode beside a fresh prompt: what a lightly loaded server runs
    assert mixed.num_new_tokens[0] == 1 and mixed.input_ids[0] == LAST_SAMPLED
    assert mixed.start_pos[1] == 0 and mixed.num_new_tokens[1] > 1
    pages = [p for b in bs for p in b.new_pages]
    assert len(pages) == len(set(pages)) and max(pages) < 1000
    assert [len(b.opens) for b in bs] == [1, 1, 0, 0, 0]
    assert bs[-1].closes == [0, 1] and not bs[-1].rows
    ids = [t for b in bs for t in b.input_ids if t != LAST_SAMPLED]
    assert min(ids) >= 1 and max(ids) < 256


def test_one_row_and_too_small_pools_or_contexts():
    one = warmup_batches(16, 1000, 256, 4096, 1)
    assert _modes(one) == ["prefill", "decode", "extend", "decode"]
    assert one[-1].closes == [0] and all(r == 0 for b in one for r in b.rows)
    assert warmup_batches(1, 10, 256, 4096, 8) == []  # fewer pages than its tokens
    assert warmup_batches(16, 1000, 256, 8, 8) == []  # a context shorter than its prompt
