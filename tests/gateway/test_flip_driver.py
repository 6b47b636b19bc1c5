"""The gateway's flip driver (gateway/flips.py) against scripted actors on the
in-process bus: what it publishes when an actor answers late or not at all."""

from __future__ import annotations

import anyio
import pytest

from shunter.bus.inproc import InProcHub
from shunter.bus.messages import (
    AdmissionPaused,
    DropTree,
    FlipBegin,
    FlipDone,
    FlipQuiesced,
    TreeDropped,
    UpdateWeights,
)
from shunter.gateway.errors import APIError
from shunter.gateway.flips import Flips


async def _actors(bus, seen: list, answer_drop: bool) -> None:
    """A scheduler that pauses at once, an executor that never answers UpdateWeights,
    and a cache manager that answers DropTree (or not)."""
    async with bus.subscribe(types=(FlipBegin, UpdateWeights, DropTree, FlipDone)) as sub:
        async for received in sub:
            msg = received.msg
            seen.append(type(msg).__name__)
            if isinstance(msg, FlipBegin):
                await bus.publish(AdmissionPaused(msg.flip_id, 0, 0))
                await bus.publish(FlipQuiesced(msg.flip_id, 0))
            elif isinstance(msg, DropTree) and answer_drop:
                await bus.publish(TreeDropped(msg.flip_id, 3))


@pytest.mark.parametrize("answer_drop", [True, False])
def test_a_weights_load_past_its_timeout_drops_the_prefix_cache_before_the_flip_ends(answer_drop):
    """The executor may still copy the checkpoint in after the gateway gave up on it, so
    the cache computed with the old weights is dropped before FlipDone lets requests
    in; the caller gets a 504 that says so, and the version stays the old one."""

    async def main() -> tuple[list, APIError]:
        hub = InProcHub()
        flips = Flips(hub.connect("gateway"), load_timeout_s=0.2)
        seen: list = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(_actors, hub.connect("actors"), seen, answer_drop)
            await anyio.sleep(0.01)  # subscribed
            with pytest.raises(APIError) as err:
                await flips.update_weights("f1", "/elsewhere")
            await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
        assert flips.version == 0
        return seen, err.value

    seen, err = anyio.run(main)
    assert seen == ["FlipBegin", "UpdateWeights", "DropTree", "FlipDone"]
    assert err.status == 504 and err.code == "timeout"
    assert "no WeightsUpdated in 0.2 s" in err.message
    assert ("prefix cache was dropped" if answer_drop else "asked to drop") in err.message
