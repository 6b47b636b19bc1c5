"""The executor's copies between KV tiers: device <-> host pool, host pool <-> file store.

Theory of operation
    `Copies.copy(msg)` starts one copy the cache manager asked for and answers it, or
    returns None while it runs: a SpillPages or LoadPages through the host pool
    (host_pool.py; on CUDA queued on a copy stream behind the forwards already
    launched, so no step in flight needs finishing first), a StorePages, FetchPages or
    EraseBlocks through the file store (file_store.py, on its one worker thread, in
    the order they came). A running copy's reply waits in `running` beside what tells
    when it is done (a CUDA event, or the file store's future); `done()` hands out the
    finished ones, oldest first, and `waiters()` gives the calls that block until the
    next one finishes (the actor waits for them in threads while idle).

Invariants
    - every copy is answered exactly once: by copy() when it is refused or finished at
      once (a CPU pool), else by a later done(); a refused or failed copy is answered
      with ok=False and why, never by raising.
    - copies of one direction finish in the order they started (one stream each; one
      worker thread for the file store).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

import msgspec
import torch

from shunter.bus.messages import (
    BlocksErased,
    EraseBlocks,
    FetchPages,
    LoadPages,
    PagesFetched,
    PagesLoaded,
    PagesSpilled,
    PagesStored,
    SpillPages,
    StorePages,
)

if TYPE_CHECKING:
    from shunter.actors.executor.file_store import FileStore
    from shunter.actors.executor.host_pool import HostKVPool
    from shunter.actors.executor.kv_pool import KVPool

Copy = SpillPages | LoadPages | StorePages | FetchPages | EraseBlocks
CopyReply = PagesSpilled | PagesLoaded | PagesStored | PagesFetched | BlocksErased
_REPLY: dict[type, type] = {SpillPages: PagesSpilled, LoadPages: PagesLoaded,
                            StorePages: PagesStored, FetchPages: PagesFetched,
                            EraseBlocks: BlocksErased}  # fmt: skip


class _FileDone:
    """A file store call's future, waited for as the device copies' events are."""

    def __init__(self, fut: Future) -> None:
        self.fut = fut

    def query(self) -> bool:
        return self.fut.done()

    def synchronize(self) -> None:
        self.fut.result()


class Copies:
    """See the module docstring. `device_pool` gives the device KV pool (the runner's,
    which a memory release replaces); `host_pool` None: the host tier is off;
    `file_store` None: no store below it."""

    def __init__(self, device_pool: Callable[[], KVPool], host_pool: HostKVPool | None,
                 file_store: FileStore | None) -> None:  # fmt: skip
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.file_store = file_store
        # copies still running, oldest first: (what tells when done, their reply)
        self.running: deque[tuple[torch.cuda.Event | _FileDone, CopyReply]] = deque()

    def copy(self, msg: Copy) -> CopyReply | None:
        """Start `msg`; its reply, or None while it runs (done() answers it then)."""
        reply = _REPLY[type(msg)]
        try:
            if self.host_pool is None:
                raise ValueError("the host KV tier is off")
            done: torch.cuda.Event | _FileDone | None
            if isinstance(msg, SpillPages):
                done = self.host_pool.spill(self.device_pool(), msg.device_pages, msg.host_pages)
            elif isinstance(msg, LoadPages):
                done = self.host_pool.load(self.device_pool(), msg.host_pages, msg.device_pages)
            elif self.file_store is None:
                raise ValueError("the file store is off")
            elif isinstance(msg, StorePages):
                done = _FileDone(self.file_store.write(msg.keys, msg.host_pages))
            elif isinstance(msg, FetchPages):
                done = _FileDone(self.file_store.fetch(msg.keys, msg.skip, msg.host_pages))
            else:
                done = _FileDone(self.file_store.erase(msg.keys, everything=msg.everything))
        except Exception as e:
            return reply(msg.copy_id, msg.keys, ok=False, error=_why(e))
        if done is None:
            return reply(msg.copy_id, msg.keys)
        self.running.append((done, reply(msg.copy_id, msg.keys)))
        return None

    def done(self, wait: bool = False) -> list[CopyReply]:
        """The replies of the copies that have finished, oldest first (with `wait`: of
        every copy, blocking until they have). A load does not wait for an older spill:
        each direction has its own stream (and the file store its own thread)."""
        out, running = [], deque()
        for done, reply in self.running:
            try:
                if not wait and not done.query():
                    running.append((done, reply))
                    continue
                done.synchronize()
            except Exception as e:  # a device error ends the copy: its pages are not kept
                reply = msgspec.structs.replace(reply, ok=False, error=_why(e))
            out.append(reply)
        self.running = running
        return out

    def waiters(self) -> list[Callable[[], None]]:
        """Calls that block until the oldest copy in flight in each direction has
        finished (to run in other threads; they change nothing): one returns as soon as
        any copy is done, since each direction's copies finish in order."""
        oldest: dict[type, Callable[[], None]] = {}
        for done, reply in self.running:
            oldest.setdefault(type(reply), done.synchronize)
        return list(oldest.values())


def _why(e: Exception) -> str:
    """A copy's failure as its reply says it: a refusal's own words, else the type too."""
    return str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
