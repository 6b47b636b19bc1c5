"""CURVE over TCP: a keyed peer gets through; unkeyed or unknown-key peers get nothing in
and nothing out."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import anyio
import pytest

from shunter.bus.broker import Broker
from shunter.bus.curve import CurveClient, CurveKeys, CurveServer, load_public_keys
from shunter.bus.messages import Heartbeat, Tick
from shunter.bus.zmq_transport import ZmqBus

pytestmark = [pytest.mark.timeout(60)]
TCP_ANY = "tcp://127.0.0.1:*"


async def recv(sub, timeout_s: float = 5.0):
    with anyio.fail_after(timeout_s):
        return await sub.receive()


def test_keys_round_trip_through_files(tmp_path):
    keys = CurveKeys.generate()
    secret_file = keys.save(tmp_path / "server", "broker")
    assert CurveKeys.load(secret_file) == keys
    assert CurveKeys.load(tmp_path / "server" / "broker.key") == CurveKeys(keys.public_key)
    assert (secret_file.stat().st_mode & 0o777) == 0o600
    assert load_public_keys(tmp_path / "server") == (keys.public_key,)
    with pytest.raises(ValueError, match="Z85"):
        CurveKeys(b"x" * 10)
    with pytest.raises(ValueError, match="secret"):
        CurveServer(CurveKeys(keys.public_key), ())
    with pytest.raises(ValueError, match="no such key directory"):
        load_public_keys(tmp_path / "missing")


@pytest.mark.anyio
async def test_keyed_peer_passes_unkeyed_and_unknown_peers_are_shut_out():
    server, friend, stranger = CurveKeys.generate(), CurveKeys.generate(), CurveKeys.generate()
    curve = CurveServer(server, allowed_clients=(friend.public_key,))
    with Broker(TCP_ANY, TCP_ANY, curve=curve) as broker:
        eps = broker.endpoints
        alice = ZmqBus("alice", eps, curve=CurveClient(friend, server.public_key))
        bob = ZmqBus("bob", eps, curve=CurveClient(friend, server.public_key))
        unknown = ZmqBus("unknown", eps, curve=CurveClient(stranger, server.public_key))
        plain = ZmqBus("plain", eps, allow_insecure_tcp=True)
        try:
            inbox = bob.subscribe()
            spies = [unknown.subscribe(), plain.subscribe()]
            await bob.wait_connected()
            await alice.wait_connected()
            for intruder in (unknown, plain):  # their probes never come back
                with pytest.raises(TimeoutError):
                    await intruder.wait_connected(timeout_s=0.5)
                for i in range(20):
                    await intruder.publish(Heartbeat(intruder.publisher_id, i))
            await anyio.sleep(0.2)  # give intruder traffic every chance to arrive
            await alice.publish(Tick(1))
            got = await recv(inbox)
            assert got.envelope.publisher_id == "alice" and got.msg == Tick(1)
            with pytest.raises(anyio.WouldBlock):
                inbox.receive_nowait()  # nothing from the intruders reached the broker
            for spy in spies:
                with pytest.raises(anyio.WouldBlock):
                    spy.receive_nowait()  # and they received nothing
                assert spy.statistics().num_received == 0
        finally:
            for bus in (alice, bob, unknown, plain):
                await bus.aclose()


@pytest.mark.anyio
async def test_broker_process_with_key_files(tmp_path):
    server, client = CurveKeys.generate(), CurveKeys.generate()
    secret_file = server.save(tmp_path / "server", "broker")
    client.save(tmp_path / "allowed", "client")
    proc = subprocess.Popen(
        [sys.executable, "-m", "shunter.bus.broker", "--frontend", TCP_ANY, "--backend", TCP_ANY,
         "--curve-secret-file", str(secret_file), "--allowed-keys-dir", str(tmp_path / "allowed")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        ready = json.loads(proc.stdout.readline())
        eps_args = (ready["frontend"], ready["backend"])
        from shunter.bus.zmq_transport import BusEndpoints

        eps = BusEndpoints(*eps_args)
        keyed = CurveClient(
            CurveKeys.load(tmp_path / "allowed" / "client.key_secret"), server.public_key
        )
        async with ZmqBus("a", eps, curve=keyed) as a:
            sub = a.subscribe(types=(Tick,))
            await a.wait_connected()
            await a.publish(Tick(3))
            assert (await recv(sub)).msg == Tick(3)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    plain = subprocess.run(
        [sys.executable, "-m", "shunter.bus.broker", "--frontend", TCP_ANY, "--backend", TCP_ANY],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert plain.returncode == 2 and "unauthenticated TCP" in plain.stderr
