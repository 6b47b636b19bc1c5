"""Waiting-queue order: which waiting request the admission loop considers first.

Policies (SGLang's names)
    fcfs      first come, first served: the order requests first joined the queue (a
              retracted request keeps its original place, so it goes back near the front).
    lpm       longest cached prefix first (ties fcfs); plain fcfs when the queue is longer
              than `lpm_max_queue`, where sorting every step costs more than it saves.
    priority  larger `priority` first, with aging: a request's effective priority is
              priority + aging_per_s * seconds waited (time from Tick messages only).
              Bound: request A is never ranked after a request B that joined the queue
              more than (B.priority - A.priority) / aging_per_s seconds after A, because by
              then A has gained at least that much. So A is admitted once the finitely
              many requests that joined before that moment are (and with aging_per_s = 0
              it is strict priority, which can starve).
    lof       longest output first (largest max_new_tokens), ties fcfs.
    random    a seeded shuffle: splitmix64 seeded from the config, advanced once per
              ordering, so a replay of the same messages gives the same order.
"""

from __future__ import annotations

from collections.abc import Iterable

from shunter.actors.scheduler.req import Req

_MASK64 = (1 << 64) - 1


class SplitMix64:
    """A tiny deterministic PRNG (no process-global state, identical on every host)."""

    def __init__(self, seed: int) -> None:
        self.state = seed & _MASK64

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        return self.next() % n


class WaitingOrder:
    def __init__(self, policy: str, *, aging_per_s: float, lpm_max_queue: int, seed: int) -> None:
        self.policy = policy
        self.aging_per_s = aging_per_s
        self.lpm_max_queue = lpm_max_queue
        self.rng = SplitMix64(seed ^ 0x5EED)

    def effective_priority(self, req: Req, now_ns: int) -> float:
        waited_s = max(0, now_ns - req.enqueued_ns) / 1e9
        return req.priority + self.aging_per_s * waited_s

    def order(self, waiting: Iterable[Req], now_ns: int) -> list[Req]:
        """The waiting requests, most deserving first. `waiting` is in arrival order."""
        reqs = list(waiting)
        policy = self.policy
        if policy == "fcfs" or (policy == "lpm" and len(reqs) > self.lpm_max_queue):
            reqs.sort(key=lambda r: r.enqueue_seq)
        elif policy == "lpm":
            reqs.sort(key=lambda r: (-r.num_cached, r.enqueue_seq))
        elif policy == "priority":
            reqs.sort(key=lambda r: (-self.effective_priority(r, now_ns), r.enqueue_seq))
        elif policy == "lof":
            reqs.sort(key=lambda r: (-r.sampling.max_new_tokens, r.enqueue_seq))
        elif policy == "random":
            reqs.sort(key=lambda r: r.enqueue_seq)
            for i in range(len(reqs) - 1, 0, -1):  # Fisher-Yates
                j = self.rng.below(i + 1)
                reqs[i], reqs[j] = reqs[j], reqs[i]
        else:
            raise ValueError(f"unknown schedule policy {policy!r}")
        return reqs
