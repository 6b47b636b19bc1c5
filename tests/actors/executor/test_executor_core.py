"""ExecutorCore on the real default model (SmolLM2-135M GGUF, float32): ForwardBatch
messages driven by hand, as the scheduler would send them."""

from __future__ import annotations

import json
import math
import pathlib

import pytest

from shunter.actors.executor.core import ExecutorCore
from shunter.actors.executor.core_plan import VECTOR_MIN_LEN
from shunter.actors.executor.kv_pool import KVPool
from shunter.actors.executor.runner import ModelRunner
from shunter.actors.executor.warmup import warm_up
from shunter.bus.messages import LAST_SAMPLED, ForwardBatch, RowOpen, SamplingParams, StepResult

REFERENCE = json.loads(
    (
        pathlib.Path(__file__).resolve().parents[2] / "data" / "smollm2_greedy_reference.json"
    ).read_text()
)["prompts"]
PROMPTS = {p["name"]: p for p in REFERENCE}
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=32)


@pytest.fixture(scope="module")
def model(default_model):
    """(model, config) of the default GGUF in float32, loaded once per session."""
    return default_model


def make_core(model, *, page_size=1, num_pages=None) -> ExecutorCore:
    m, cfg = model
    pool = KVPool(cfg, num_pages or 2048 // page_size, page_size=page_size)
    return ExecutorCore(ModelRunner(m, pool), eos_token_ids=cfg.eos_token_ids)


class Driver:
    """Plays the scheduler's part: hands out pages and builds ForwardBatch diffs."""

    def __init__(self, core: ExecutorCore, first_page: int = 0) -> None:
        self.core = core
        self.ps = core.page_size
        self.next_page = first_page
        self.pages: dict[int, list[int]] = {}
        self.num_tokens: dict[int, int] = {}
        self.step_id = 0

    def _grow(self, row: int, upto: int) -> list[int]:
        need = -(-upto // self.ps) - len(self.pages[row])
        new = list(range(self.next_page, self.next_page + need))
        self.next_page += need
        self.pages[row] += new
        return new

    def step(self, entries, *, opens=(), closes=(), sample=None) -> StepResult:
        """entries: [(row, ids)]; ids may start with LAST_SAMPLED."""
        for o in opens:
            self.pages[o.row_idx] = list(o.prefix_pages)
            self.num_tokens[o.row_idx] = o.num_prefix_tokens
        rows, nnt, starts, ids, new_pages, nnp = [], [], [], [], [], []
        for row, toks in entries:
            start = self.num_tokens[row]
            new = self._grow(row, start + len(toks))
            rows.append(row), nnt.append(len(toks)), starts.append(start)
            ids += toks
            new_pages += new
            nnp.append(len(new))
            self.num_tokens[row] = start + len(toks)
        batch = ForwardBatch(
            step_id=self.step_id, opens=list(opens), closes=list(closes), rows=rows,
            num_new_tokens=nnt, start_pos=starts, input_ids=ids, new_pages=new_pages,
            num_new_pages=nnp, sample=sample if sample is not None else [True] * len(rows),
        )  # fmt: skip
        self.step_id += 1
        (res,) = self.core.handle(batch)
        assert isinstance(res, StepResult) and res.step_id == batch.step_id
        assert res.error is None, res.error
        return res


def open_row(row, sampling=GREEDY, seed=0, prefix_pages=(), num_prefix=0, prefix_ids=()):
    return RowOpen(row, f"req-{row}", list(prefix_pages), num_prefix, sampling, seed,
                   list(prefix_ids))  # fmt: skip


def generate(drv: Driver, rows_prompts, num_steps, sampling=GREEDY, seeds=None):
    """Prefill every (row, prompt) in one batch, then decode num_steps - 1 steps."""
    seeds = seeds or [0] * len(rows_prompts)
    opens = [open_row(r, sampling, s) for (r, _), s in zip(rows_prompts, seeds)]
    res = drv.step(list(rows_prompts), opens=opens)
    out = {r: [t] for r, t in zip(res.rows, res.token_ids)}
    for _ in range(num_steps - 1):
        res = drv.step([(r, [LAST_SAMPLED]) for r, _ in rows_prompts])
        for r, t in zip(res.rows, res.token_ids):
            out[r].append(t)
    return out


def test_greedy_matches_reference_and_eos(model):
    ref = PROMPTS["capital"]
    drv = Driver(make_core(model))
    out = generate(drv, [(0, ref["input_ids"])], len(ref["output_ids"]))
    assert out[0] == ref["output_ids"]
    assert out[0][-1] == 2  # the reference stops on eos
    st = drv.core.statistics()
    assert st.num_steps == len(ref["output_ids"]) and st.num_failed_steps == 0
    assert st.num_sampled == len(ref["output_ids"]) and st.num_rows == 1
    assert st.num_tokens_computed == len(ref["input_ids"]) + len(ref["output_ids"]) - 1


@pytest.mark.parametrize("page_size", [1, 16])
def test_warm_up_leaves_the_core_as_new(model, page_size):
    """After the warm-up steps: no open row, zeroed counters, and the same greedy
    tokens as a fresh core, on the very pages the warm-up wrote."""
    warmed = make_core(model, page_size=page_size)
    assert warm_up(warmed) == 5
    assert warmed.open_rows() == {}
    st = warmed.statistics()
    assert (st.num_steps, st.num_tokens_computed, st.num_sampled, st.num_rows) == (0, 0, 0, 0)
    prompts = [(0, PROMPTS["capital"]["input_ids"]), (1, PROMPTS["capital"]["input_ids"][:5])]
    fresh = generate(Driver(make_core(model, page_size=page_size)), prompts, 6)
    assert generate(Driver(warmed), prompts, 6) == fresh
    with pytest.raises(RuntimeError, match="no open row"):
        warm_up(warmed)  # rows 0 and 1 are open now


@pytest.mark.heavy
@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_greedy_matches_every_reference_prompt(model, name):
    ref = PROMPTS[name]
    out = generate(Driver(make_core(model)), [(0, ref["input_ids"])], len(ref["output_ids"]))
    assert out[0] == ref["output_ids"]


def test_batched_rows_of_different_lengths_match_reference(model):
    a, b = PROMPTS["capital"], PROMPTS["hashtable"]
    drv = Driver(make_core(model))
    out = generate(drv, [(3, a["input_ids"]), (7, b["input_ids"])], 6)
    assert out[3] == a["output_ids"][:6]
    assert out[7] == b["output_ids"][:6]


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_positions_are_the_same_either_way_they_are_built(model, monkeypatch, page_size):
    """A few entries' positions and rows are built as a run per entry, many entries'
    by expanding the counts: both give the same tokens, a cached prefix included."""
    from shunter.actors.executor import core as core_mod

    a, b = PROMPTS["capital"]["input_ids"], PROMPTS["hashtable"]["input_ids"]

    def run() -> dict[int, list[int]]:
        drv = Driver(make_core(model, page_size=page_size))
        generate(drv, [(0, a)], 1)
        ps = drv.ps
        num = (len(a) // 2) // ps * ps  # row 1 starts past row 0's cached first half
        opened = open_row(1, prefix_pages=drv.pages[0][: num // ps], num_prefix=num,
                          prefix_ids=a[:num])  # fmt: skip
        res = drv.step([(1, a[num:]), (2, b), (3, b[:9])], opens=[opened, open_row(2), open_row(3)])
        out = {r: [t] for r, t in zip(res.rows, res.token_ids)}
        for _ in range(3):
            res = drv.step([(r, [LAST_SAMPLED]) for r in (1, 2, 3)])
            for r, t in zip(res.rows, res.token_ids):
                out[r].append(t)
        return out

    runs = run()
    monkeypatch.setattr(core_mod, "SLICE_MAX_ENTRIES", 0)
    assert run() == runs
    assert runs[1] == PROMPTS["capital"]["output_ids"][:4]
    assert runs[2] == PROMPTS["hashtable"]["output_ids"][:4]


def test_prefix_cached_open_gives_same_tokens(model):
    ref = PROMPTS["capital"]
    ids, want = ref["input_ids"], ref["output_ids"]
    drv = Driver(make_core(model, page_size=16))
    first = generate(drv, [(0, ids)], 3)[0]
    assert first == want[:3]
    cached_pages = drv.pages[0][:2]  # the first 32 prompt tokens' KV, written by row 0
    # Row 0 ends; row 1 reuses its cached prefix and computes only the rest.
    opened = open_row(1, prefix_pages=cached_pages, num_prefix=32, prefix_ids=ids[:32])
    res = drv.step([(1, ids[32:])], opens=[opened], closes=[0])
    out = [res.token_ids[0]]
    for _ in range(len(want) - 1):
        out += drv.step([(1, [LAST_SAMPLED])]).token_ids
    assert out == want
    assert drv.core.open_rows() == {1: (len(ids) + len(want) - 1, 3)}


def test_chunked_prefill_and_prompt_logprobs(model):
    ref = PROMPTS["capital"]
    ids = ref["input_ids"]
    lp_params = SamplingParams(temperature=0.0, logprob_start_len=0, return_logprob=True,
                               top_logprobs_num=3)  # fmt: skip
    core = make_core(model)
    drv = Driver(core)
    one = drv.step([(0, ids)], opens=[open_row(0, lp_params)])
    # The same prompt in three chunks; only the last samples.
    drv2 = Driver(make_core(model))
    r1 = drv2.step([(0, ids[:10])], opens=[open_row(0, lp_params)], sample=[False])
    r2 = drv2.step([(0, ids[10:25])], sample=[False])
    r3 = drv2.step([(0, ids[25:])])
    assert r1.rows == [] and r2.rows == [] and r1.token_ids == []
    assert r3.token_ids == one.token_ids == ref["output_ids"][:1]
    whole = one.prompt_logprobs[0]
    chunked = r1.prompt_logprobs[0] + r2.prompt_logprobs[0] + r3.prompt_logprobs[0]
    assert len(whole) == len(chunked) == len(ids)
    assert math.isnan(whole[0]) and math.isnan(chunked[0])  # nothing predicts position 0
    assert all(v <= 0 for v in whole[1:])
    assert chunked[1:] == pytest.approx(whole[1:], abs=1e-4)
    # top_logprobs_num 3: each scored position's top 3, the same whole or chunked
    tops = one.prompt_top_logprobs[0]
    tops_chunked = [t for r in (r1, r2, r3) for t in r.prompt_top_logprobs[0]]
    assert len(tops) == len(tops_chunked) == len(ids) and tops[0] == tops_chunked[0] == []
    for lp, top, top_c in zip(whole[1:], tops[1:], tops_chunked[1:], strict=True):
        assert len(top) == 3 and top[0].logprob >= lp - 1e-6
        assert [t.token_id for t in top] == [t.token_id for t in top_c]
        assert [t.logprob for t in top] == pytest.approx([t.logprob for t in top_c], abs=1e-4)
    # The sampled token's raw logprob and top-3 agree with the prompt-logprob scale.
    assert one.logprobs[0] <= 0 and len(one.top_logprobs[0]) == 3
    assert one.top_logprobs[0][0].token_id == one.token_ids[0]  # greedy: the top-1
    assert one.top_logprobs[0][0].logprob == pytest.approx(one.logprobs[0])
    # logprob_start_len past the prefix start: only positions from it on.
    drv3 = Driver(make_core(model))
    later = SamplingParams(temperature=0.0, logprob_start_len=30)
    r = drv3.step([(0, ids)], opens=[open_row(0, later)])
    assert r.prompt_logprobs[0] == pytest.approx(whole[30:], abs=1e-4)
    assert r.logprobs == [] and r.prompt_top_logprobs == {}  # nobody asked for them
    # ... and when it falls inside the second of three chunks.
    drv4 = Driver(make_core(model))
    mid = SamplingParams(temperature=0.0, logprob_start_len=12)
    parts = [drv4.step([(0, ids[:10])], opens=[open_row(0, mid)], sample=[False]),
             drv4.step([(0, ids[10:25])], sample=[False]), drv4.step([(0, ids[25:])])]  # fmt: skip
    assert [len(p.prompt_logprobs[0]) for p in parts] == [0, 13, len(ids) - 25]
    got = [v for p in parts for v in p.prompt_logprobs[0]]
    assert got == pytest.approx(whole[12:], abs=1e-4)
    # token_ids_logprob: each scored position's asked ids after its top tokens, chunked
    # or whole; an asked id that is the position's own token has its prompt logprob.
    asked = SamplingParams(temperature=0.0, logprob_start_len=0, return_logprob=True,
                           top_logprobs_num=1, token_ids_logprob=[ids[5], 17])  # fmt: skip
    drv5 = Driver(make_core(model))
    parts = [drv5.step([(0, ids[:10])], opens=[open_row(0, asked)], sample=[False]),
             drv5.step([(0, ids[10:])])]  # fmt: skip
    tops = [t for p in parts for t in p.prompt_top_logprobs[0]]
    assert tops[0] == [] and all(len(t) == 3 for t in tops[1:])
    assert all([x.token_id for x in t[1:]] == [ids[5], 17] for t in tops[1:])
    assert tops[5][1].logprob == pytest.approx(whole[5], abs=1e-4)
    assert [t[0].token_id for t in tops[1:]] == [
        t[0].token_id for t in one.prompt_top_logprobs[0][1:]
    ]
    assert [x.token_id for x in parts[1].top_logprobs[0]] == [one.token_ids[0], ids[5], 17]


def test_seeded_sampling_reproduces_in_other_batches(model):
    a, b = PROMPTS["tips"]["input_ids"], PROMPTS["poem"]["input_ids"]
    hot = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=8)
    alone = generate(Driver(make_core(model)), [(0, a)], 5, hot, seeds=[42])[0]
    drv = Driver(make_core(model), first_page=100)
    both = generate(drv, [(5, b), (2, a)], 5, hot, seeds=[7, 42])
    assert both[2] == alone
    other = generate(Driver(make_core(model)), [(0, a)], 5, hot, seeds=[43])[0]
    assert other != alone


def _batch(**kw) -> ForwardBatch:
    base = dict(step_id=99, rows=[0], num_new_tokens=[1], start_pos=[0], input_ids=[5],
                new_pages=[0], num_new_pages=[1], sample=[True])  # fmt: skip
    base.update(kw)
    return ForwardBatch(**base)


def test_malformed_batches_fail_the_step_and_change_nothing(model):
    core = make_core(model, num_pages=64)
    drv = Driver(core)
    first = drv.step([(0, [1, 2, 3])], opens=[open_row(0)])
    before = core.open_rows()
    assert before == {0: (3, 3)}
    bad = {
        "is not open": _batch(rows=[4]),
        "page overflow": _batch(start_pos=[3], new_pages=[], num_new_pages=[0]),
        "holds KV for 3": _batch(start_pos=[2], new_pages=[3]),
        "outside [0, 64)": _batch(start_pos=[3], new_pages=[64]),
        "input id outside": _batch(start_pos=[3], new_pages=[3], input_ids=[10**6]),
        "LAST_SAMPLED is only valid first": _batch(
            start_pos=[3], new_pages=[3, 4], num_new_pages=[2], num_new_tokens=[2],
            input_ids=[LAST_SAMPLED, LAST_SAMPLED]),
        "already open": _batch(opens=[open_row(0)], start_pos=[3], new_pages=[3]),
        "temperature": _batch(opens=[open_row(1, SamplingParams(temperature=-1.0))], rows=[1]),
        "input ids for": _batch(start_pos=[3], new_pages=[3], input_ids=[1, 2]),
        "sample has": _batch(start_pos=[3], new_pages=[3], sample=[]),
        "appears twice": _batch(rows=[0, 0], num_new_tokens=[1, 1], start_pos=[3, 3],
                                input_ids=[1, 1], new_pages=[3], num_new_pages=[1, 0],
                                sample=[True, True]),
        "prefix tokens in": _batch(opens=[open_row(2, num_prefix=5, prefix_pages=[9])], rows=[2],
                                   start_pos=[5]),
    }  # fmt: skip
    for needle, batch in bad.items():
        (res,) = core.handle(batch)
        assert res.error is not None and needle in res.error, (needle, res.error)
        assert res.rows == [] and res.token_ids == [] and res.step_id == 99
        assert core.open_rows() == before, needle
    # LAST_SAMPLED on a fresh row (it never sampled).
    (res,) = core.handle(_batch(opens=[open_row(3)], rows=[3], input_ids=[LAST_SAMPLED]))
    assert "no pending sample" in res.error
    st = core.statistics()
    assert st.num_failed_steps == len(bad) + 1 and st.last_error == res.error

    # The mirror is intact: the row continues as if nothing happened.
    ok = drv.step([(0, [LAST_SAMPLED])])
    assert ok.rows == [0] and len(ok.token_ids) == 1
    assert first.token_ids[0] in range(core.vocab_size)
    # A batch of row diffs only: no forward, the diffs apply.
    (res,) = core.handle(
        _batch(
            rows=[],
            num_new_tokens=[],
            start_pos=[],
            input_ids=[],
            new_pages=[],
            num_new_pages=[],
            sample=[],
            opens=[open_row(6)],
        )
    )
    assert res.error is None and res.rows == []
    assert core.open_rows() == {0: (4, 4), 6: (0, 0)}
    # Closing an unknown row is an idempotent no-op, counted.
    (res,) = core.handle(_batch(closes=[0, 12], opens=[open_row(0)], new_pages=[40]))
    assert res.error is None and res.rows == [0]
    assert core.statistics().num_unknown_closes == 1
    assert core.open_rows() == {0: (1, 1), 6: (0, 0)}


@pytest.mark.parametrize("at", [0, 37, VECTOR_MIN_LEN + 5])
def test_long_batches_are_range_checked_on_their_tensors(model, at):
    """Past VECTOR_MIN_LEN ids or pages the plan checks ranges with torch.aminmax:
    the same errors, wherever the bad item sits, and the mirror is unchanged."""
    core = make_core(model, num_pages=256)
    drv = Driver(core)
    drv.step([(0, [1, 2, 3])], opens=[open_row(0)])
    before = core.open_rows()
    n = VECTOR_MIN_LEN + 6

    def long(ids=None, pg=None) -> ForwardBatch:
        return _batch(start_pos=[3], num_new_tokens=[n], num_new_pages=[n],
                      input_ids=ids or [7] * n, new_pages=pg or list(range(3, 3 + n)))  # fmt: skip

    def put(values, v):
        return [*values[:at], v, *values[at + 1 :]]

    pages = list(range(3, 3 + n))
    bad = {
        "input id outside": [long(ids=put([7] * n, 10**6)), long(ids=put([7] * n, -2))],
        "outside [0, 256)": [long(pg=put(pages, 256)), long(pg=put(pages, -1))],
        "a prefix page is outside": [
            _batch(
                opens=[open_row(2, prefix_pages=put(pages, bad), num_prefix=n)],
                rows=[2],
                start_pos=[n],
                new_pages=[200],
            )
            for bad in (256, -1)
        ],
    }
    if at:
        bad["only valid first"] = [long(ids=put([7] * n, LAST_SAMPLED))]
    for needle, batches in bad.items():
        for batch in batches:
            (res,) = core.handle(batch)
            assert res.error is not None and needle in res.error, (needle, res.error)
            assert core.open_rows() == before, needle
    # The same long entry, well formed, after a resolved LAST_SAMPLED entry of another row.
    drv.step([(1, [4, 5])], opens=[open_row(1)])
    ok = drv.step([(1, [LAST_SAMPLED]), (0, [7] * n)])
    assert ok.error is None and ok.rows == [1, 0]
    assert core.open_rows() == {0: (3 + n, 3 + n), 1: (3, 3)}
    # A long entry that starts with LAST_SAMPLED: resolved to the row's pending sample,
    # it runs as the same entry with that token written out.
    tail = [9] * n
    got = drv.step([(1, [LAST_SAMPLED, *tail])])
    twin = Driver(make_core(model, num_pages=256))
    twin.step([(0, [1, 2, 3])], opens=[open_row(0)])
    twin.step([(1, [4, 5])], opens=[open_row(1)])
    assert twin.step([(1, [LAST_SAMPLED]), (0, [7] * n)]).token_ids == ok.token_ids
    assert twin.step([(1, [ok.token_ids[0], *tail])]).token_ids == got.token_ids


def test_resumed_request_continues_its_seeded_stream(model):
    """A retracted request comes back as a new row whose prompt holds its earlier
    outputs (RowOpen.num_output_tokens): penalties, min_new_tokens and the generator
    pick up where the first run was, so the same tokens follow."""
    ids = PROMPTS["tips"]["input_ids"]
    sp = SamplingParams(temperature=0.8, frequency_penalty=0.4, min_new_tokens=8)
    drv = Driver(make_core(model))
    first = generate(drv, [(0, ids)], 6, sp, seeds=[2024])[0]
    resumed = RowOpen(4, "req-0", [], 0, sp, 2024, [], num_output_tokens=3)
    res = drv.step([(4, ids + first[:3])], opens=[resumed], closes=[0])
    out = res.token_ids + drv.step([(4, [LAST_SAMPLED])]).token_ids
    out += drv.step([(4, [LAST_SAMPLED])]).token_ids
    assert out == first[3:]


@pytest.mark.heavy
def test_bench_executor_prints_a_json_summary_last():
    """`shunter bench executor` end to end, small, our engine only."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "shunter", "bench", "executor", "--skip-hf", "--decode-steps", "2",
         "--batch-sizes", "1,3", "--prefill-len", "16", "--decode-prompt-len", "8",
         "--repeats", "1", "--page-size", "4"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("prefill_tok_s", "decode_tok_s_bs1", "decode_tok_s_bs3"):
        assert summary[key] > 0
    assert "hf_prefill_tok_s" not in summary
