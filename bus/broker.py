"""The ZMQ broker: an XSUB/XPUB forwarder between every publisher and every subscriber.

Theory of operation:
    Publishers (one PUB socket per bus) connect to the frontend (XSUB); subscribers (one
    SUB socket per subscription) connect to the backend (XPUB). libzmq's proxy moves
    frames between them in C, in a thread of its own, so it keeps no GIL while it runs.
    The frontend subscribes to everything up front: every publisher forwards all its
    traffic from the moment it connects, and topic filtering happens once, at the
    backend. That way a subscription is live as soon as the broker has it, which is
    what the transport's probe barrier checks, and no publisher-side subscription lag
    can lose a message.

    High-water marks are 0 (unlimited) on both sides and the backend sets XPUB_NODROP,
    so the broker never drops a message: a slow subscriber's backlog waits in memory.

    tcp:// endpoints need CURVE (`CurveServer`): both sockets become CURVE servers and a
    ZAP authenticator admits only the allowed client keys. Plain tcp:// is refused
    unless `allow_insecure_tcp=True`. ipc:// endpoints get their directory created,
    and binding over a live broker's socket file is refused.

Run it in-process (`with Broker(...)`, or `broker.start()` / `broker.stop()`) or as
a process: `python -m shunter.bus.broker [--frontend EP --backend EP]`, which prints
one JSON line {"event": "broker_ready", ...} once bound and exits 0 on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import signal
import socket
import sys
import threading

import zmq

from shunter.bus.curve import (
    CurveKeys,
    CurveServer,
    apply_server,
    check_endpoint,
    load_public_keys,
    start_authenticator,
)
from shunter.bus.zmq_transport import BusEndpoints, default_endpoints


def _check_ipc_free(endpoint: str) -> None:
    """Create an ipc endpoint's directory; refuse if a live socket already listens there."""
    if not endpoint.startswith("ipc://"):
        return
    path = pathlib.Path(endpoint[len("ipc://") :])
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        return  # a stale file from a dead broker: libzmq replaces it
    finally:
        probe.close()
    raise RuntimeError(f"a broker is already listening on {endpoint}")


class Broker:
    """XSUB (frontend, publishers) <-> XPUB (backend, subscribers) forwarder thread."""

    def __init__(
        self,
        frontend: str | None = None,
        backend: str | None = None,
        *,
        curve: CurveServer | None = None,
        allow_insecure_tcp: bool = False,
    ) -> None:
        defaults = default_endpoints()
        self.endpoints = BusEndpoints(frontend or defaults.frontend, backend or defaults.backend)
        for ep in self.endpoints:
            check_endpoint(ep, curve=curve is not None, allow_insecure_tcp=allow_insecure_tcp)
        self.curve = curve
        self._context = zmq.Context()  # its own: stop() terminates it to end the proxy
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._auth = None

    @property
    def frontend(self) -> str:
        return self.endpoints.frontend

    @property
    def backend(self) -> str:
        return self.endpoints.backend

    def start(self, timeout_s: float = 10.0) -> None:
        """Bind both sockets and start forwarding; raises if binding fails."""
        if self._thread is not None:
            raise RuntimeError("broker already started")
        for ep in self.endpoints:
            _check_ipc_free(ep)
        if self.curve is not None:
            self._auth = start_authenticator(self._context, self.curve)
        self._thread = threading.Thread(target=self._run, name="shunter-broker", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout_s):
            raise TimeoutError("broker did not start")
        if self._error is not None:
            self._thread.join()
            self._cleanup()
            raise self._error

    def _run(self) -> None:
        ctx = self._context
        xsub = ctx.socket(zmq.XSUB)
        xpub = ctx.socket(zmq.XPUB)
        try:
            for s in (xsub, xpub):
                s.setsockopt(zmq.SNDHWM, 0)
                s.setsockopt(zmq.RCVHWM, 0)
                s.setsockopt(zmq.LINGER, 0)
                if self.curve is not None:
                    apply_server(s, self.curve)
            xpub.setsockopt(zmq.XPUB_NODROP, 1)
            xsub.bind(self.endpoints.frontend)
            xpub.bind(self.endpoints.backend)
            # tcp://host:* binds a free port: report the endpoints actually bound
            self.endpoints = BusEndpoints(
                xsub.getsockopt_string(zmq.LAST_ENDPOINT),
                xpub.getsockopt_string(zmq.LAST_ENDPOINT),
            )
            xsub.send(b"\x01")  # subscribe to everything: filtering happens at the backend
        except BaseException as e:  # reported to start()
            self._error = e
            for s in (xsub, xpub):
                s.close(0)
            self._started.set()
            return
        self._started.set()
        try:
            zmq.proxy(xsub, xpub)
        except zmq.ContextTerminated:
            pass  # stop() terminated the context
        finally:
            for s in (xsub, xpub):
                s.close(0)

    def stop(self) -> None:
        """Stop forwarding and unbind. Idempotent."""
        thread, self._thread = self._thread, None
        self._cleanup()
        if thread is not None:
            thread.join(10.0)
            if thread.is_alive():
                raise RuntimeError("broker thread did not stop")

    def _cleanup(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if not self._context.closed:
            self._context.term()  # the proxy returns with ETERM and closes its sockets

    def __enter__(self) -> Broker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> Broker:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shunter.bus.broker", description=__doc__)
    defaults = default_endpoints()
    p.add_argument("--frontend", default=defaults.frontend, help="publishers connect here")
    p.add_argument("--backend", default=defaults.backend, help="subscribers connect here")
    p.add_argument("--curve-secret-file", help="the broker's CURVE key file (*.key_secret)")
    p.add_argument("--allowed-keys-dir", help="directory of allowed clients' *.key files")
    p.add_argument("--allow-insecure-tcp", action="store_true")
    args = p.parse_args(argv)
    curve = None
    if args.curve_secret_file or args.allowed_keys_dir:
        if not (args.curve_secret_file and args.allowed_keys_dir):
            p.error("--curve-secret-file and --allowed-keys-dir go together")
        keys = CurveKeys.load(args.curve_secret_file)
        curve = CurveServer(keys, load_public_keys(args.allowed_keys_dir))
    try:
        broker = Broker(
            args.frontend, args.backend, curve=curve, allow_insecure_tcp=args.allow_insecure_tcp
        )
        broker.start()
    except (ValueError, RuntimeError, OSError, zmq.ZMQError) as e:
        print(f"broker: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(
        json.dumps(
            {"event": "broker_ready", "frontend": broker.frontend, "backend": broker.backend}
        ),
        flush=True,
    )
    while not stop.wait(0.5):
        pass
    broker.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
