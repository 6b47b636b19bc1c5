"""`shunter bench serve` over HTTP: the load generator and the command against a scripted
SSE server, and (heavy tier) against the real server.

The scripted server is a real aiohttp server on loopback (in a thread with its own
event loop). It streams OpenAI-style chunks with known delays, so TTFT and ITL can be
checked against the script; it counts requests in flight, so the concurrency bound can
be checked from the server's side; and it fails requests whose first prompt id is a
multiple of FAIL_MOD (a 400 before the stream, or an error event inside it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading

import numpy as np
import pytest
import structlog
import torch
from aiohttp import web

from shunter.ops import bench_datasets as ds
from shunter.ops.bench_client import ClientConfig, arrival_offsets, run_benchmark
from shunter.ops.bench_metrics import summarize
from shunter.ops.cli import main

TTFT_S, ITL_S = 0.1, 0.04
FAIL_MOD = 7  # first prompt id % FAIL_MOD == 0 -> 400; == 1 -> error event mid-stream


class ScriptedServer:
    """OpenAI /v1/completions, /v1/chat/completions and SGLang /generate, with fixed delays."""

    def __init__(self, fail: bool = False, pad_bytes: int = 0) -> None:
        self.fail, self.pad = fail, "p" * pad_bytes  # pad: an extra field in every chunk
        self.in_flight = self.max_in_flight = self.num_requests = 0
        self.bodies: list[dict] = []
        self.loop = asyncio.new_event_loop()
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
            app.router.add_post(path, self.stream)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self.started.set()
        self.loop.run_forever()

    def __enter__(self) -> ScriptedServer:
        self.thread.start()
        assert self.started.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "scripted-model"}]})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.num_requests += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        done = False
        try:
            prompt = body.get("prompt", body.get("input_ids"))
            first = prompt[0] if isinstance(prompt, list) else 0
            if self.fail and first % FAIL_MOD == 0:
                err = {"message": f"prompt starts with {first}", "type": "BadRequestError"}
                return web.json_response({"error": err}, status=400)
            sglang = request.path == "/generate"
            n = body["sampling_params"]["max_new_tokens"] if sglang else body["max_tokens"]
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)

            async def send(obj) -> None:
                obj = {**obj, "pad": self.pad} if self.pad else obj
                await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

            if request.path == "/v1/chat/completions":  # a role chunk carries no content
                await send(
                    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
                )
            await asyncio.sleep(TTFT_S)
            for i in range(n):
                if i:
                    await asyncio.sleep(ITL_S)
                if self.fail and first % FAIL_MOD == 1 and i == 1:
                    await send({"error": {"message": "engine died", "code": 500}})
                    break
                if sglang:
                    meta = {"prompt_tokens": len(prompt), "completion_tokens": i + 1,
                            "cached_tokens": 2}  # fmt: skip
                    await send({"text": "x" * (i + 1), "output_ids": list(range(i + 1)),
                                "meta_info": meta})  # fmt: skip
                elif request.path == "/v1/chat/completions":
                    await send({"choices": [{"index": 0, "delta": {"content": "x"}}]})
                else:
                    await send({"choices": [{"index": 0, "text": "x"}], "usage": None})
            opts = body.get("stream_options") or {}
            if opts.get("include_usage") and not sglang:
                usage = {"prompt_tokens": 1000 + n, "completion_tokens": n,
                         "prompt_tokens_details": {"cached_tokens": 1000}}  # fmt: skip
                await send({"choices": [], "usage": usage})
            self.in_flight -= 1  # before [DONE]: the client may send its next request then
            done = True
            await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            if not done:
                self.in_flight -= 1


def _requests(num: int, output_len: int = 5, first_ids: list[int] | None = None):
    firsts = first_ids or [2 + 7 * k for k in range(num)]  # % 7 == 2: never fails
    return [ds.BenchRequest([f, 3, 4], output_len) for f in firsts[:num]]


def _bench(server: ScriptedServer, requests, **cfg) -> object:
    config = ClientConfig(server.url, model="scripted-model", **cfg)
    return asyncio.run(run_benchmark(requests, config))


# -- streaming against the scripted server -------------------------------------------------


@pytest.mark.parametrize("backend", ["openai", "openai-chat", "sglang"])
def test_ttft_itl_e2e_match_the_scripted_delays(backend):
    reqs = _requests(3, output_len=5)
    if backend == "openai-chat":
        reqs = ds.with_text(reqs, str)
    with ScriptedServer() as server:  # one at a time: a stall of a loaded machine hits one
        run = _bench(server, reqs, backend=backend, max_concurrency=1)
    assert all(r.success for r in run.results), [r.error for r in run.results]
    for r in run.results:  # a late read shortens the next gap, so single gaps are loose
        assert r.output_len == 5 and len(r.itl_s) == 4
        assert TTFT_S - 0.002 <= r.ttft_s < TTFT_S + 0.2  # nothing arrives before it is sent
        assert all(0 < x < ITL_S + 0.2 for x in r.itl_s)
        assert r.e2e_s >= r.ttft_s + sum(r.itl_s) - 1e-6
    gaps = [x for r in run.results for x in r.itl_s]
    assert ITL_S - 0.002 <= np.median(gaps) < ITL_S + 0.02
    # usage overrides the request's own count: the script reports 1000 + n prompt tokens
    expected_prompt = 3 if backend == "sglang" else 1005
    assert [r.prompt_len for r in run.results] == [expected_prompt] * 3
    assert [r.cached_len for r in run.results] == [2 if backend == "sglang" else 1000] * 3
    s = summarize(run.results, run.duration_s)
    assert TTFT_S * 1e3 - 2 <= s["median_ttft_ms"] < TTFT_S * 1e3 + 40
    assert s["cache_hit_rate"] == pytest.approx(2 / 3 if backend == "sglang" else 1000 / 1005)
    assert ITL_S * 1e3 - 2 <= s["median_tpot_ms"] < ITL_S * 1e3 + 20


@pytest.mark.parametrize("bound", [2, None])
def test_concurrency_never_exceeds_the_bound(bound):
    reqs = _requests(6, output_len=2)
    with ScriptedServer() as server:
        run = _bench(server, reqs, max_concurrency=bound)
        assert server.num_requests == 6
        assert server.max_in_flight == (bound or 6)
    assert run.max_in_flight == (bound or 6)
    assert all(r.success for r in run.results)
    if bound:  # three waves of two: each takes TTFT + ITL
        assert run.duration_s >= 3 * (TTFT_S + ITL_S) - 0.005


def test_request_rate_sends_on_the_seeded_schedule():
    reqs = _requests(6, output_len=1)
    with ScriptedServer() as server:
        run = _bench(server, reqs, request_rate=25.0, seed=4)
    expected = arrival_offsets(6, 25.0, seed=4)
    sent = [r.start_s for r in run.results]
    assert all(e - 0.002 <= s < e + 0.1 for s, e in zip(sent, expected)), (sent, expected)
    assert np.median(np.subtract(sent, expected)) < 0.02


def test_failures_are_counted_with_their_error_text():
    firsts = [7, 8, 9, 14, 15, 16]  # 7, 14 -> 400; 8, 15 -> error event; 9, 16 -> fine
    reqs = _requests(6, output_len=3, first_ids=firsts)
    with ScriptedServer(fail=True) as server:
        run = _bench(server, reqs)
    errors = [r.error for r in run.results]
    assert errors[0] == "HTTP 400: prompt starts with 7"
    assert errors[3] == "HTTP 400: prompt starts with 14"
    assert errors[1] == errors[4] == "engine died"
    assert [r.success for r in run.results] == [False, False, True, False, False, True]
    s = summarize(run.results, run.duration_s)
    assert (s["completed"], s["failed"]) == (2, 4)
    assert s["errors"]["engine died"] == 2 and sum(s["errors"].values()) == 4


def test_long_events_are_read_whole():
    with ScriptedServer(pad_bytes=300_000) as server:  # above aiohttp's default line limit
        run = _bench(server, _requests(2, output_len=3))
    assert [(r.success, r.output_len, r.error) for r in run.results] == [(True, 3, "")] * 2
    with ScriptedServer(pad_bytes=300_000) as server:
        run = _bench(server, _requests(2, output_len=3), max_event_bytes=1 << 16)
    assert not any(r.success for r in run.results)  # recorded as failures, not raised
    assert all(r.error.startswith("LineTooLong") for r in run.results), run.results[0].error


def test_unreachable_server_fails_requests_without_raising():
    cfg = ClientConfig("http://127.0.0.1:9", request_timeout_s=5)
    run = asyncio.run(run_benchmark(_requests(2), cfg))
    assert [r.success for r in run.results] == [False, False]
    assert all("Connect" in r.error for r in run.results), run.results[0].error


# -- the command line ----------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _restore_logging():
    """The command configures structlog onto the captured stderr; undo that after each test."""
    yield
    structlog.reset_defaults()
    logging.getLogger().handlers.clear()


def test_cli_end_to_end_json_last_line_output_file_and_plot(tmp_path, capsys):
    png, out = tmp_path / "run.png", tmp_path / "run.json"
    argv = ["bench", "serve", "--vocab-size", "700", "--num-prompts", "8", "--seed", "2",
            "--random-input-len", "6", "--random-output-len", "3", "--random-range-ratio", "1",
            "--max-concurrency", "4", "--ignore-eos", "--disable-tqdm", "--warmup-requests", "2",
            "--output-file", str(out), "--plot", str(png)]  # fmt: skip
    with ScriptedServer(fail=True) as server:
        rc = main([*argv, "--base-url", server.url])
        bodies = server.bodies
    stdout = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(stdout[-1])
    reqs = ds.random_requests(ds.RandomSpec(8, 6, 3, 1.0), ds.token_pool(700), seed=2)
    num_bad = sum(r.prompt_ids[0] % FAIL_MOD in (0, 1) for r in reqs)
    assert 0 < num_bad < 8 and reqs[0].prompt_ids[0] % FAIL_MOD > 1  # the seed's mix
    assert rc == 0
    assert (summary["completed"], summary["failed"]) == (8 - num_bad, num_bad)
    for key in ("duration_s", "request_throughput", "input_token_throughput",
                "output_token_throughput", "max_concurrency", "request_rate"):  # fmt: skip
        assert key in summary
    for m in ("ttft", "itl", "e2e", "tpot"):
        assert {f"{s}_{m}_ms" for s in ("mean", "median", "p90", "p99")} <= summary.keys()
    assert summary["max_concurrency"] == 4 and summary["max_in_flight"] <= 4
    assert summary["request_rate"] == "inf"
    assert any("Serving Benchmark Result" in line for line in stdout)
    assert bodies[0]["model"] == "scripted-model"  # asked /v1/models
    assert all(b["min_tokens"] == 3 and b["ignore_eos"] for b in bodies)
    warm = reqs[0].prompt_ids[3:] + reqs[0].prompt_ids[:3]  # no prefix of the dataset's
    assert [b["prompt"] for b in bodies[:2]] == [warm] * 2 and bodies[0]["max_tokens"] == 3
    timed = [b["prompt"] for b in bodies[2:]]
    assert sorted(timed) == sorted(r.prompt_ids for r in reqs)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    record = json.loads(out.read_text())
    assert record["summary"] == summary and len(record["requests"]) == 8


def test_cli_failed_warmup_stops_before_the_run(capsys):
    argv = ["bench", "serve", "--vocab-size", "700", "--num-prompts", "8", "--seed", "1",
            "--random-input-len", "6", "--random-output-len", "3", "--random-range-ratio", "1",
            "--disable-tqdm"]  # fmt: skip
    reqs = ds.random_requests(ds.RandomSpec(8, 6, 3, 1.0), ds.token_pool(700), seed=1)
    assert ds.warmup_request(reqs[0]).prompt_ids[0] % FAIL_MOD == 0  # the seed's warm-up fails
    with ScriptedServer(fail=True) as server:
        assert main([*argv, "--base-url", server.url]) == 1
        assert server.num_requests == 1
    assert "warm-up request failed: HTTP 400: prompt starts with" in capsys.readouterr().err


def test_cli_bad_arguments_exit_2(capsys):
    assert main(["bench", "serve", "--vocab-size", "50", "--request-rate", "0"]) == 2
    assert "request-rate" in capsys.readouterr().err
    assert main(["bench", "serve", "--vocab-size", "50", "--random-range-ratio", "2"]) == 2
    assert main(["bench", "serve", "--vocab-size", "50", "--base-url", "http://127.0.0.1:9",
                 "--num-prompts", "2"]) == 2  # fmt: skip
    assert "cannot use the server" in capsys.readouterr().err
    hf = ["bench", "serve", "--backend", "hf", "--vocab-size", "50", "--num-prompts", "2"]
    assert main([*hf, "--hf-batch-size", "0"]) == 2  # refused before any model loads
    assert "--hf-batch-size must be >= 1" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main([*hf, "--hf-device", "cuda"]) == 2
        assert "no CUDA device" in capsys.readouterr().err


# -- heavy tier: the real server on the default model --------------------------------------


@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    """`shunter serve` on the default model, on a free loopback port."""
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "shunter", "serve", "--port", str(port),
             "--max-total-tokens", "16384", "--log-format", "json"],
            stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 400
    try:
        while True:
            try:
                urllib.request.urlopen(url + "/v1/models", timeout=2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("server did not start:\n" + log_path.read_text()[-3000:])
                time.sleep(1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.heavy
def test_real_server_with_the_hf_baseline(real_server, tmp_path, capsys):
    png = tmp_path / "run.png"
    argv = ["bench", "serve", "--base-url", real_server, "--num-prompts", "3", "--seed", "5",
            "--random-input-len", "16", "--random-output-len", "4", "--random-range-ratio", "1",
            "--ignore-eos", "--hf-baseline", "--hf-batch-size", "3", "--disable-tqdm",
            "--plot", str(png)]  # fmt: skip
    assert main(argv) == 0
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (s["completed"], s["failed"]) == (3, 0)
    assert s["total_output_tokens"] == 12 and s["total_input_tokens"] == 48  # exact lengths
    assert s["hf_output_token_throughput"] > 0 and s["output_throughput_vs_hf"] == pytest.approx(
        s["output_token_throughput"] / s["hf_output_token_throughput"]
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.heavy
@pytest.mark.parametrize("backend", ["openai-chat", "sglang"])
def test_real_server_other_endpoints(real_server, backend, capsys):
    argv = ["bench", "serve", "--base-url", real_server, "--backend", backend,
            "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "1",
            "--gsp-prompts-per-group", "2", "--gsp-system-prompt-len", "24",
            "--gsp-question-len", "4", "--gsp-output-len", "3", "--ignore-eos",
            "--max-concurrency", "1", "--disable-tqdm"]  # fmt: skip
    assert main(argv) == 0
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (s["completed"], s["failed"]) == (2, 0) and s["total_output_tokens"] == 6
    assert s["max_in_flight"] == 1 and s["median_ttft_ms"] > 0
