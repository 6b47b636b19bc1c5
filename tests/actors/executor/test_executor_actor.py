"""The executor actor on the real in-process bus, under anyio: load (seeded dummy weights
of a small Llama config), Ready, batches in, StepResults out; and its overlap: with a
step in flight and no batch queued, it waits for whichever comes first, the next batch
(submitted at once) or the step being done on the device (then flushed)."""

from __future__ import annotations

import contextlib
import json
import threading

import anyio
import pytest

from shunter.actors.executor.actor import build_core, run
from shunter.actors.executor.config import ExecutorConfig
from shunter.bus.inproc import InProcHub
from shunter.bus.messages import (
    LAST_SAMPLED,
    ForwardBatch,
    HealthPing,
    Ready,
    RowOpen,
    SamplingParams,
    StepResult,
)

# A small Llama (random weights, seeded), so these tests measure the shell, not the model.
TINY_LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512,
                  hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  eos_token_id=2, tie_word_embeddings=True)  # fmt: skip
PROMPT = [1, 90, 198, 283, 359, 253, 56, 46, 111, 365, 311]  # 11 tokens


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> ExecutorConfig:
    d = tmp_path_factory.mktemp("tiny_llama")
    (d / "config.json").write_text(json.dumps(TINY_LLAMA))
    return ExecutorConfig(model_path=str(d), load_format="dummy", seed=3, max_total_tokens=256,
                          page_size=4, load_progress=False, device="cpu")  # fmt: skip


@pytest.fixture
def anyio_backend():
    return "asyncio"


def batches() -> list[ForwardBatch]:
    """Prefill (pages 0-2 of 4 tokens), three decode steps using LAST_SAMPLED, one
    malformed batch (page overflow), then a decode step that must still work."""
    sp = SamplingParams(temperature=0.7, top_k=50, return_logprob=True)
    out = [
        ForwardBatch(
            step_id=0,
            opens=[RowOpen(0, "r0", [], 0, sp, 11)],
            rows=[0],
            num_new_tokens=[11],
            start_pos=[0],
            input_ids=PROMPT,
            new_pages=[5, 9, 2],
            num_new_pages=[3],
            sample=[True],
        ),
    ]
    pages = {12: [7], 13: [], 14: []}
    for step, pos in enumerate((11, 12, 13), start=1):
        out.append(ForwardBatch(step_id=step, rows=[0], num_new_tokens=[1], start_pos=[pos],
                                input_ids=[LAST_SAMPLED], new_pages=pages.get(pos, []),
                                num_new_pages=[len(pages.get(pos, []))], sample=[True]))  # fmt: skip
    out.append(ForwardBatch(step_id=4, rows=[0], num_new_tokens=[3], start_pos=[14],
                            input_ids=[LAST_SAMPLED, 5, 6], sample=[True], num_new_pages=[0]))  # fmt: skip
    out.append(ForwardBatch(step_id=5, rows=[0], num_new_tokens=[1], start_pos=[14],
                            input_ids=[LAST_SAMPLED], sample=[True], num_new_pages=[0]))  # fmt: skip
    return out


@pytest.mark.anyio
async def test_ready_and_steps_match_a_core_driven_directly(config):
    hub = InProcHub()
    exec_bus, sched_bus = hub.connect("executor.0"), hub.connect("scheduler")
    results: list[StepResult] = []
    async with anyio.create_task_group() as tg:
        async with sched_bus.subscribe("sched.result", "health.ready") as sub:
            tg.start_soon(run, config, exec_bus)
            with anyio.fail_after(120):
                ready = (await sub.receive()).msg
            assert isinstance(ready, Ready) and ready.actor == "executor"
            assert ready.actor_id == "executor.0"
            info = ready.info
            assert info["num_pages"] == 64 and info["page_size"] == 4
            assert info["vocab_size"] == 512 and info["eos_token_ids"] == "2"
            assert info["max_context_len"] == 1024 and info["num_layers"] == 2
            assert (info["attention_backend"], info["decode_attention_backend"]) == ("torch",
                                                                                   "auto")  # fmt: skip
            # Everything sent back to back: the executor resolves LAST_SAMPLED itself.
            for b in batches():
                await sched_bus.publish(b)
            with anyio.fail_after(120):
                for _ in batches():
                    results.append((await sub.receive()).msg)
        tg.cancel_scope.cancel()

    assert [r.step_id for r in results] == [0, 1, 2, 3, 4, 5]
    assert all(r.forward_us > 0 for r in results)
    bad = results[4]
    assert bad.error is not None and "page overflow" in bad.error and bad.rows == []
    good = [r for r in results if r.error is None]
    assert len(good) == 5 and all(r.rows == [0] and len(r.token_ids) == 1 for r in good)
    assert all(r.logprobs[0] <= 0 for r in good)

    # The same inbox fed to a core built from the same config gives the same outbox:
    # the bus round trip changes nothing, and dummy weights are seeded.
    core = build_core(config)
    direct = [core.handle(b)[0] for b in batches()]
    assert [r.token_ids for r in direct] == [r.token_ids for r in results]
    assert [r.error for r in direct] == [r.error for r in results]
    assert core.statistics().num_failed_steps == 1


@pytest.mark.anyio
async def test_forward_runs_off_the_event_loop(config):
    """While a forward is in progress the loop still routes messages: the forward is
    held until the test has done a bus round trip; a blocked loop could not do it."""
    core = build_core(config)
    release = threading.Event()
    entered = threading.Event()
    real_forward = core.runner.forward

    released_by_test: list[bool] = []

    def held_forward(inp):
        entered.set()
        # On the loop thread this wait would block the loop, so the test could never
        # release it: it would time out and record False.
        released_by_test.append(release.wait(timeout=10))
        return real_forward(inp)

    core.runner.forward = held_forward
    hub = InProcHub()
    exec_bus, sched_bus, other = (hub.connect(n) for n in ("executor.0", "scheduler", "other"))
    async with anyio.create_task_group() as tg:
        async with (
            sched_bus.subscribe("sched.result", "health.ready") as sub,
            sched_bus.subscribe("health.ping") as pings,
        ):
            tg.start_soon(lambda: run(config, exec_bus, core=core))
            with anyio.fail_after(30):
                assert isinstance((await sub.receive()).msg, Ready)
                await sched_bus.publish(batches()[0])
                while not entered.is_set():
                    await anyio.sleep(0.005)
                await other.publish(HealthPing("p1"))
                got = (await pings.receive()).msg
                assert got == HealthPing("p1") and not release.is_set()
                release.set()
                res = (await sub.receive()).msg
        tg.cancel_scope.cancel()
    assert released_by_test == [True]
    assert isinstance(res, StepResult) and res.error is None and res.rows == [0]
    assert res.forward_us > 0


def overlap_batches() -> list[ForwardBatch]:
    sp = SamplingParams(temperature=0.6, top_k=20, seed=None)
    out = [ForwardBatch(step_id=0, opens=[RowOpen(0, "r0", [], 0, sp, 7)], rows=[0],
                        num_new_tokens=[6], start_pos=[0], input_ids=[1, 5, 9, 13, 17, 21],
                        new_pages=[0, 1], num_new_pages=[2], sample=[True])]  # fmt: skip
    for step, pos in enumerate((6, 7, 8), start=1):
        pages = [2] if pos == 8 else []
        out.append(ForwardBatch(step_id=step, rows=[0], num_new_tokens=[1], start_pos=[pos],
                                input_ids=[LAST_SAMPLED], new_pages=pages,
                                num_new_pages=[len(pages)], sample=[True]))  # fmt: skip
    return out


@contextlib.asynccontextmanager
async def actor_on_hub(config, core):
    """The executor actor serving `core` on an in-process hub, Ready: yields the
    scheduler's bus and its subscription to the results."""
    hub = InProcHub()
    exec_bus, sched_bus = hub.connect("executor.0"), hub.connect("scheduler")
    async with anyio.create_task_group() as tg:
        async with sched_bus.subscribe("sched.result", "health.ready") as sub:
            tg.start_soon(lambda: run(config, exec_bus, core=core))
            with anyio.fail_after(60):
                assert isinstance((await sub.receive()).msg, Ready)
                yield sched_bus, sub
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_a_batch_arriving_before_the_device_is_done_is_submitted_first(config):
    """The device is played by a gate the test opens: until then each step stays in
    flight, and each next batch is submitted (answering the step before it)."""
    core = build_core(config)
    gate, waiting = threading.Event(), threading.Semaphore(0)

    def wait_step_ready() -> None:  # the device, done when the test opens the gate
        waiting.release()
        gate.wait(timeout=30)

    core.step_ready = gate.is_set
    core.wait_step_ready = wait_step_ready
    bs, got = overlap_batches(), []
    async with actor_on_hub(config, core) as (sched_bus, sub):
        for b in bs:
            await sched_bus.publish(b)
            # in flight, nothing queued: the shell waits for a batch or the device
            await anyio.to_thread.run_sync(waiting.acquire)
            if b.step_id:  # the next submit answered the step before it
                got.append((await sub.receive()).msg)
        assert not gate.is_set() and [r.step_id for r in got] == [0, 1, 2]
        gate.set()  # the device finishes step 3: flushed
        got.append((await sub.receive()).msg)

    assert [r.step_id for r in got] == [0, 1, 2, 3]
    assert all(r.error is None and r.forward_us > 0 for r in got)
    direct = build_core(config)
    assert [r.token_ids for r in got] == [direct.step(b).token_ids for b in bs]


@pytest.mark.anyio
async def test_a_step_done_on_the_cpu_is_answered_before_the_next_is_submitted(config):
    """On a CPU a forward runs inside submit, so a step is done when submit returns: its
    result goes out before the next batch (already queued) is submitted, not a step late."""
    core = build_core(config)
    calls: list[str] = []
    queued = threading.Event()
    submit, flush = core.submit, core.flush

    def logged_submit(b):
        if b.step_id == 0:
            queued.wait(timeout=30)  # step 1 is queued while step 0 runs
        calls.append(f"submit {b.step_id}")
        return submit(b)

    def logged_flush():
        out = flush()
        calls.extend(f"answer {r.step_id}" for r in out)
        return out

    core.submit, core.flush = logged_submit, logged_flush
    bs = overlap_batches()[:2]
    async with actor_on_hub(config, core) as (sched_bus, sub):
        for b in bs:
            await sched_bus.publish(b)
        queued.set()
        got = [(await sub.receive()).msg for _ in bs]
    assert [r.step_id for r in got] == [0, 1]
    assert calls == ["submit 0", "answer 0", "submit 1", "answer 1"]


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        (dict(dtype="float64"), "dtype"),
        (dict(load_format="onnx"), "load_format"),
        (dict(device="tpu"), "device"),
        (dict(page_size=0), "page_size"),
        (dict(max_total_tokens=0), "max_total_tokens"),
        (dict(mem_fraction_static=1.5), "mem_fraction_static"),
        (dict(context_length=0), "context_length"),
        (dict(num_threads=0), "num_threads"),
        (dict(max_num_rows=0), "max_num_rows"),
        (dict(weight_format="fp4"), "weight_format"),
        (dict(attention_backend="sdpa"), "attention_backend"),
        (dict(decode_attention_backend="torch"), "decode_attention_backend"),
    ],
)
def test_config_rejects_bad_values(kw, needle):
    with pytest.raises(ValueError, match=needle):
        ExecutorConfig(**kw)


def test_weight_format_reaches_the_model():
    from shunter.actors.executor.models.quant import PackedLinear

    core = build_core(
        ExecutorConfig(max_total_tokens=64, load_progress=False, weight_format="int8")
    )
    packed = [m for m in core.runner.model.modules() if isinstance(m, PackedLinear)]
    assert packed and all(m.fmt == "int8" for m in packed)


@pytest.mark.anyio
async def test_missing_model_fails_the_actor_with_a_clear_error(tmp_path):
    from shunter.actors.executor.loader import LoadError

    bus = InProcHub().connect("executor.0")
    config = ExecutorConfig(model_path=str(tmp_path / "nope"), device="cpu", load_progress=False)
    with pytest.raises(LoadError, match="does not exist"):
        await run(config, bus)


@pytest.mark.anyio
async def test_a_slow_step_is_logged_with_its_tokens_rows_and_path(config, monkeypatch):
    """Every step counts as slow here (threshold 0): each is logged with what it held
    and how the runner ran it (eagerly on a CPU); a batch refused before its forward
    says it did not run."""
    from structlog.testing import capture_logs

    from shunter.actors.executor import actor as actor_mod

    monkeypatch.setattr(actor_mod, "SLOW_STEP_S", 0.0)
    hub = InProcHub()
    exec_bus, sched_bus = hub.connect("executor.0"), hub.connect("scheduler")
    sent = batches()[:2] + batches()[4:5]  # a prefill, a decode, a refused batch
    with capture_logs() as logs:
        async with anyio.create_task_group() as tg:
            async with sched_bus.subscribe("sched.result", "health.ready") as sub:
                tg.start_soon(run, config, exec_bus)
                with anyio.fail_after(120):
                    assert isinstance((await sub.receive()).msg, Ready)
                for b in sent:
                    await sched_bus.publish(b)
                with anyio.fail_after(120):
                    for _ in sent:
                        await sub.receive()
            tg.cancel_scope.cancel()
    slow = [(e["step_id"], e["tokens"], e["rows"], e["path"]) for e in logs
            if e["event"] == "slow step"]  # fmt: skip
    assert slow == [(0, 11, 1, "eager"), (1, 1, 1, "eager"), (4, 3, 1, "not run")]
    assert all(e["ms"] >= 0 for e in logs if e["event"] == "slow step")
