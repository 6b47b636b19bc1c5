"""The scheduler and cache manager cores driving the real executor core on the default
model (SmolLM2-135M GGUF, float32, CPU): chunked prefill, shared prefixes, and a pool
small enough to force retractions must still give the greedy reference tokens."""

from __future__ import annotations

import json
import math
import pathlib

import pytest
import torch

from shunter.actors.scheduler.config import SchedulerConfig
from shunter.actors.scheduler.sim import Cluster
from shunter.bus.messages import SamplingParams, Tokenized

REFERENCE = pathlib.Path(__file__).resolve().parents[2] / "data" / "smollm2_greedy_reference.json"

pytestmark = pytest.mark.skipif(not REFERENCE.is_file(), reason="no greedy reference")


@pytest.fixture(scope="module")
def model():
    from shunter.actors.executor.loader import load_model

    torch.set_num_threads(1)
    return load_model(None, progress=False)


class _Executor:
    """The real ExecutorCore in the place of the cluster's simulated one."""

    def __init__(self, model, num_pages: int, page_size: int) -> None:
        from shunter.actors.executor.core import ExecutorCore
        from shunter.actors.executor.kv_pool import KVPool
        from shunter.actors.executor.runner import ModelRunner

        m, cfg = model
        pool = KVPool(cfg, num_pages, page_size=page_size)
        self.core = ExecutorCore(ModelRunner(m, pool), eos_token_ids=cfg.eos_token_ids)

    def handle(self, batch):
        result = self.core.step(batch)
        assert result.error is None, result.error
        return result


@pytest.mark.heavy
@pytest.mark.parametrize("in_flight", [1, 2])
def test_greedy_reference_through_scheduler_cache_and_executor(model, in_flight):
    ref = json.loads(REFERENCE.read_text())
    prompts = ref["prompts"]
    page_size = 4
    num_pages = 48  # 192 slots for 5 x ~70 tokens: retractions are needed
    cfg = SchedulerConfig(
        page_size=page_size, chunked_prefill_size=16, max_prefill_tokens=64,
        max_running_requests=5, num_total_pages=num_pages, eos_token_ids=(ref["eos_token_id"],),
        lease_min_pages=2, lease_max_surplus_pages=4,
        init_new_token_ratio=0.05, min_new_token_ratio=0.01,  # overcommit: retract later
        max_batches_in_flight=in_flight,
    )  # fmt: skip
    c = Cluster(cfg, num_pages)
    c.exe = _Executor(model, num_pages, page_size)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=32)
    for p in prompts:
        c.submit(Tokenized(p["name"], p["input_ids"], greedy))
    c.run()
    assert not c.problems and all(m.ok for m in c.censuses)
    for p in prompts:
        assert c.tokens(p["name"]) == p["output_ids"], p["name"]
        fin = c.finished(p["name"])
        assert fin.finish_reason == ("stop" if p["stopped_on_eos"] else "length")
    st = c.sched.statistics()
    assert st.num_retractions + st.num_parked > 0 and st.num_chunks_cached > 0
    assert any(c.finished(p["name"]).num_cached_tokens > 0 for p in prompts)  # shared system prompt


def test_prompt_logprobs_survive_retraction_and_the_prefix_cache(model):
    """Every prompt position scored once and as without KV pressure: a retraction in
    the middle of a chunked prompt reopens its row asking from the first position not
    yet reported (whose scoring logits the cache manager leaves to compute), and a
    request retracted after its prompt asks for none again."""
    ref = json.loads(REFERENCE.read_text())
    prompts = ref["prompts"]
    scored = SamplingParams(temperature=0.0, max_new_tokens=24, logprob_start_len=0)

    def run(num_pages: int) -> tuple[Cluster, dict[str, list[float]]]:
        cfg = SchedulerConfig(
            page_size=4, chunked_prefill_size=16, max_prefill_tokens=64,
            max_running_requests=5, num_total_pages=num_pages,
            eos_token_ids=(ref["eos_token_id"],), lease_min_pages=2, lease_max_surplus_pages=4,
            init_new_token_ratio=0.05, min_new_token_ratio=0.01,
        )  # fmt: skip
        c = Cluster(cfg, num_pages)
        c.exe = _Executor(model, num_pages, 4)
        for p in prompts:
            c.submit(Tokenized(p["name"], p["input_ids"], scored))
        c.run()
        assert not c.problems
        return c, {p["name"]: [x for o in c.outputs[p["name"]] for x in o.prompt_logprobs]
                   for p in prompts}  # fmt: skip

    roomy, want = run(400)
    tight, got = run(44)
    assert roomy.sched.statistics().num_retractions == 0
    assert tight.sched.statistics().num_retractions > 0
    for p in prompts:
        name, n = p["name"], len(p["input_ids"])
        assert len(want[name]) == len(got[name]) == n, name
        assert math.isnan(got[name][0]) and not any(map(math.isnan, got[name][1:])), name
        assert got[name][1:] == pytest.approx(want[name][1:], abs=1e-4), name
        assert tight.tokens(name) == roomy.tokens(name)
