"""Process launching and the supervisor over real processes, a real broker and ZMQ ipc:
kill -9 and SIGSTOP of an actor process, start failures, drain, and the child CLI."""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile

import anyio
import pytest

from shunter.actors.supervisor import Supervisor
from shunter.actors.supervisor_core import ActorSpec, SupervisorConfig
from shunter.bus.broker import Broker
from shunter.bus.messages import (
    ActorDied,
    GenerateRequest,
    RequestFailed,
    SamplingParams,
    TextDeltas,
)
from shunter.bus.zmq_transport import ZmqBus, default_endpoints
from shunter.ops.launch import decode_config, exit_reason, resolve, spawn_actor

HERE = pathlib.Path(__file__).resolve().parent
ENV = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}


@pytest.fixture
def anyio_backend():
    return "asyncio"


@contextlib.asynccontextmanager
async def _deployment(specs, entries, *, watchdog_s=10.0, shutdown_s=2.0, configs=None):
    runtime = tempfile.mkdtemp(prefix="shl-")
    eps = default_endpoints(runtime)
    cfg = SupervisorConfig(specs, watchdog_timeout_s=watchdog_s, shutdown_timeout_s=shutdown_s,
                           start_timeout_s=60.0, tick_interval_s=0.1)  # fmt: skip

    async def launch(spec, ready_info):
        config = (configs or {}).get(spec.actor_id, {})
        return await spawn_actor(entries[spec.kind], spec.actor_id, config, eps,
                                 heartbeat_interval_s=0.2, log_format="json", env=ENV)  # fmt: skip

    with Broker(eps.frontend, eps.backend):
        sup_bus, client = ZmqBus("supervisor", eps), ZmqBus("client", eps)
        sup = Supervisor(cfg, sup_bus, dict.fromkeys(entries, launch), handle_signals=False,
                         stop_grace_s=3.0)  # fmt: skip
        try:
            yield sup, client
        finally:
            await sup_bus.aclose()
            await client.aclose()
            shutil.rmtree(runtime, ignore_errors=True)


async def _ask(client, rid, text, timeout_s=10.0):
    with anyio.fail_after(timeout_s):
        async with client.subscribe(types=(TextDeltas, RequestFailed)) as sub:
            await client.publish(GenerateRequest(rid, SamplingParams(), text=text))
            async for r in sub:
                m = r.msg
                if isinstance(m, RequestFailed) and m.request_id == rid:
                    return m
                if isinstance(m, TextDeltas):
                    for d in m.deltas:
                        if d.request_id == rid and d.finish_reason:
                            return d
    raise AssertionError("subscription ended")


async def _until(predicate, timeout_s=15.0, sup=None):
    with anyio.fail_after(timeout_s):
        while not predicate():
            assert sup is None or sup.exit is None, sup.exit
            await anyio.sleep(0.02)


@pytest.mark.anyio
async def test_processes_killed_and_frozen_become_clean_errors_then_drain():
    specs = [ActorSpec("a", "echo", 0), ActorSpec("b", "echo", 1), ActorSpec("c", "echo", 1)]
    async with _deployment(specs, {"echo": "launch_actors:echo"}, watchdog_s=1.5) as (sup, client):
        died: list[ActorDied] = []
        result: dict[str, object] = {}
        async with anyio.create_task_group() as tg:

            async def run():
                result["code"] = await sup.run()

            async def watch():
                async with client.subscribe(types=(ActorDied,)) as sub:
                    async for r in sub:
                        died.append(r.msg)

            tg.start_soon(watch)
            tg.start_soon(run)
            await _until(lambda: sup.health == "serving", 60, sup)
            pids = {k: h.pid for k, h in sup.handles.items()}
            assert len(set(pids.values())) == 3 and os.getpid() not in pids.values()
            assert (await _ask(client, "r1", "hi")).text == "HI"

            async def held():
                result["held"] = await _ask(client, "r2", "hold")

            tg.start_soon(held)
            await anyio.sleep(0.3)
            os.kill(pids["a"], signal.SIGKILL)
            await _until(lambda: "held" in result)
            assert (result["held"].code, result["held"].http_status) == ("actor_died", 503)
            await _until(lambda: sup.health == "unhealthy")
            assert sup.health_reason == "a stopped: killed by SIGKILL"

            os.kill(pids["b"], signal.SIGSTOP)  # alive but frozen: only heartbeats tell
            await _until(lambda: len(died) == 2)
            assert died[1].actor_id == "b" and "sent no heartbeat for 1.5 s" in died[1].reason
            await _until(lambda: sup.handles["b"].process.returncode is not None)
            assert sup.handles["b"].process.returncode == -signal.SIGKILL  # the hung one is killed

            await sup.terminate()
            await _until(lambda: "code" in result)
            tg.cancel_scope.cancel()
    assert result["code"] == 0
    assert sup.handles["c"].process.returncode == 0  # SIGTERM: a clean exit
    assert [d.actor_id for d in died] == ["a", "b"]


@pytest.mark.anyio
async def test_actor_failing_at_start_fails_the_start_up():
    specs = [ActorSpec("bad", "bad", 0), ActorSpec("later", "echo", 1)]
    entries = {"bad": "launch_actors:fail_at_start", "echo": "launch_actors:echo"}
    async with _deployment(specs, entries) as (sup, _):
        with anyio.fail_after(60):
            code = await sup.run()
    assert code == 1
    assert sup.exit.reason == "start-up failed: bad stopped: exit code 1"
    assert "later" not in sup.handles


def _launch_cli(*argv, stdin=""):
    return subprocess.run([sys.executable, "-m", "shunter.ops.launch", *argv], input=stdin,
                          capture_output=True, text=True, timeout=60, env={**os.environ, **ENV})  # fmt: skip


def test_cli_refuses_unknown_actor_and_bad_config_with_exit_2():
    r = _launch_cli("nonsense", "--actor-id", "x")
    assert r.returncode == 2
    assert "unknown actor 'nonsense': one of executor, cache, scheduler" in r.stderr
    r = _launch_cli("gateway", "--actor-id", "gw", "--config-json", "-", stdin='{"port": 70000}')
    assert r.returncode == 2
    assert "bad config: port must be in [0, 65535], got 70000" in r.stderr
    r = _launch_cli("launch_actors:echo", "--actor-id", "e", "--config-json", "[1]")
    assert (r.returncode, "the config must be a JSON object" in r.stderr) == (2, True)


def test_resolve_and_decode_config():
    from shunter.gateway.config import GatewayConfig

    entry, config_type = resolve("gateway")
    assert config_type is GatewayConfig and callable(entry)
    assert decode_config(b'{"port": 1234}', GatewayConfig).port == 1234
    with pytest.raises(ValueError, match="expected module:name"):
        resolve("mod:")
    with pytest.raises(ValueError, match="cannot import no_such_module"):
        resolve("no_such_module:run")
    with pytest.raises(ValueError, match="bad config: Expected `int`, got `str`"):
        decode_config(b'{"port": "x"}', GatewayConfig)
    assert exit_reason(-9) == "killed by SIGKILL" and exit_reason(3) == "exit code 3"
