"""The message bus: typed msgspec messages over pub/sub, in-process or over ZMQ.

- `shunter.bus.messages`: the message catalog (the contract between actors).
- `shunter.bus.codec`: the wire format, `Frames(topic, envelope, body)`.
- `shunter.bus.transport`: the `Bus` API (publish, subscribe, subscribe_raw, request,
  wait_connected); `shunter.bus.inproc`: the in-process transport
  (`InProcHub().connect("scheduler")`).
- `shunter.bus.subscription`: subscriptions, with gap and decode-failure events.
- `shunter.bus.zmq_transport` / `shunter.bus.broker`: the ZMQ transport through an
  XSUB/XPUB broker (`ipc://` on one host, `tcp://` with CURVE across hosts).

Use (the same code on either transport):

    hub = InProcHub()                      # or ZmqBus("executor.0", default_endpoints())
    bus = hub.connect("executor.0")
    async with bus.subscribe(types=(ForwardBatch, Shutdown)) as inbox:  # waits connected
        await bus.publish(Ready("executor", "executor.0"))
        async for received in inbox:       # Received(topic, envelope, msg)
            ...
    await bus.request(HealthPing("p1"), reply=HealthPong,
                      match=lambda m: m.ping_id == "p1", timeout_s=2.0)

The two transports behave the same (encoded bytes on the wire, fresh objects on
receive, typed decode failures and seq gaps reported as events, per-publisher order,
nothing dropped) except under a slow subscriber: in-process, publishers wait for room
in its bounded queue; over ZMQ, its backlog queues in memory (HWM 0), since ZMQ cannot
push back on one subscriber without stalling every topic at the broker.

`import shunter.bus` does not import zmq; the ZMQ names load on first use.
"""

from __future__ import annotations

from shunter.bus.codec import Decoder, Frames, decode_envelope, encode
from shunter.bus.inproc import InProcBus, InProcHub
from shunter.bus.transport import (
    Bus,
    BusStatistics,
    RawSubscription,
    Received,
    Subscription,
    SubscriptionStatistics,
)

_LAZY = {
    "ZmqBus": "shunter.bus.zmq_transport",
    "BusEndpoints": "shunter.bus.zmq_transport",
    "default_endpoints": "shunter.bus.zmq_transport",
    "Broker": "shunter.bus.broker",
    "CurveKeys": "shunter.bus.curve",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shunter.bus' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "Broker",
    "Bus",
    "BusEndpoints",
    "BusStatistics",
    "CurveKeys",
    "Decoder",
    "Frames",
    "InProcBus",
    "InProcHub",
    "RawSubscription",
    "Received",
    "Subscription",
    "SubscriptionStatistics",
    "ZmqBus",
    "decode_envelope",
    "default_endpoints",
    "encode",
]
