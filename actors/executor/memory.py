"""Giving up and taking back the executor's device memory (a flip's ReleaseMemory and
ResumeMemory; SGLang's /release_memory_occupation and /resume_memory_occupation), so
that a trainer can use the device between rollouts.

Theory of operation: three tags, as SGLang names them. "weights": every tensor the
model computes with (reload.py's `model_tensors`) is copied to the host (pinned
buffers, allocated at the first release and kept for the next ones) and
its storage swapped for an empty one through `.data`, so every holder of the tensor
object sees the swap; resuming copies each back into new storage. "kv_cache": the
pool's K/V storage is swapped for empty (kv_pool.py); resuming allocates it again,
zeroed (what it held is gone; the flip dropped the prefix cache first). "cuda_graph":
the captured decode and piecewise graphs and their memory pools. New storage has new addresses, so
the graphs go whenever anything is released and are captured again once everything
is back. A weights update may run while only the KV cache is released (RL trainers
resume the weights, sync them, then resume the KV cache); nothing else runs while
anything is released (the flip holds admission and nothing runs).

On a CPU the weights' host copy is the tensor itself (nothing is freed or copied); the
KV cache and the state change as on a GPU.

Invariants: called only while nothing runs and no batch is in flight; a tag is
released at most once before it is resumed; `released` is what is released now.
"""

from __future__ import annotations

import torch

from shunter.actors.executor.core import ExecutorCore
from shunter.actors.executor.reload import model_tensors

TAGS = ("weights", "kv_cache", "cuda_graph")


class DeviceMemory:
    def __init__(self, core: ExecutorCore) -> None:
        self.core = core
        self.released: set[str] = set()
        self._host: dict[str, torch.Tensor] = {}  # weights kept on the host, by name
        # pinned host buffers of device weights, kept between releases: allocating 15 GiB
        # of pinned memory took most of a 10 s release on an H200 (BENCHMARKS.md)
        self._pinned: dict[str, torch.Tensor] = {}

    def release(self, tags: list[str]) -> str:
        """Give up the memory of `tags`; what was freed. ValueError (nothing done) for
        an unknown tag or one released already."""
        _check(tags, self.released, "released already")
        runner, freed = self.core.runner, 0
        for graphs in runner.graph_sets:
            graphs.drop()
        if "weights" in tags:
            for name, t in model_tensors(runner.model).items():
                if t.layout != torch.strided:  # an opaque prepacked CPU weight: stays
                    continue
                host = t.data
                if t.device.type != "cpu":  # a pinned host copy; the device's freed
                    host = self._pinned.get(name)
                    if host is None or host.shape != t.shape or host.dtype != t.dtype:
                        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                        self._pinned[name] = host
                    host.copy_(t.data)
                    freed += t.nbytes
                self._host[name] = host
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        if "kv_cache" in tags:
            freed += runner.kv_pool.release()
        self.released |= set(tags)
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
            torch.cuda.empty_cache()  # back to the driver, for another process
        return f"released {sorted(tags)}: {freed / 2**20:.1f} MiB of device memory"

    def resume(self, tags: list[str]) -> str:
        """Take back the memory of `tags`; what was done. ValueError (nothing done) for
        an unknown tag or one not released."""
        _check(tags, self.released, "not released", want_released=True)
        runner = self.core.runner
        if "weights" in tags:
            tensors = model_tensors(runner.model)
            for name, host in self._host.items():
                t = tensors[name]
                t.data = host.to(t.device, non_blocking=True)  # on a CPU: host itself
            self._host.clear()
        if "kv_cache" in tags:
            runner.kv_pool.resume()
        self.released -= set(tags)
        message = f"resumed {sorted(tags)}"
        again = [g for g in runner.graph_sets if not g.captured] if not self.released else []
        for graphs in again:
            graphs.capture_all(progress=False)
        if again:
            message += "; CUDA graphs captured again"
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        return message


def _check(tags: list[str], released: set[str], why: str, want_released: bool = False) -> None:
    unknown = sorted(set(tags) - set(TAGS))
    if unknown or not tags:
        raise ValueError(f"tags must be some of {list(TAGS)}, got {tags}")
    bad = sorted(t for t in tags if (t in released) != want_released)
    if bad:
        raise ValueError(f"{bad} {why}")
