"""Server arguments: every alias, the config file, and each validation message."""

from __future__ import annotations

import argparse
import contextlib
import io

import msgspec
import pytest

from shunter.ops.server_args import FIELDS, GROUPS, OPTIONS, ServerArgs, check_paths
from shunter.ops.server_cli import build_parser, parse_server_args, server_args_from

# A value for each option that differs from its default (flags are just present).
SAMPLE: dict[str, str | None] = {
    "model_path": "smollm2", "tokenizer_path": "/tmp", "load_format": "gguf", "dtype": "float32",
    "weight_format": "int4", "skip_tokenizer_init": None, "enable_memory_saver": None,
    "tool_call_parser": "qwen25",
    "device": "cpu", "context_length": "1024", "served_model_name": "m", "chat_template": "{{x}}",
    "random_seed": "7", "host": "0.0.0.0", "port": "31000", "api_key": "k", "admin_api_key": "a",
    "enable_metrics": None, "schedule_policy": "lpm", "max_running_requests": "8",
    "max_queued_requests": "100",
    "max_prefill_tokens": "512", "chunked_prefill_size": "256", "disable_radix_cache": None,
    "disable_overlap_schedule": None, "stream_interval": "4", "max_total_tokens": "4096",
    "mem_fraction_static": "0.5", "page_size": "16", "cuda_graph_max_bs": "32",
    "disable_cuda_graph": None, "skip_server_warmup": None, "attention_backend": "torch",
    "decode_attention_backend": "triton", "tp_size": "1", "dp_size": "1", "pp_size": "1",
    "log_level": "debug", "log_format": "json", "record_events": "/tmp/ev", "bus_dir": "/tmp/bus",
    "multi_process": None, "shutdown_timeout": "5", "watchdog_timeout": "60",
    "heartbeat_interval": "0.5", "start_timeout": "30",
    # accepted so that SGLang (and vLLM) command lines run
    "trust_remote_code": None, "revision": "main", "tokenizer_mode": "auto",
    "schedule_conservativeness": "1.3", "enable_mixed_chunk": None, "kv_cache_dtype": "auto",
    "enable_torch_compile": None, "ep_size": "1", "nnodes": "1", "node_rank": "0",
    "dist_init_addr": "10.0.0.1:5000", "log_requests": None, "enable_cache_report": None,
    "json_model_override_args": '{"num_hidden_layers": 2}', "allow_auto_truncate": None,
    "prefill_max_requests": "4", "retraction_policy": "priority",
    "enable_priority_scheduling": None, "priority_scheduling_preemption_threshold": "5",
    "radix_eviction_policy": "lfu", "cuda_graph_bs": "1 2 8", "log_level_http": "warning",
    "decode_log_interval": "10", "incremental_streaming_output": None,
    "kv_events_config": '{"publisher": "zmq"}',
    "enable_hierarchical_cache": None, "hicache_ratio": "3.5", "hicache_size": "4",
    "hicache_write_policy": "write_through_selective", "hicache_storage_backend": "file",
    "hicache_storage_dir": "/tmp/st", "hicache_storage_prefetch_policy": "wait_complete",
    "hicache_storage_max_size": "2.5",
    "disable_piecewise_cuda_graph": None, "enable_piecewise_cuda_graph": None,
    "piecewise_cuda_graph_max_tokens": "1024",
    "piecewise_cuda_graph_tokens": "16 64 256",
}  # fmt: skip
LISTS = {"cuda_graph_bs", "piecewise_cuda_graph_tokens"}  # fields given as several values
# what a field's flag is given with in the alias test (it needs these to be valid)
NEEDS: dict[str, list[str]] = {
    "hicache_storage_backend": ["--enable-hierarchical-cache"],
    "hicache_storage_max_size": ["--enable-hierarchical-cache", "--hicache-storage-backend", "file"],
}  # fmt: skip
ALIASES = [(field, flag) for field, flags, _, _ in OPTIONS for flag in flags]


def test_sample_covers_every_field():
    assert set(SAMPLE) == FIELDS


@pytest.mark.parametrize(("field", "flag"), ALIASES, ids=[f for _, f in ALIASES])
def test_every_alias_parses_to_its_field(field, flag):
    value = SAMPLE[field]
    argv = [flag] if value is None else [flag, *value.split(" ")] if field in LISTS \
        else [flag, value]  # fmt: skip
    args = parse_server_args(argv + NEEDS.get(field, []))
    if field in LISTS:
        expected = [int(v) for v in value.split()]
    else:
        expected = True if value is None else type(getattr(args, field))(value)
    assert getattr(args, field) == expected
    # ...and nothing else moved from its default.
    default = ServerArgs()
    others = {f for f in FIELDS if getattr(args, f) != getattr(default, f)}
    needed = {f for f, flags, _, _ in OPTIONS if set(flags) & set(NEEDS.get(field, []))}
    assert others == ({field} if getattr(default, field) != expected else set()) | needed


def test_sglang_aliases_are_declared():
    declared = {flag for _, flag in ALIASES}
    for flag in ("--model", "--tp", "--dp", "--pp", "--tensor-parallel-size",
                 "--data-parallel-size", "--pipeline-parallel-size", "--max-prefill-num-token"):  # fmt: skip
        assert flag in declared


def test_vllm_spellings_and_dtype_aliases():
    a = parse_server_args(["--max-model-len", "2048", "--max-num-seqs", "8", "--seed", "3",
                           "--gpu-memory-utilization", "0.8", "--enforce-eager",
                           "--block-size", "16", "--dtype", "half"])  # fmt: skip
    assert (a.context_length, a.max_running_requests, a.random_seed) == (2048, 8, 3)
    assert (a.mem_fraction_static, a.disable_cuda_graph, a.page_size) == (0.8, True, 16)
    assert a.dtype == "float16" and parse_server_args(["--dtype", "bf16"]).dtype == "bfloat16"


@pytest.mark.parametrize("argv", [["--quantization", "fp8"], ["--enable-lora"],
                                  ["--lora-paths", "a", "b"], ["--speculative-algorithm", "EAGLE"],
                                  ["--kv-cache-dtype", "fp8_e4m3"], ["--nnodes", "2"],
                                  ["--ep", "2"], ["--hicache-storage-backend", "mooncake"],
                                  ["--hicache-io-backend", "kernel"], ["--tokenizer-worker-num", "4"],
                                  ["--attn-cp-size", "2"]])  # fmt: skip
def test_unsupported_sglang_options_say_why(argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            parse_server_args(argv)
        except SystemExit as e:
            assert e.code == 2
            message = err.getvalue()
        except ValueError as e:
            message = str(e)
        else:
            raise AssertionError(f"{argv} was accepted")
    assert argv[0] in message or "--ep-size" in message, message
    assert "not supported" in message or "invalid choice" in message, message


def test_every_sglang_prefetch_policy_parses_and_others_are_refused():
    for policy in ("wait_complete", "best_effort", "timeout"):
        a = parse_server_args(["--enable-hierarchical-cache", "--hicache-storage-backend", "file",
                               "--hicache-storage-prefetch-policy", policy])  # fmt: skip
        assert a.hicache_storage_prefetch_policy == policy
    with pytest.raises(ValueError, match="must be one of wait_complete, best_effort, timeout"):
        parse_server_args(["--hicache-storage-prefetch-policy", "soon"])


def test_the_file_store_size_cap_needs_a_file_store_and_a_positive_size():
    store = ["--enable-hierarchical-cache", "--hicache-storage-backend", "file"]
    a = parse_server_args([*store, "--hicache-storage-max-size", "0.5"])
    assert a.hicache_storage_max_size == 0.5
    assert parse_server_args(store).hicache_storage_max_size is None  # no cap by default
    for argv, message in [
        ([*store, "--hicache-storage-max-size", "0"],
         "--hicache-storage-max-size 0.0: must be > 0"),
        ([*store, "--hicache-storage-max-size", "-2"],
         "--hicache-storage-max-size -2.0: must be > 0"),
        (["--enable-hierarchical-cache", "--hicache-storage-max-size", "1"],
         "--hicache-storage-max-size 1.0: needs --hicache-storage-backend file"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            parse_server_args(argv)
    err = io.StringIO()
    with pytest.raises(SystemExit), contextlib.redirect_stderr(err):
        parse_server_args([*store, "--hicache-storage-max-size", "lots"])
    assert "--hicache-storage-max-size" in err.getvalue()


def test_no_prefix_abbreviation():
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        parse_server_args(["--max-prefill", "10"])
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        parse_server_args(["--tensor", "1"])


def test_defaults_are_sglangs():
    a = parse_server_args([])
    assert (a.host, a.port, a.tp_size, a.max_prefill_tokens, a.schedule_policy, a.page_size) == (
        "127.0.0.1", 30000, 1, 16384, "fcfs", 1)  # fmt: skip
    assert a.model_path is None and not a.multi_process and a.log_level == "info"


def test_help_is_grouped_and_lists_every_flag():
    text = build_parser().format_help()
    for group in GROUPS:
        assert f"\n{group}:\n" in text
    for _, flag in ALIASES:
        assert flag in text
    assert "(default: 30000)" in text


def test_namespace_holds_only_what_was_typed():
    ns = build_parser().parse_args(["--port", "1234"])
    assert vars(ns) == {"port": 1234}


# ---- config file ---------------------------------------------------------------------


def test_config_file_with_dash_underscore_and_alias_keys_and_cli_override(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(
        "port: 31001\nmax-prefill-num-token: 333\nschedule_policy: lpm\n"
        "disable-radix-cache: true\nmem_fraction_static: 0.4\n"
    )
    a = parse_server_args(["--config", str(cfg)])
    assert (a.port, a.max_prefill_tokens, a.schedule_policy, a.disable_radix_cache) == (
        31001, 333, "lpm", True)  # fmt: skip
    assert a.mem_fraction_static == 0.4
    b = parse_server_args(["--config", str(cfg), "--port", "31002", "--max-prefill-tokens", "7"])
    assert (b.port, b.max_prefill_tokens, b.schedule_policy) == (31002, 7, "lpm")
    # the config file's position on the command line does not matter
    c = parse_server_args(["--port", "31002", "--config", str(cfg)])
    assert c.port == 31002


def test_config_file_values_are_validated_like_flags(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("tp: 2\n")
    with pytest.raises(ValueError, match="--tp-size 2: tensor parallelism is not supported"):
        parse_server_args(["--config", str(cfg)])
    cfg.write_text("schedule-policy: sjf\n")
    with pytest.raises(ValueError, match="--schedule-policy sjf: must be one of fcfs"):
        parse_server_args(["--config", str(cfg)])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("bogus-option: 1\n", "unknown option 'bogus-option'"),
        ("port: [1, 2\n", "is not valid YAML"),
        ("- port\n", "must hold a mapping"),
        ("port: abc\n", r"--port 'abc' \(from --config .*\): Expected `int`, got `str`"),
        ("tp: 1\ntp-size: 1\n", "'tp-size' repeats --tp-size"),
    ],
)
def test_config_file_errors(tmp_path, text, message):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(text)
    with pytest.raises(ValueError, match=message):
        parse_server_args(["--config", str(cfg)])


def test_missing_and_empty_config_file(tmp_path):
    with pytest.raises(ValueError, match=r"--config: .*nope.yaml does not exist"):
        parse_server_args(["--config", str(tmp_path / "nope.yaml")])
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert parse_server_args(["--config", str(empty)]) == ServerArgs()


# ---- validation ----------------------------------------------------------------------

ERRORS = [
    (["--tp-size", "2"], "--tp-size 2: tensor parallelism is not supported yet (only 1)"),
    (["--dp", "4"], "--dp-size 4: data parallelism is not supported yet (only 1)"),
    (["--pp", "2"], "--pp-size 2: pipeline parallelism is not supported yet (only 1)"),
    (["--tp", "0"], "--tp-size 0: must be >= 1"),
    (["--port", "0"], "--port 0: must be a TCP port in 1..65535"),
    (["--port", "70000"], "--port 70000: must be a TCP port in 1..65535"),
    (["--host", ""], "--host: must not be empty"),
    (["--max-running-requests", "0"], "--max-running-requests 0: must be >= 1"),
    (["--max-prefill-tokens", "-5"], "--max-prefill-tokens -5: must be >= 1"),
    (["--max-total-tokens", "0"], "--max-total-tokens 0: must be >= 1"),
    (["--context-length", "0"], "--context-length 0: must be >= 1"),
    (["--page-size", "0"], "--page-size 0: must be >= 1"),
    (["--stream-interval", "0"], "--stream-interval 0: must be >= 1"),
    (["--cuda-graph-max-bs", "0"], "--cuda-graph-max-bs 0: must be >= 1"),
    (["--piecewise-cuda-graph-max-tokens", "0"],
     "--piecewise-cuda-graph-max-tokens 0: must be >= 1"),
    (["--piecewise-cuda-graph-tokens", "16", "0"],
     "--piecewise-cuda-graph-tokens [16, 0]: token counts must be >= 1"),
    (["--chunked-prefill-size", "0"], "--chunked-prefill-size 0: must be >= 1, or -1"),
    (["--chunked-prefill-size", "-2"], "--chunked-prefill-size -2: must be >= 1, or -1"),
    (["--mem-fraction-static", "1.5"], "--mem-fraction-static 1.5: must be in (0, 1]"),
    (["--mem-fraction-static", "0"], "--mem-fraction-static 0.0: must be in (0, 1]"),
    (["--random-seed", "-1"], "--random-seed -1: must be in [0, 2**63)"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout -1.0: must be >= 0 seconds"),
    (["--watchdog-timeout", "0"], "--watchdog-timeout 0.0: must be > 0 seconds"),
    (["--heartbeat-interval", "0"], "--heartbeat-interval 0.0: must be > 0 seconds"),
    (["--start-timeout", "0"], "--start-timeout 0.0: must be > 0 seconds"),
    (["--watchdog-timeout", "1.5"], "--watchdog-timeout 1.5: must exceed twice --heartbeat-interval"),
    (["--api-key", ""], "--api-key: must not be empty"),
    (["--admin-api-key", ""], "--admin-api-key: must not be empty"),
    (["--served-model-name", ""], "--served-model-name: must not be empty"),
    (["--attention-backend", "triton", "--decode-attention-backend", "flashinfer"],
     "--decode-attention-backend flashinfer: needs --attention-backend flashinfer"),
    (["--attention-backend", "torch", "--decode-attention-backend", "flashinfer"],
     "--decode-attention-backend flashinfer: needs --attention-backend flashinfer"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "message"), ERRORS, ids=[" ".join(a) for a, _ in ERRORS])
def test_validation_messages(argv, message):
    with pytest.raises(ValueError) as info:
        parse_server_args(argv)
    assert message in str(info.value)


def test_choices_refused_by_the_parser():
    for flag, bad in [("--schedule-policy", "sjf"), ("--dtype", "fp8"), ("--device", "tpu"),
                      ("--load-format", "pt"), ("--log-level", "loud"),
                      ("--weight-format", "fp4"), ("--decode-attention-backend", "torch")]:  # fmt: skip
        err = io.StringIO()
        with pytest.raises(SystemExit) as info, contextlib.redirect_stderr(err):
            parse_server_args([flag, bad])
        assert info.value.code == 2
        assert "invalid choice" in err.getvalue() and bad in err.getvalue()


def test_decode_attention_backend_parses_and_pairs_with_flashinfer():
    assert parse_server_args([]).decode_attention_backend == "auto"
    a = parse_server_args(["--attention-backend", "flashinfer",
                           "--decode-attention-backend", "flashinfer"])  # fmt: skip
    assert (a.attention_backend, a.decode_attention_backend) == ("flashinfer", "flashinfer")
    # auto may resolve to flashinfer: only the executor can refuse that pairing
    c = parse_server_args(["--decode-attention-backend", "flashinfer"])
    assert (c.attention_backend, c.decode_attention_backend) == ("auto", "flashinfer")
    b = parse_server_args(["--attention-backend", "triton", "--decode-attention-backend", "triton"])
    assert b.decode_attention_backend == "triton"
    with pytest.raises(ValueError, match="--decode-attention-backend bogus: must be one of auto"):
        ServerArgs(decode_attention_backend="bogus")


def test_server_args_is_frozen_and_round_trips():
    a = parse_server_args(["--port", "31005", "--multi-process"])
    with pytest.raises(AttributeError):
        a.port = 1  # type: ignore[misc]
    again = msgspec.json.decode(msgspec.json.encode(a), type=ServerArgs)
    assert again == a
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"prot": 1}', type=ServerArgs)


def test_cli_values_beat_unknown_namespace_keys():
    # argparse namespaces from `shunter serve` also carry `command` and `_module`.
    a = server_args_from(vars(argparse.Namespace(command="serve", _module="x", port=31010)))
    assert a.port == 31010


# ---- file-system checks --------------------------------------------------------------


def test_check_paths_default_model_is_fine():
    check_paths(ServerArgs())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"model_path": "/nonexistent/model"}, "--model-path: model path '/nonexistent/model' does not exist"),
        ({"load_format": "safetensors"}, "--load-format safetensors: .* is not a directory with config.json"),
        ({"tokenizer_path": "/nonexistent/tok"}, "--tokenizer-path: /nonexistent/tok does not exist"),
        ({"chat_template": "/nonexistent/t.jinja"}, "--chat-template: /nonexistent/t.jinja is not a file"),
        ({"record_events": "/nonexistent/dir/events"}, "--record-events: /nonexistent/dir does not exist"),
    ],
)  # fmt: skip
def test_check_paths_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        check_paths(ServerArgs(**kwargs))


def test_check_paths_gguf_format_on_a_directory(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"--load-format gguf: .* is not a .gguf file"):
        check_paths(ServerArgs(model_path=str(tmp_path), load_format="gguf"))


def test_check_paths_record_events_must_be_a_directory(tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        check_paths(ServerArgs(record_events=str(f)))
    check_paths(ServerArgs(record_events=str(tmp_path / "new")))  # parent exists: fine


def test_hierarchical_cache_options_are_checked():
    a = parse_server_args(["--enable-hierarchical-cache", "--hicache-ratio", "3",
                           "--hicache-write-policy", "write_through_selective"])  # fmt: skip
    assert (a.enable_hierarchical_cache, a.hicache_ratio, a.hicache_size) == (True, 3.0, 0)
    for argv, message in [
        (["--enable-hierarchical-cache", "--disable-radix-cache"], "needs the radix cache"),
        (["--hicache-ratio", "0"], "--hicache-ratio 0.0: must be > 0"),
        (["--hicache-size", "-1"], "--hicache-size -1: must be >= 0"),
        (["--hicache-write-policy", "write_around"], "write_around"),
    ]:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                parse_server_args(argv)
            except SystemExit:
                got = err.getvalue()
            except ValueError as e:
                got = str(e)
            else:
                raise AssertionError(f"{argv} was accepted")
        assert message in got, got
