"""The host tier of the KV cache: a host-memory mirror of the device pool (kv_pool.py)
and the page copies between the two (SpillPages / LoadPages, bus/messages/spill.py).

Theory of operation: HostKVPool holds `num_pages` pages in the device pool's layout
([num_layers, num_slots, num_kv_heads, head_dim] per K and V, slot = page * page_size +
offset, same dtype), in host memory that is page-locked in place (cudaHostRegister)
when the device pool is on CUDA. It is not allocated through torch's pinned allocator,
which rounds every block up to a power of two (a 40 GB pool would lock 64 GB). Which
host page holds which tokens is the cache manager's; here a copy is a list of
(source page, destination page) pairs, checked whole before anything moves.

A copy takes its (device page, host page) pairs in host-page order, in chunks of
about _CHUNK_BYTES so the temporaries stay small. On the device side each chunk is one
gather (a spill's index_select) or scatter (a load's index_copy_) over all layers. On
the host side a chunk whose host pages form long runs of consecutive pages (at least
_MIN_RUN_BYTES of K per layer and run, on average) moves each run as one slice per
layer, straight between the host pool and a device-side block: no host-side gather or
scatter, which on a GPU costs more than the PCIe copy. A scattered chunk is gathered
or scattered on the host by index instead, through pinned staging.

On CUDA a copy is queued on a stream of its own per direction (two copy engines, PCIe
both ways) that first waits for every forward queued so far: a spill reads pages those
forwards wrote, a load overwrites pages they may still read (evicted a moment ago).
The forwards queued after it do not wait for it, so its PCIe transfer overlaps them,
and the copy returns an event that completes once its data has landed. Nothing reads
the copy's destination before then: the cache manager hands loaded pages to no request
and reads no backed-up host page until the executor has answered the copy, which it
does once the event is done. A spill's source pages are the prefix tree's, which
nothing writes, kept while the copy is in flight. Only a scattered chunk's host-side
scatter waits on the host for its stream. On a CPU the copies are done when the call
returns.

Invariants: a refused copy (ValueError: length mismatch, a page out of range, a
destination page named twice, the device pool released or of another layout) changes
nothing; a host page's contents are undefined until a spill writes it.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from typing import NamedTuple

import msgspec
import torch

from shunter.actors.executor.kv_pool import KVPool, host_available_bytes

# K (or V) bytes of one chunk of a copy: bounds the gathered temporaries and staging
_CHUNK_BYTES = 64 << 20
# A chunk's host pages move as slices when its runs of consecutive host pages average at
# least this many K bytes per layer; below it one indexed copy costs less than the
# slices' calls (2 per layer and run).
_MIN_RUN_BYTES = 64 << 10


class HostKVPoolStats(msgspec.Struct, frozen=True):
    num_pages: int
    page_size: int
    num_slots: int
    total_bytes: int  # K and V, all layers
    pinned: bool
    num_pages_spilled: int  # device -> host, since construction
    num_pages_loaded: int  # host -> device


def host_pool_pages(device_pool: KVPool, ratio: float, size_gb: float) -> int:
    """Pages of a host pool for `device_pool`: size_gb * 1e9 bytes of them when size_gb
    > 0, else ratio * the device pool's pages. ValueError if that is below one page or
    more than the host's available memory."""
    per_page = device_pool.statistics().bytes_per_token * device_pool.page_size
    if size_gb > 0:
        num_pages, how = int(size_gb * 1e9) // per_page, f"hicache_size={size_gb} GB"
    else:
        num_pages, how = int(ratio * device_pool.num_pages), f"hicache_ratio={ratio}"
    if num_pages < 1:
        raise ValueError(f"{how} gives no host KV page (a page is {per_page} bytes)")
    need, avail = num_pages * per_page, host_available_bytes()
    if need > avail:
        raise ValueError(
            f"{how} asks for {num_pages} host KV pages ({need / 1e9:.2f} GB), more than "
            f"the {avail / 1e9:.2f} GB of host memory available; lower it"
        )
    return num_pages


class HostKVPool:
    """Host pages in `like`'s layout; see the module docstring."""

    def __init__(self, num_pages: int, like: KVPool) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        cfg = like.config
        self.num_pages = num_pages
        self.page_size = like.page_size
        self.num_slots = num_pages * like.page_size
        self.num_layers = like.num_layers
        self.dtype = like.dtype
        self.slot_shape = (cfg.num_kv_heads, cfg.head_dim)
        shape = (self.num_layers, self.num_slots, *self.slot_shape)
        # [num_layers, num_slots, num_kv_heads, head_dim] dtype cpu, each
        self.k_all = torch.empty(shape, dtype=self.dtype)
        self.v_all = torch.empty(shape, dtype=self.dtype)
        self.pinned = like.device.type == "cuda" and _pin(self, [self.k_all, self.v_all])
        self._num_spilled = self._num_loaded = 0
        self._streams: dict[str, torch.cuda.Stream] = {}  # "spill", "load" (CUDA)

    def spill(self, pool: KVPool, device_pages: list[int],
              host_pages: list[int]) -> torch.cuda.Event | None:  # fmt: skip
        """Copy `device_pages[i]` of `pool` into `host_pages[i]`, all layers, K and V. On
        CUDA the copy is queued behind every forward queued so far, and the returned
        event completes once the host pages are readable; elsewhere it is done when this
        returns (None)."""
        self._check(pool, device_pages, host_pages, "device", pool.num_pages, "host",
                    self.num_pages)  # fmt: skip
        done = self._queue("spill", pool, self._spill, device_pages, host_pages)
        self._num_spilled += len(device_pages)
        return done

    def load(self, pool: KVPool, host_pages: list[int],
             device_pages: list[int]) -> torch.cuda.Event | None:  # fmt: skip
        """Copy `host_pages[i]` into `device_pages[i]` of `pool`, all layers, K and V. On
        CUDA the copy is queued behind every forward queued so far (which may still read
        the pages it overwrites), and the returned event completes once the device pages
        hold it: no forward may read them before; elsewhere it is done when this returns
        (None)."""
        self._check(pool, host_pages, device_pages, "host", self.num_pages, "device",
                    pool.num_pages)  # fmt: skip
        done = self._queue("load", pool, self._load, host_pages, device_pages)
        self._num_loaded += len(host_pages)
        return done

    def _queue(self, direction: str, pool: KVPool, copy: Callable, src: list[int],
               dst: list[int]) -> torch.cuda.Event | None:  # fmt: skip
        """copy(pool, src, dst, cuda) on the direction's copy stream after the forwards'
        stream, and the event of its end; on a CPU copy(..., False), done."""
        if pool.device.type != "cuda":
            copy(pool, src, dst, False)
            return None
        if (stream := self._streams.get(direction)) is None:
            stream = self._streams[direction] = torch.cuda.Stream(pool.device)
        stream.wait_stream(torch.cuda.current_stream(pool.device))
        with torch.cuda.stream(stream):  # the copy's temporaries belong to this stream
            copy(pool, src, dst, True)
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def _spill(self, pool: KVPool, device_pages: list[int], host_pages: list[int],
               cuda: bool) -> None:  # fmt: skip
        for part in self._parts(host_pages, device_pages, pool.device):
            for h, d in ((self.k_all, pool.k_all), (self.v_all, pool.v_all)):
                block = d.index_select(1, part.device_slots)  # [L, n, H, D], host order
                if part.runs is not None:  # no host pages repeat in a spill: pos is None
                    for first, at, count in part.runs:
                        _copy_slice(h, first, block, at, count, cuda)
                    continue
                if cuda:  # to pinned staging, read once the copy stream got there
                    staged = self._staging(block.shape)
                    staged.copy_(block, non_blocking=True)
                    torch.cuda.current_stream(pool.device).synchronize()
                    block = staged
                h.index_copy_(1, part.host_slots, block)

    def _load(self, pool: KVPool, host_pages: list[int], device_pages: list[int],
              cuda: bool) -> None:  # fmt: skip
        for part in self._parts(host_pages, device_pages, pool.device):
            for h, d in ((self.k_all, pool.k_all), (self.v_all, pool.v_all)):
                if part.runs is not None:
                    block = torch.empty((self.num_layers, part.num_host_slots, *self.slot_shape),
                                        dtype=self.dtype, device=pool.device)  # fmt: skip
                    for first, at, count in part.runs:
                        _copy_slice(block, at, h, first, count, cuda)
                    if part.pos is not None:  # a host page loaded into several pages
                        block = block.index_select(1, part.pos)
                elif cuda:  # the host allocator keeps the staging until the copy has run
                    staged = self._staging(
                        (self.num_layers, len(part.host_slots), *self.slot_shape)
                    )
                    torch.index_select(h, 1, part.host_slots, out=staged)
                    block = staged.to(pool.device, non_blocking=True)
                else:
                    block = h.index_select(1, part.host_slots)
                d.index_copy_(1, part.device_slots, block)

    def statistics(self) -> HostKVPoolStats:
        return HostKVPoolStats(
            num_pages=self.num_pages,
            page_size=self.page_size,
            num_slots=self.num_slots,
            total_bytes=self.k_all.nbytes + self.v_all.nbytes,
            pinned=self.pinned,
            num_pages_spilled=self._num_spilled,
            num_pages_loaded=self._num_loaded,
        )

    def _check(self, pool: KVPool, src: list[int], dst: list[int], src_name: str,
               src_limit: int, dst_name: str, dst_limit: int) -> None:  # fmt: skip
        """ValueError unless `src[i] -> dst[i]` is a valid copy with `pool`."""
        if pool.released:
            raise ValueError("the device KV pool is released")
        if (pool.page_size, pool.dtype, pool.num_layers, tuple(pool.k_all.shape[2:])) != (
            self.page_size, self.dtype, self.num_layers, self.slot_shape):  # fmt: skip
            raise ValueError("the device KV pool's layout differs from the host pool's")
        if len(src) != len(dst):
            raise ValueError(f"{len(src)} {src_name} pages but {len(dst)} {dst_name} pages")
        for name, pages, limit in ((src_name, src, src_limit), (dst_name, dst, dst_limit)):
            bad = next((p for p in pages if not 0 <= p < limit), None)
            if bad is not None:
                raise ValueError(f"{name} page {bad} out of range [0, {limit})")
        if len(set(dst)) != len(dst):
            twice = next(p for p, n in Counter(dst).items() if n > 1)
            raise ValueError(f"{dst_name} page {twice} is a destination twice")

    def _parts(self, host_pages: list[int], device_pages: list[int],
               device: torch.device) -> Iterator[_Part]:  # fmt: skip
        """The pairs `host_pages[i] <-> device_pages[i]` in host-page order, about
        _CHUNK_BYTES of K per part."""
        order = sorted(range(len(host_pages)), key=host_pages.__getitem__)
        slot_bytes = self.k_all[0, :1].nbytes  # K of one slot in one layer
        step = max(1, _CHUNK_BYTES // (slot_bytes * self.num_layers * self.page_size))
        for i in range(0, len(order), step):
            hp = [host_pages[j] for j in order[i : i + step]]
            device_slots = _slots([device_pages[j] for j in order[i : i + step]],
                                  self.page_size).to(device)  # fmt: skip
            runs, pos = _runs(hp, self.page_size)
            slices = runs[-1][1] + runs[-1][2]  # slots of the distinct host pages
            if slices * slot_bytes >= _MIN_RUN_BYTES * len(runs):
                yield _Part(device_slots, None, runs, slices,
                            None if pos is None else _slots(pos, self.page_size).to(device))  # fmt: skip
            else:
                yield _Part(device_slots, _slots(hp, self.page_size), None, 0, None)

    def _staging(self, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
        return torch.empty(shape, dtype=self.dtype, pin_memory=self.pinned)


class _Part(NamedTuple):
    """One chunk of a copy, in host-page order."""

    device_slots: torch.Tensor  # [n] int64 on the device pool's device, pair by pair
    host_slots: torch.Tensor | None  # [n] int64 on the host, pair by pair (indexed copy)
    runs: list[tuple[int, int, int]] | None  # (host slot, block slot, slots) (sliced copy)
    num_host_slots: int  # slots of the block the runs fill
    pos: torch.Tensor | None  # [n] each pair's block slot, when a host page repeats


def _runs(pages: list[int], page_size: int) -> tuple[list[tuple[int, int, int]], list[int] | None]:
    """For sorted `pages`: the runs of consecutive distinct pages as (first host slot,
    slot in a block holding the distinct pages in order, slots), and each page's index
    among the distinct ones (None when no page repeats)."""
    distinct, pos = [pages[0]], [0]
    for p in pages[1:]:
        if p != distinct[-1]:
            distinct.append(p)
        pos.append(len(distinct) - 1)
    runs, start = [], 0
    for k in range(1, len(distinct) + 1):
        if k == len(distinct) or distinct[k] != distinct[k - 1] + 1:
            runs.append((distinct[start] * page_size, start * page_size, (k - start) * page_size))
            start = k
    return runs, None if len(distinct) == len(pages) else pos


def _copy_slice(dst: torch.Tensor, dst_at: int, src: torch.Tensor, src_at: int, count: int,
                cuda: bool) -> None:  # fmt: skip
    """dst[:, dst_at:+count] = src[:, src_at:+count] ([L, slots, H, D] each). Between the
    host and a GPU one copy per layer, each a contiguous block (a strided copy across
    devices would go through an unpinned temporary)."""
    if not cuda:
        dst[:, dst_at : dst_at + count].copy_(src[:, src_at : src_at + count])
        return
    for d, s in zip(dst, src, strict=True):
        d[dst_at : dst_at + count].copy_(s[src_at : src_at + count], non_blocking=True)


def _slots(pages: list[int], page_size: int) -> torch.Tensor:
    """[len(pages) * page_size] int64: every slot of `pages`, page by page."""
    p = torch.as_tensor(pages, dtype=torch.int64)
    if page_size == 1:
        return p
    return (p[:, None] * page_size + torch.arange(page_size)[None, :]).reshape(-1)


def _pin(owner: object, tensors: list[torch.Tensor]) -> bool:
    """Page-lock `tensors` in place (for every device: cudaHostRegisterPortable) until
    `owner` is collected; False (nothing locked) if the driver refuses. The CUDA calls
    run in a thread of their own, so a refusal's error, which the runtime keeps per
    thread, never surfaces in a later kernel launch."""
    cudart = torch.cuda.cudart()
    ptrs = [t.data_ptr() for t in tensors if t.nbytes]
    done = [_in_thread(lambda t=t: int(cudart.cudaHostRegister(t.data_ptr(), t.nbytes, 1)))
            for t in tensors if t.nbytes]  # fmt: skip
    locked = [p for p, err in zip(ptrs, done, strict=True) if err == 0]
    if locked:
        weakref.finalize(owner, _unpin, locked).atexit = False
    if len(locked) < len(ptrs):
        _unpin(locked)
        return False
    return True


def _unpin(ptrs: list[int]) -> None:
    cudart = torch.cuda.cudart()
    for p in ptrs:
        _in_thread(lambda p=p: int(cudart.cudaHostUnregister(p)))
    ptrs.clear()  # a refused pool's finalizer then has nothing left to unlock


def _in_thread(fn: Callable[[], int]) -> int:
    out: list[int] = []
    t = threading.Thread(target=lambda: out.append(fn()), name="host-kv-pin")
    t.start()
    t.join()
    return out[0] if out else -1
