"""The host tier of the KV cache: a host-memory mirror of the device pool (kv_pool.py)
and the page copies between the two (SpillPages / LoadPages, bus/messages/spill.py).

Theory of operation: HostKVPool holds `num_pages` pages in the device pool's layout
([num_layers, num_slots, num_kv_heads, head_dim] per K and V, slot = page * page_size +
offset, same dtype), in host memory that is page-locked in place (cudaHostRegister)
when the device pool is on CUDA. It is not allocated through torch's pinned allocator,
which rounds every block up to a power of two (a 40 GB pool would lock 64 GB). Which
host page holds which tokens is the cache manager's; here a copy is a list of
(source page, destination page) pairs, checked whole before anything moves.

A copy moves every layer at once: the source slots are gathered along dim 1
(index_select over all layers) and scattered into the destination slots (index_copy_),
in chunks of about _CHUNK_BYTES so the temporaries stay small. On CUDA both directions
go through pinned staging on the current stream, the one the forwards run on: a load is
queued before any later forward (the host never waits for it), and a spill's gather is
queued after every earlier forward and synchronized before `spill` returns, so its host
pages are readable once it does. On a CPU the copies are plain tensor ops.

Invariants: a refused copy (ValueError: length mismatch, a page out of range, a
destination page named twice, the device pool released or of another layout) changes
nothing; a host page's contents are undefined until a spill writes it.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from collections.abc import Callable, Iterator

import msgspec
import torch

from shunter.actors.executor.kv_pool import KVPool, host_available_bytes

# K (or V) bytes of one chunk of a copy: bounds the gathered temporaries and staging
_CHUNK_BYTES = 64 << 20


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

    def spill(self, pool: KVPool, device_pages: list[int], host_pages: list[int]) -> None:
        """Copy `device_pages[i]` of `pool` into `host_pages[i]`, all layers, K and V;
        done (the host pages readable) when it returns."""
        self._check(pool, device_pages, host_pages, "device", pool.num_pages, "host",
                    self.num_pages)  # fmt: skip
        cuda = pool.device.type == "cuda"
        for src, dst in self._chunks(device_pages, host_pages, pool.device, "cpu"):
            blocks = [d.index_select(1, src) for d in (pool.k_all, pool.v_all)]  # [L, n, H, D]
            if cuda:  # to pinned staging, then wait: the stream reaches it after the forwards
                staged = [self._staging(b.shape) for b in blocks]
                for s, b in zip(staged, blocks, strict=True):
                    s.copy_(b, non_blocking=True)
                torch.cuda.current_stream(pool.device).synchronize()
                blocks = staged
            self.k_all.index_copy_(1, dst, blocks[0])
            self.v_all.index_copy_(1, dst, blocks[1])
        self._num_spilled += len(device_pages)

    def load(self, pool: KVPool, host_pages: list[int], device_pages: list[int]) -> None:
        """Copy `host_pages[i]` into `device_pages[i]` of `pool`, all layers, K and V. On
        CUDA it is queued on the current stream (ordered before later forwards) and may
        still be running when this returns."""
        self._check(pool, host_pages, device_pages, "host", self.num_pages, "device",
                    pool.num_pages)  # fmt: skip
        cuda = pool.device.type == "cuda"
        for src, dst in self._chunks(host_pages, device_pages, "cpu", pool.device):
            for h, d in ((self.k_all, pool.k_all), (self.v_all, pool.v_all)):
                if cuda:  # the host allocator keeps the staging until the copy has run
                    block = self._staging((self.num_layers, len(src), *self.slot_shape))
                    torch.index_select(h, 1, src, out=block)
                    d.index_copy_(1, dst, block.to(pool.device, non_blocking=True))
                else:
                    d.index_copy_(1, dst, h.index_select(1, src))
        self._num_loaded += len(host_pages)

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

    def _chunks(self, src: list[int], dst: list[int], src_device: str | torch.device,
                dst_device: str | torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
        """([n] int64 source slots, [n] int64 destination slots) on their pools' devices,
        about _CHUNK_BYTES of K per chunk."""
        slot_bytes = self.num_layers * self.k_all[0, :1].nbytes
        step = max(1, _CHUNK_BYTES // (slot_bytes * self.page_size))
        for i in range(0, len(src), step):
            yield (_slots(src[i : i + step], self.page_size).to(src_device),
                   _slots(dst[i : i + step], self.page_size).to(dst_device))  # fmt: skip

    def _staging(self, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
        return torch.empty(shape, dtype=self.dtype, pin_memory=self.pinned)


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
