"""`shunter serve` without a model: the command line's exit codes and the plan that maps
server arguments (and the executor's Ready) onto each actor's config."""

from __future__ import annotations

import contextlib
import io
import socket
import subprocess
import sys

import anyio
import msgspec
import pytest

from shunter.actors.supervisor import EmbeddedActor, Supervisor, run_with_heartbeats
from shunter.actors.supervisor_core import ActorSpec, SupervisorConfig, SupervisorCore
from shunter.bus.inproc import InProcHub
from shunter.bus.messages import Ready
from shunter.ops import serve
from shunter.ops.launch import resolve
from shunter.ops.serve_plan import (
    EXECUTOR_ID,
    actor_specs,
    build_config,
    public_server_info,
    supervisor_config,
)
from shunter.ops.server_args import ServerArgs
from shunter.ops.server_cli import build_parser, parse_server_args

EXECUTOR_READY = {
    EXECUTOR_ID: Ready("executor", EXECUTOR_ID, {
        "num_pages": 4096, "page_size": 1, "max_context_len": 2048, "vocab_size": 49152,
        "eos_token_ids": "2,7",
    })
}  # fmt: skip


def _serve(*argv, timeout=60):
    return subprocess.run([sys.executable, "-m", "shunter", "serve", *argv],
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def _run_in_process(capsys, *argv):
    code = serve.run(build_parser().parse_args(list(argv)))
    return code, capsys.readouterr().err


def test_bad_options_exit_2_with_one_clear_line(capsys):
    code, err = _run_in_process(capsys, "--tp", "2")
    assert code == 2
    assert (
        err.strip()
        == "shunter serve: --tp-size 2: tensor parallelism is not supported yet (only 1)"
    )
    code, err = _run_in_process(capsys, "--model-path", "/nonexistent/model.gguf")
    assert code == 2
    assert "--model-path: model path '/nonexistent/model.gguf' does not exist" in err


def test_the_real_command_dispatches_to_serve():
    r = _serve("--help")
    assert r.returncode == 0
    for group in ("model:", "server:", "scheduling:", "memory:", "parallelism:", "logging:",
                  "deployment:"):  # fmt: skip
        assert group in r.stdout
    assert "--tensor-parallel-size" in r.stdout and "--config FILE" in r.stdout


def test_stages_put_the_gateway_last_and_satisfy_the_supervisor():
    a = ServerArgs()
    specs = actor_specs(a)
    by_stage = {s.actor_id: s.stage for s in specs}
    assert by_stage[EXECUTOR_ID] == 0 and by_stage["tokenizer"] == 0
    assert by_stage["cache"] == by_stage["scheduler"] == 1
    assert by_stage["gateway"] == max(by_stage.values())
    cfg = supervisor_config(parse_server_args(["--watchdog-timeout", "9", "--shutdown-timeout",
                                               "4", "--start-timeout", "99"]))  # fmt: skip
    assert (cfg.watchdog_timeout_s, cfg.shutdown_timeout_s, cfg.start_timeout_s) == (9, 4, 99)
    SupervisorCore(cfg)  # valid


def test_configs_follow_the_server_args_and_the_executor_ready():
    a = parse_server_args([
        "--max-total-tokens", "4096", "--page-size", "1", "--dtype", "float32",
        "--disable-radix-cache", "--schedule-policy", "lpm", "--max-prefill-num-token", "777",
        "--max-running-requests", "12", "--api-key", "sekret", "--port", "31234",
        "--served-model-name", "smol", "--enable-metrics", "--chunked-prefill-size", "128",
        "--stream-interval", "4", "--disable-overlap-schedule", "--weight-format", "int4",
    ])  # fmt: skip
    specs = {s.kind: s for s in actor_specs(a)}
    ex = build_config(specs["executor"], a, {}, seed=5)
    assert ex.weight_format == "int4"
    assert ex.max_num_rows == 12  # the scheduler's rows
    assert (ex.attention_backend, ex.cuda_graph_max_bs, ex.disable_cuda_graph) == ("auto", None,
                                                                                  False)  # fmt: skip
    assert ex.decode_attention_backend == "auto"
    gpu = parse_server_args(["--attention-backend", "triton", "--cuda-graph-max-bs", "48",
                             "--disable-cuda-graph", "--decode-attention-backend", "triton",
                             "--skip-server-warmup"])  # fmt: skip
    exg = build_config(specs["executor"], gpu, {}, seed=5)
    assert (exg.attention_backend, exg.cuda_graph_max_bs, exg.disable_cuda_graph) == ("triton", 48,
                                                                                  True)  # fmt: skip
    assert exg.decode_attention_backend == "triton"
    assert exg.skip_server_warmup and not ex.skip_server_warmup
    assert (ex.max_total_tokens, ex.dtype, ex.page_size, ex.actor_id) == (
        4096,
        "float32",
        1,
        EXECUTOR_ID,
    )
    assert ex.load_progress is False  # JSON log lines (stderr is not a terminal here)
    console = msgspec.structs.replace(a, log_format="console")
    assert build_config(specs["executor"], console, {}, seed=5).load_progress is True
    tok = build_config(specs["tokenizer"], a, {}, seed=5)
    assert tok.model_path is None and tok.actor_id == "tokenizer" and tok.stream_interval == 4
    cache = build_config(specs["cache"], a, EXECUTOR_READY, seed=5)
    assert (cache.num_pages, cache.page_size, cache.disable_radix_cache) == (4096, 1, True)
    sched = build_config(specs["scheduler"], a, EXECUTOR_READY, seed=5)
    assert (sched.max_prefill_tokens, sched.schedule_policy, sched.max_running_requests) == (
        777,
        "lpm",
        12,
    )
    assert (sched.max_context_len, sched.eos_token_ids, sched.seed) == (2048, (2, 7), 5)
    assert (sched.chunked_prefill_size, sched.num_total_pages) == (128, 4096)
    assert sched.max_batches_in_flight == 1  # --disable-overlap-schedule
    gw = build_config(specs["gateway"], a, EXECUTOR_READY, seed=5)
    assert (gw.port, gw.api_key, gw.served_model_name, gw.enable_metrics) == (
        31234,
        "sekret",
        "smol",
        True,
    )
    assert gw.max_context_len == 2048
    assert gw.server_info["api_key"] == "<set>" and "sekret" not in str(gw.server_info)
    assert gw.server_info["max_prefill_tokens"] == 777
    assert gw.server_info["max_total_num_tokens"] == 4096  # the executor's pool
    assert gw.server_info["executor"] == dict(EXECUTOR_READY[EXECUTOR_ID].info)


def test_sglang_scheduling_cache_and_graph_options_reach_their_actors():
    a = parse_server_args([
        "--enable-priority-scheduling", "--priority-scheduling-preemption-threshold", "3",
        "--prefill-max-requests", "2", "--retraction-policy", "priority",
        "--radix-eviction-policy", "lfu", "--cuda-graph-bs", "1", "4", "16",
        "--json-model-override-args", '{"num_hidden_layers": 2}', "--allow-auto-truncate",
        "--log-level-http", "info", "--decode-log-interval", "5",
    ])  # fmt: skip
    specs = {s.kind: s for s in actor_specs(a)}
    sched = build_config(specs["scheduler"], a, EXECUTOR_READY, seed=5)
    assert (sched.schedule_policy, sched.priority_preemption_threshold) == ("priority", 3)
    assert (sched.prefill_max_requests, sched.retraction_policy) == (2, "priority")
    assert sched.decode_log_interval == 5
    assert build_config(specs["cache"], a, EXECUTOR_READY, seed=5).eviction_policy == "lfu"
    ex = build_config(specs["executor"], a, {}, seed=5)
    assert ex.cuda_graph_bs == (1, 4, 16) and ex.model_overrides == {"num_hidden_layers": 2}
    assert build_config(specs["tokenizer"], a, {}, seed=5).allow_auto_truncate
    assert build_config(specs["gateway"], a, EXECUTOR_READY, seed=5).log_level_http == "info"
    plain = build_config(specs["scheduler"], parse_server_args([]), EXECUTOR_READY, seed=5)
    assert plain.priority_preemption_threshold is None and plain.schedule_policy == "fcfs"
    for argv, words in ((["--json-model-override-args", "[1]"], "JSON object"),
                        (["--cuda-graph-bs", "0"], ">= 1"),
                        (["--radix-eviction-policy", "slru"], "invalid choice")):  # fmt: skip
        err = io.StringIO()
        with contextlib.redirect_stderr(err), pytest.raises((ValueError, SystemExit)) as e:
            parse_server_args(argv)
        assert words in str(e.value) + err.getvalue()


def test_an_impossible_context_length_is_a_clear_start_error():
    a = parse_server_args(["--context-length", "100000"])
    spec = next(s for s in actor_specs(a) if s.kind == "scheduler")
    with pytest.raises(
        ValueError, match="--context-length 100000: longer than the model's maximum 2048"
    ):
        build_config(spec, a, EXECUTOR_READY, seed=0)


def test_public_server_info_hides_only_secrets():
    info = public_server_info(ServerArgs(admin_api_key="adm"))
    assert info["admin_api_key"] == "<set>" and info["api_key"] is None
    assert info["port"] == 30000


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
async def test_the_real_gateway_on_a_taken_port_fails_start_up_with_the_reason():
    """The gateway actor (no model needed) under the supervisor, its port already bound."""
    hub = InProcHub()
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    entry, config_type = resolve("gateway")
    config = config_type(port=port)

    async with anyio.create_task_group() as tg:

        async def launch(spec, ready):
            bus = hub.connect(spec.actor_id)
            handle = EmbeddedActor(
                spec.actor_id,
                lambda: run_with_heartbeats(spec.actor_id, lambda: entry(config, bus), bus, 0.2),
            )
            tg.start_soon(handle.run)
            return handle

        sup = Supervisor(SupervisorConfig([ActorSpec("gateway", "gateway", 0)]), hub.connect("supervisor"),
                         {"gateway": launch}, handle_signals=False)  # fmt: skip
        with anyio.fail_after(30):
            code = await sup.run()
        tg.cancel_scope.cancel()
    taken.close()
    assert code == 1
    assert sup.exit.reason.startswith("start-up failed: gateway stopped: raised OSError:")
    assert "address already in use" in sup.exit.reason.lower()


def test_device_checks_and_no_effect_notes(capsys):
    import torch

    from shunter.ops.serve import check_device, no_effect_notes

    check_device(ServerArgs())  # cpu/auto: nothing to check
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--device cuda: no CUDA device is available"):
            check_device(ServerArgs(device="cuda"))
        code, err = _run_in_process(capsys, "--attention-backend", "triton")
        assert code == 2 and "--attention-backend triton: no CUDA device is available" in err
        with pytest.raises(ValueError, match="--decode-attention-backend triton: no CUDA device"):
            check_device(ServerArgs(decode_attention_backend="triton"))
    assert no_effect_notes(ServerArgs()) == []
    assert no_effect_notes(ServerArgs(attention_backend="torch", disable_cuda_graph=True)) == []
    notes = no_effect_notes(ServerArgs(device="cpu", cuda_graph_max_bs=8))
    assert len(notes) == 1 and "only on a CUDA device" in notes[0]
    notes = no_effect_notes(ServerArgs(device="cpu", skip_server_warmup=True))
    assert notes == ["--skip-server-warmup: only a CUDA executor warms up"]
    notes = no_effect_notes(ServerArgs(trust_remote_code=True, enable_torch_compile=True))
    assert [n.split(":")[0] for n in notes] == ["--trust-remote-code", "--enable-torch-compile"]
