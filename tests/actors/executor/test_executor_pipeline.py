"""ExecutorCore.submit / flush: the same ForwardBatch sequence, sent the way the overlap
scheduler sends it (step N+1 with LAST_SAMPLED before step N's result is read), gives
the same StepResults, field for field, as one step at a time."""

from __future__ import annotations

import json
import random

import msgspec
import pytest
import torch

from shunter.actors.executor import core as core_module
from shunter.actors.executor.actor import build_core
from shunter.actors.executor.config import ExecutorConfig
from shunter.actors.executor.core import ExecutorCore
from shunter.bus.messages import LAST_SAMPLED, ForwardBatch, RowOpen, SamplingParams, StepResult

LS = LAST_SAMPLED
TINY_LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512,
                  hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  eos_token_id=2, tie_word_embeddings=True)  # fmt: skip

GREEDY_LP = SamplingParams(temperature=0.0, return_logprob=True, top_logprobs_num=3,
                           logprob_start_len=0)  # fmt: skip
SEEDED_PEN = SamplingParams(temperature=0.8, top_k=40, repetition_penalty=1.2,
                            frequency_penalty=0.3, presence_penalty=0.2, min_new_tokens=3,
                            return_logprob=True)  # fmt: skip
SEEDED_TOP_P = SamplingParams(temperature=1.0, top_p=0.9, min_p=0.02, top_logprobs_num=2,
                              repetition_penalty=0.9)  # fmt: skip
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> ExecutorConfig:
    """Seeded dummy weights of a small Llama; 64 pages of 4 tokens, on the CPU."""
    d = tmp_path_factory.mktemp("tiny_llama_pipeline")
    (d / "config.json").write_text(json.dumps(TINY_LLAMA))
    kw = dict(load_format="dummy", seed=5, max_total_tokens=256, page_size=4)
    return ExecutorConfig(model_path=str(d), load_progress=False, device="cpu", **kw)


class Builder:
    """Plays the overlap scheduler: builds batches from its own view of the rows,
    never from a result (so every batch can be built before any result is read)."""

    def __init__(self, page_size: int = 4) -> None:
        self.ps = page_size
        self.next_page = 0
        self.pages: dict[int, int] = {}  # row -> pages held
        self.num_tokens: dict[int, int] = {}
        self.step_id = 0

    def batch(self, entries, *, opens=(), closes=(), sample=None, bad_start=False):
        """entries: [(row, ids)]; opens: [(row, request_id, params, seed)]."""
        for r in closes:
            self.pages.pop(r, None)
            self.num_tokens.pop(r, None)
        row_opens = []
        for r, rid, params, seed in opens:
            row_opens.append(RowOpen(r, rid, [], 0, params, seed))
            self.pages[r], self.num_tokens[r] = 0, 0
        rows, nnt, starts, ids, new_pages, nnp = [], [], [], [], [], []
        for r, toks in entries:
            start = self.num_tokens[r]
            need = -(-(start + len(toks)) // self.ps) - self.pages[r]
            pages = list(range(self.next_page, self.next_page + need))
            rows.append(r), nnt.append(len(toks)), starts.append(start + (5 if bad_start else 0))
            ids += toks
            new_pages += pages
            nnp.append(need)
            if not bad_start:
                self.next_page += need
                self.pages[r] += need
                self.num_tokens[r] = start + len(toks)
        b = ForwardBatch(step_id=self.step_id, opens=row_opens, closes=list(closes), rows=rows,
                         num_new_tokens=nnt, start_pos=starts, input_ids=ids,
                         new_pages=new_pages, num_new_pages=nnp,
                         sample=sample if sample is not None else [True] * len(rows))  # fmt: skip
        self.step_id += 1
        return b


def overlap_batches() -> list[ForwardBatch]:
    b = Builder()
    p = lambda n, k=0: [(7 * i + 3 * k) % 500 + 5 for i in range(n)]  # noqa: E731
    return [
        b.batch(
            [(0, p(11)), (1, p(6, 1))],
            sample=[True, False],
            opens=[(0, "a", GREEDY_LP, 0), (1, "b", SEEDED_PEN, 11)],
        ),
        b.batch([(0, [LS]), (1, p(5, 2))]),  # second prefill chunk of row 1
        b.batch([(0, [LS]), (1, [LS]), (2, p(7, 3))], opens=[(2, "c", SEEDED_TOP_P, 12)]),
        b.batch([(0, [LS]), (1, [LS]), (2, [LS])]),
        # row 1 closes with its sample of the step before still in flight; reopened
        b.batch([(0, [LS]), (2, [LS]), (1, p(5, 4))], closes=[1], opens=[(1, "d", GREEDY, 0)]),
        b.batch([(0, [LS]), (1, [LS])], bad_start=True),  # malformed: wrong start_pos
        b.batch([(0, [LS]), (1, [LS]), (2, [LS])]),
        b.batch([(0, [LS]), (2, [LS]), (1, [LS, 9, 8])]),  # a mixed decode/extend step
        b.batch([], closes=[0]),  # row diffs only: no forward
        b.batch([(2, [LS]), (1, [LS])]),
        b.batch([(2, [LS])], sample=[False]),  # feeds the sample back, samples nothing
        b.batch([(1, [LS])], closes=[2]),
        b.batch([], closes=[1]),
    ]


def encoded(results: list[StepResult]) -> list[bytes]:
    return [msgspec.msgpack.encode(r) for r in results]  # NaN-safe comparison


def run_sync(core: ExecutorCore, batches) -> list[StepResult]:
    return [core.step(b) for b in batches]


def run_pipelined(core: ExecutorCore, batches, flush_after=()) -> list[StepResult]:
    out: list[StepResult] = []
    for i, b in enumerate(batches):
        got = core.submit(b)
        assert len(got) == (1 if i and (i - 1) not in flush_after else 0)
        out += got
        if i in flush_after:
            out += core.flush()
    out += core.flush()
    assert core.flush() == []
    return out


def test_overlap_gives_the_results_of_one_step_at_a_time(config):
    batches = overlap_batches()
    sync = run_sync(build_core(config), batches)
    assert [r.step_id for r in sync] == list(range(len(batches)))
    errors = [r.step_id for r in sync if r.error is not None]
    assert errors == [5], [r.error for r in sync]
    assert sync[4].rows == [0, 2, 1] and sync[3].rows == [0, 1, 2]
    assert sync[0].prompt_logprobs[0] and sync[0].top_logprobs[0]
    assert sync[10].rows == [] and sync[8].rows == []

    core = build_core(config)
    piped = run_pipelined(core, batches)
    assert encoded(piped) == encoded(sync)
    assert core.statistics().num_failed_steps == 1 and core.statistics().num_rows == 0

    flushes = set(random.Random(4).sample(range(len(batches)), 5))
    assert encoded(run_pipelined(build_core(config), batches, flushes)) == encoded(sync)


def test_next_forward_launches_before_the_previous_tokens_are_read(config, monkeypatch):
    core = build_core(config)
    events: list[str] = []
    forward = core.runner.forward
    core.runner.forward = lambda inp: (events.append("forward"), forward(inp))[1]
    results = core_module.sample_results
    monkeypatch.setattr(core_module, "sample_results",
                        lambda *a: (events.append("read"), results(*a))[1])  # fmt: skip
    for b in overlap_batches()[:4]:
        core.submit(b)
    core.flush()
    assert events == ["forward", "forward", "read", "forward", "read", "forward", "read", "read"]


def test_a_failed_forward_mid_pipeline_matches_one_step_at_a_time(config):
    batches = overlap_batches()

    def failing(core: ExecutorCore) -> ExecutorCore:
        forward, calls = core.runner.forward, [0]

        def f(inp):
            calls[0] += 1
            if calls[0] == 3:  # step 2's forward
                raise RuntimeError("device fell over")
            return forward(inp)

        core.runner.forward = f
        return core

    sync = run_sync(failing(build_core(config)), batches)
    assert "forward failed (RuntimeError)" in (sync[2].error or "")
    assert encoded(run_pipelined(failing(build_core(config)), batches)) == encoded(sync)


def test_a_step_that_fails_to_finish_fails_the_step_that_gathered_its_tokens(config, monkeypatch):
    core = build_core(config)
    results, calls = core_module.sample_results, [0]

    def read(*a):
        calls[0] += 1
        if calls[0] == 2:  # step 1's tokens
            raise RuntimeError("illegal memory access")
        return results(*a)

    monkeypatch.setattr(core_module, "sample_results", read)
    batches = overlap_batches()
    out = run_pipelined(core, batches[:4])
    assert [r.step_id for r in out] == [0, 1, 2, 3]
    assert out[0].error is None
    assert "illegal memory access" in (out[1].error or "")
    assert "LAST_SAMPLED of a row whose step 1 failed" in (out[2].error or "")
    # Step 2 never sampled: step 3's LAST_SAMPLED has nothing to feed back.
    assert "no pending sample" in (out[3].error or "")
    assert core.statistics().num_failed_steps == 3


def test_closing_a_row_with_a_sample_in_flight_keeps_its_token(config):
    core = build_core(config)
    b = Builder()
    first = b.batch([(0, [5, 6, 7])], opens=[(0, "a", GREEDY, 0)])
    second = b.batch([(1, [8, 9])], closes=[0], opens=[(1, "b", GREEDY, 0)])
    third = b.batch([(0, [LS])], opens=[(0, "c", GREEDY, 0)])  # a new row 0: no sample
    assert core.submit(first) == []
    (r0,) = core.submit(second)
    assert r0.rows == [0] and len(r0.token_ids) == 1 and r0.error is None
    (r1,) = core.submit(third)
    assert r1.rows == [1] and r1.error is None
    (r2,) = core.flush()
    assert "row 0, which has no pending sample" in (r2.error or "")
    assert core.flush() == []


def test_flush_with_nothing_submitted_and_step_with_a_step_in_flight(config):
    core = build_core(config)
    assert core.flush() == []
    b = Builder()
    assert core.submit(b.batch([(0, [5, 6])], opens=[(0, "a", GREEDY, 0)])) == []
    with pytest.raises(RuntimeError, match="flush"):
        core.step(b.batch([(0, [LS])]))
    (res,) = core.flush()
    assert res.step_id == 0 and res.rows == [0]


@pytest.fixture(params=[False, True], ids=["graphs", "eager"])
def cuda_config(request, config) -> ExecutorConfig:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return msgspec.structs.replace(
        config, device="cuda", dtype="float32", disable_cuda_graph=request.param
    )


@pytest.mark.gpu
def test_overlap_on_cuda_gives_the_results_of_one_step_at_a_time(cuda_config):
    batches = overlap_batches()
    sync = run_sync(build_core(cuda_config), batches)
    assert [r.step_id for r in sync if r.error is not None] == [5], [r.error for r in sync]
    assert encoded(run_pipelined(build_core(cuda_config), batches)) == encoded(sync)


TOP_P = SamplingParams(temperature=0.8, top_p=0.9, top_k=100, min_p=0.01)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "params", [GREEDY, TOP_P, SEEDED_PEN], ids=["greedy", "top_p", "penalties"]
)
def test_submitting_decode_steps_does_not_synchronize_the_device(cuda_config, params):
    """Under torch's sync debug mode "error" any synchronizing call (a blocking copy,
    .item(), .tolist() of a device tensor, nonzero) raises, and the step fails with it.
    Sampled rows too: a sync there would stall every step behind its own forward."""
    core, b = build_core(cuda_config), Builder()
    rows = range(8)
    opens = [(r, f"r{r}", params, r) for r in rows]
    assert core.step(b.batch([(r, [5 + r, 6, 7]) for r in rows], opens=opens)).error is None
    results = core.submit(b.batch([(r, [LS]) for r in rows]))  # warm-up: graphs, allocators
    results += core.submit(b.batch([(r, [LS]) for r in rows]))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            results += core.submit(b.batch([(r, [LS]) for r in rows]))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    results += core.flush()
    assert [r.error for r in results] == [None] * 6
    assert all(r.rows == list(rows) for r in results)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_mixed_prefill_and_decode_steps_do_not_synchronize_the_device(config, backend):
    """Steps that mix new prompts (eager: extend plans, logits of chosen rows) with
    decodes, and prompt logprobs: every host vector reaches the device by an
    asynchronous pinned copy, so the host runs ahead of the forward in flight."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = msgspec.structs.replace(config, device="cuda", dtype="float32",
                                  attention_backend=backend)  # fmt: skip
    core, b = build_core(cfg), Builder()
    warm = [(r, f"w{r}", TOP_P, r) for r in range(2)]
    results = [core.step(b.batch([(r, [5 + r, 6, 7]) for r in range(2)], opens=warm))]
    results += core.submit(b.batch([(0, [LS]), (1, [LS])]))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for k in range(3):  # each step: the running rows decode, a new row prefills
            row = 2 + k
            entries = [(r, [LS]) for r in range(row)] + [(row, [9, 8, 7, 6, 5][: 2 + k])]
            opens = [(row, f"n{row}", GREEDY_LP if k == 1 else SEEDED_PEN, row)]
            results += core.submit(b.batch(entries, opens=opens))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    results += core.flush()
    assert [r.error for r in results] == [None] * len(results)


@pytest.mark.gpu
def test_graphs_of_the_sizes_cuda_graph_bs_lists_give_the_eager_results(config):
    """--cuda-graph-bs 3 5: decode steps of 1-3 rows replay the size-3 graph (padded),
    4-5 rows the size-5 one; the tokens are those of eager steps (float32)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    base = msgspec.structs.replace(config, device="cuda", dtype="float32")
    graphs = build_core(msgspec.structs.replace(base, cuda_graph_bs=(3, 5)))
    assert graphs.runner.graphs is not None and graphs.runner.graphs.sizes == [3, 5]
    eager = build_core(msgspec.structs.replace(base, disable_cuda_graph=True))
    batches = overlap_batches()
    got, want = run_sync(graphs, batches), run_sync(eager, batches)
    assert [(r.token_ids, r.error) for r in got] == [(r.token_ids, r.error) for r in want]
    assert graphs.runner.graphs.num_replays > 0
