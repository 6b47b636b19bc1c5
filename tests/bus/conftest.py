"""Fixtures for the bus tests: short ipc dirs, a real broker, a bus factory per transport."""

from __future__ import annotations

import shutil
import tempfile

import pytest

from shunter.bus.inproc import InProcHub
from shunter.bus.transport import Bus

TRANSPORTS = ["inproc", "zmq"]


@pytest.fixture
def anyio_backend():
    return "asyncio"  # zmq sockets are driven by the asyncio loop


@pytest.fixture
def ipc_dir():
    """A short directory for ipc:// sockets (unix socket paths are limited to ~107 bytes)."""
    d = tempfile.mkdtemp(prefix="shb-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def broker(ipc_dir):
    from shunter.bus.broker import Broker
    from shunter.bus.zmq_transport import default_endpoints

    with Broker(*default_endpoints(ipc_dir)) as b:
        yield b


class Connector:
    """Makes buses on one transport; closes them all at the end of the test."""

    def __init__(self, transport: str, request: pytest.FixtureRequest) -> None:
        self.transport = transport
        self.buses: list[Bus] = []
        if transport == "inproc":
            self.hub = InProcHub()
        else:
            self.broker = request.getfixturevalue("broker")

    def connect(self, publisher_id: str, *, max_queue: int | None = None) -> Bus:
        if self.transport == "inproc":
            bus = self.hub.connect(publisher_id, max_queue=max_queue)
        else:
            from shunter.bus.zmq_transport import ZmqBus

            kw = {"max_queue": max_queue} if max_queue else {}
            bus = ZmqBus(publisher_id, self.broker.endpoints, **kw)
        self.buses.append(bus)
        return bus

    async def aclose(self) -> None:
        for bus in self.buses:
            await bus.aclose()


@pytest.fixture(params=TRANSPORTS)
async def connector(request):
    c = Connector(request.param, request)
    yield c
    await c.aclose()
