"""Weights flips against the real server (gateway/flips.py): /update_weights_from_disk
with the served checkpoint itself (so the shared server's outputs stay what the other
tests expect), with a running request that drains or is retracted, and with a
checkpoint that cannot be loaded; and the admin views around them (/get_load)."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest


def post(server, path, body, timeout_s=300.0):
    req = urllib.request.Request(server.base_url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def greedy(server, text, max_new=8):
    status, out = post(server, "/generate", {
        "text": text, "sampling_params": {"max_new_tokens": max_new, "temperature": 0}})  # fmt: skip
    assert status == 200, out
    return out


def stream_running(server, text, sampling):
    """A streamed /generate whose first event has arrived (so the request runs): the
    open response, positioned after that event."""
    body = json.dumps({"text": text, "stream": True, "sampling_params": sampling}).encode()
    req = urllib.request.Request(server.base_url + "/generate", data=body,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    stream = urllib.request.urlopen(req, timeout=300)
    assert stream.readline().startswith(b"data: {")
    return stream


def last_event(stream) -> dict:
    """The rest of a stream read to its end: its last JSON event."""
    events = [e.strip() for e in stream.read().decode().split("\n\n")]
    return json.loads([e for e in events if e.startswith("data: {")][-1][6:])


@pytest.fixture
def served_path(server):
    status, raw = server.get("/get_model_info")
    assert status == 200
    return json.loads(raw)["model_path"]


def test_same_weights_flip_keeps_outputs_and_drops_the_cache(server, served_path):
    text = "The weather today is sunny and the sky is"
    before = greedy(server, text)
    status, out = post(server, "/update_weights_from_disk",
                       {"model_path": served_path, "weight_version": "step-1"})  # fmt: skip
    assert status == 200 and out["success"] and out["num_paused_requests"] == 0, out
    info = json.loads(server.get("/get_model_info")[1])
    assert info["weight_version"] == "step-1" and info["model_path"] == served_path
    after = greedy(server, text)
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"]["cached_tokens"] == 0  # the prefix cache went with the flip


@pytest.mark.parametrize("retract", [False, True], ids=["drain", "retract"])
def test_a_running_request_finishes_across_a_flip(server, served_path, retract):
    """A request streaming when the flip starts: drain waits for it; retract puts it
    back in the queue and recomputes it after the cutover. Either way the client gets
    every token, the same as without a flip."""
    reference = greedy(server, "Once upon a time", max_new=48)["output_ids"]
    flip = {}
    with stream_running(server, "Once upon a time", {"max_new_tokens": 48, "temperature": 0}) as s:
        t = threading.Thread(target=lambda: flip.update(out=post(
            server, "/update_weights_from_disk", {"model_path": served_path, "retract": retract})))  # fmt: skip
        t.start()
        last = last_event(s)
    t.join(300)
    status, out = flip["out"]
    assert status == 200 and out["success"] and out["num_paused_requests"] == 1, out
    assert (
        last["output_ids"] == reference and last["meta_info"]["finish_reason"]["type"] == "length"
    )


def test_a_checkpoint_that_cannot_load_keeps_the_old_weights(server, tmp_path):
    text = "A short test sentence"
    before = greedy(server, text)
    status, out = post(server, "/update_weights_from_disk",
                       {"model_path": str(tmp_path / "missing")})  # fmt: skip
    assert status == 400 and not out["success"] and "cannot load" in out["message"], out
    assert greedy(server, text)["output_ids"] == before["output_ids"]
    status, out = post(server, "/update_weights_from_disk", {"model_path": ""})
    assert status == 400 and "model_path" in out["error"]["message"]


def test_a_drain_that_times_out_ends_the_flip_and_admits_again(server, served_path):
    sampling = {"max_new_tokens": 160, "ignore_eos": True}
    with stream_running(server, "Tell me a long story", sampling) as s:
        status, out = post(server, "/update_weights_from_disk",
                           {"model_path": served_path, "timeout": 0.3})  # fmt: skip
        assert status == 504 and "drain" in out["error"]["message"], out
        assert greedy(server, "Still serving?", max_new=2)["meta_info"]["completion_tokens"] == 2
        s.read()


def test_pause_update_continue_as_a_trainer_syncs_weights(server, served_path):
    """Pause (running requests back in the queue), new weights, continue: the request
    streaming across it ends with every token; one sent while paused waits and runs."""
    reference = greedy(server, "Once upon a time", max_new=32)["output_ids"]
    late = {}
    with stream_running(server, "Once upon a time", {"max_new_tokens": 32, "temperature": 0}) as s:
        status, out = post(server, "/pause_generation", {"mode": "retract"})
        assert status == 200 and out["num_paused_requests"] == 1, out
        assert post(server, "/pause_generation", {})[0] == 400  # paused already
        waiter = threading.Thread(target=lambda: late.update(out=greedy(server, "Hello", 2)))
        waiter.start()
        waiter.join(1.0)
        assert waiter.is_alive()  # held back while paused
        status, body = server.get("/health_generate")
        assert status == 503 and b"paused" in body, body
        status, out = post(server, "/update_weights_from_disk", {"model_path": served_path})
        assert status == 200 and out["success"] and out["num_paused_requests"] == 0, out
        assert post(server, "/continue_generation", {}) == (200, {"success": True})
        last = last_event(s)
    waiter.join(300)
    assert last["output_ids"] == reference and late["out"]["meta_info"]["completion_tokens"] == 2
    assert post(server, "/continue_generation", {})[0] == 400  # not paused
    assert post(server, "/pause_generation", {"mode": "sideways"})[0] == 400


def test_pause_by_default_aborts_what_runs(server):
    """SGLang's default mode: every request ends (finish_reason abort) and new ones wait
    for /continue_generation."""
    with stream_running(server, "Count slowly", {"max_new_tokens": 200, "ignore_eos": True}) as s:
        status, out = post(server, "/pause_generation", {})
        assert status == 200 and out["success"], out
        assert last_event(s)["meta_info"]["finish_reason"]["type"] == "abort"
    assert post(server, "/continue_generation", {})[0] == 200
    assert greedy(server, "Back again", 2)["meta_info"]["completion_tokens"] == 2


def test_continue_while_a_pause_drains_ends_the_pause(server):
    """A pause still waiting for running requests to finish is ended by a continue:
    the pause answers 409 and nothing stays held back."""
    pause = {}
    with stream_running(server, "Count slowly", {"max_new_tokens": 120, "ignore_eos": True}) as s:
        t = threading.Thread(target=lambda: pause.update(
            out=post(server, "/pause_generation", {"mode": "drain"})))  # fmt: skip
        t.start()
        t.join(0.5)
        assert t.is_alive()  # draining
        assert post(server, "/continue_generation", {}) == (200, {"success": True})
        t.join(60)
        assert last_event(s)["meta_info"]["finish_reason"]["type"] == "length"
    status, out = pause["out"]
    assert status == 409 and "continued" in out["error"]["message"], out
    assert greedy(server, "Not held", 2)["meta_info"]["completion_tokens"] == 2


def test_a_second_weights_flip_while_one_runs_gets_409(server, served_path):
    """One weights flip at a time: while the first waits for a running request to
    drain, a second answers 409 at once; the first then completes."""
    first = {}
    with stream_running(server, "Count slowly", {"max_new_tokens": 120, "ignore_eos": True}) as s:
        t = threading.Thread(target=lambda: first.update(
            out=post(server, "/update_weights_from_disk", {"model_path": served_path})))  # fmt: skip
        t.start()
        t.join(0.5)
        assert t.is_alive()  # draining
        status, out = post(server, "/update_weights_from_disk", {"model_path": served_path})
        assert status == 409 and "another flip" in out["error"]["message"], out
        assert last_event(s)["meta_info"]["finish_reason"]["type"] == "length"
    t.join(300)
    status, out = first["out"]
    assert status == 200 and out["success"] and out["num_paused_requests"] == 1, out


def get_load(server):
    with urllib.request.urlopen(server.base_url + "/get_load", timeout=30) as r:
        return json.loads(r.read())


def poll_load(server, ok, timeout_s=30.0):
    """/get_load's one rank once `ok` holds for it (the figures follow the scheduler's
    ticks), else the last seen."""
    deadline = time.monotonic() + timeout_s
    while True:
        load = get_load(server)
        if ok(load[0]) or time.monotonic() > deadline:
            return load
        time.sleep(0.05)


def test_get_load_counts_a_running_request_and_its_kv(server):
    """SGLang's /get_load: one rank; a running request shows in num_reqs with its KV
    tokens held, and leaves once it finished."""
    with stream_running(server, "Count slowly", {"max_new_tokens": 150, "ignore_eos": True}) as s:
        load = poll_load(server, lambda r: r["num_reqs"] >= 1)
        assert len(load) == 1 and set(load[0]) == {"dp_rank", "num_reqs", "num_waiting_reqs",
                                                   "num_tokens"}, load  # fmt: skip
        assert load[0]["dp_rank"] == 0 and load[0]["num_reqs"] >= 1 and load[0]["num_tokens"] > 0
        assert last_event(s)["meta_info"]["finish_reason"]["type"] == "length"
    load = poll_load(server, lambda r: r["num_reqs"] == 0)
    assert load[0]["num_reqs"] == 0 and load[0]["num_waiting_reqs"] == 0, load


def test_memory_released_and_resumed_as_an_rl_trainer_does(server, served_path):
    """Release everything; a request waits meanwhile. Resume the weights, sync them,
    resume the rest: the waiting request then runs, with the tokens it had before."""
    before = greedy(server, "Hello there", 4)["output_ids"]
    status, out = post(server, "/release_memory_occupation", {})
    assert status == 200 and out["released"] == ["cuda_graph", "kv_cache", "weights"], out
    assert json.loads(server.get("/get_server_info")[1])["memory_released"] == out["released"]
    status, body = server.get("/health_generate")
    assert status == 503 and b"released" in body, body
    status, again = post(server, "/release_memory_occupation", {"tags": ["kv_cache"]})
    assert status == 400 and "released already" in again["error"]["message"], again
    late = {}
    waiter = threading.Thread(target=lambda: late.update(out=greedy(server, "Hello there", 4)))
    waiter.start()
    waiter.join(1.0)
    assert waiter.is_alive()  # held while the memory is away
    status, out = post(server, "/update_weights_from_disk", {"model_path": served_path})
    assert status == 400 and "released" in out["error"]["message"], out
    status, out = post(server, "/get_weights_by_name", {"name": "model.norm.weight"})
    assert status == 400 and "released" in out["error"]["message"], out
    status, out = post(server, "/resume_memory_occupation", {"tags": ["weights"]})
    assert status == 200 and out["released"] == ["cuda_graph", "kv_cache"], out
    status, out = post(server, "/update_weights_from_disk", {"model_path": served_path})
    assert status == 200 and out["success"], out
    assert waiter.is_alive()
    status, out = post(server, "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})
    assert status == 200 and out["released"] == [], out
    waiter.join(120)
    assert late["out"]["output_ids"] == before
    assert server.get("/health_generate")[0] == 200
    status, out = post(server, "/resume_memory_occupation", {"tags": ["weights"]})
    assert status == 400 and "not released" in out["error"]["message"], out


@pytest.mark.parametrize("tags", [["disk"], [], ["weights", "weights"], "weights"])
def test_bad_memory_tags_are_400(server, tags):
    for path in ("/release_memory_occupation", "/resume_memory_occupation"):
        status, out = post(server, path, {"tags": tags})
        assert status == 400 and "tags" in json.dumps(out["error"]), out


def test_get_weights_by_name_reads_hf_named_rows(server):
    """SGLang's /get_weights_by_name: the first rows of a weight by its HF name, q/k/v
    and gate/up cut from the fused tensors, the tied lm_head being the embedding."""
    status, k = post(server, "/get_weights_by_name",
                     {"name": "model.layers.0.self_attn.k_proj.weight", "truncate_size": 2})  # fmt: skip
    assert status == 200 and len(k) == 2 and len(k[0]) == 576, (status, str(k)[:200])
    assert all(isinstance(x, float) for x in k[0])
    status, head = post(server, "/get_weights_by_name", {"name": "lm_head.weight",
                                                        "truncate_size": 3})  # fmt: skip
    status2, emb = post(server, "/get_weights_by_name", {"name": "model.embed_tokens.weight",
                                                        "truncate_size": 3})  # fmt: skip
    assert status == status2 == 200 and head == emb and len(head) == 3
    status, norm = post(server, "/get_weights_by_name", {"name": "model.norm.weight"})
    assert status == 200 and len(norm) == 100  # a vector's first 100 values, as SGLang
    for body in ({"name": "model.layers.0.mlp.nowhere.weight"},
                 {"name": "model.norm.weight", "truncate_size": 0}, {}):  # fmt: skip
        status, out = post(server, "/get_weights_by_name", body)
        assert status == 400, out
