"""best_of on /v1/completions against the real server: of best_of sampled candidates
(the same ones n = best_of draws with the same seed), the n with the highest mean
logprob per token come back; usage counts every candidate's tokens."""

from __future__ import annotations

import openai
import pytest


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", timeout=300,
                         max_retries=0)  # fmt: skip


def test_best_of_keeps_the_likeliest_candidates(client):
    model = client.models.list().data[0].id
    common = {"model": model, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 1.0,
              "seed": 11}  # fmt: skip
    every = client.completions.create(n=4, logprobs=0, **common)
    means = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs)
             for c in every.choices]  # fmt: skip
    order = sorted(range(4), key=lambda j: -means[j])
    best = client.completions.create(n=2, best_of=4, **common)
    assert [c.text for c in best.choices] == [every.choices[j].text for j in order[:2]]
    assert [c.index for c in best.choices] == [0, 1] and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == every.usage.completion_tokens
    for bad in ({"n": 3, "best_of": 2}, {"best_of": 2, "stream": True}):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**{**common, **bad})
        assert e.value.body["param"] == "best_of"
