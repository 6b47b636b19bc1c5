"""Cost of the tokenizer core's hot path: one decode step of 256 running requests
(detokenize one token each, check a stop string). Heavy tier; prints the figure."""

from __future__ import annotations

import time

import pytest

from shunter.actors.tokenizer.config import TokenizerConfig
from shunter.actors.tokenizer.core import TokenizerCore
from shunter.bus.messages import GenerateRequest, RequestOutput, SamplingParams, TokensOut


@pytest.mark.heavy
def test_decode_step_of_256_requests(codec):
    num_requests, num_steps = 256, 200
    core = TokenizerCore(codec, TokenizerConfig(context_len=8192))
    text = "1. Stay hydrated: Drink plenty of water, especially during the heat. 😀 " * 16
    ids = codec.encode(text)
    for i in range(num_requests):
        core.handle(GenerateRequest(f"r{i}", SamplingParams(max_new_tokens=4096, stop=["</s>"]),
                                    text="hello", stream=True))  # fmt: skip
    out_text = [""] * num_requests
    t0 = time.perf_counter()
    for s in range(num_steps):
        step = TokensOut(s, [RequestOutput(f"r{i}", [ids[s]]) for i in range(num_requests)])
        (deltas,) = core.handle(step)
        for i, d in enumerate(deltas.deltas):
            out_text[i] += d.text
    per_step = (time.perf_counter() - t0) / num_steps
    print(f"\n{num_requests} requests: {per_step * 1e3:.2f} ms per step, "
          f"{per_step / num_requests * 1e6:.1f} us per request-token")  # fmt: skip
    assert out_text[0] == codec.decode(ids[:num_steps]).rstrip("\ufffd")
    assert per_step < 0.05  # generous: a shared 2-core machine
