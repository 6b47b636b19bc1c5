"""The paged KV pool: per-layer K and V tensors indexed by flat slot.

Theory of operation: the pool is `num_pages` pages of `page_size` token slots each;
slot = page * page_size + offset. Layer l's keys are `k_buffers[l]`, a
[num_slots, num_kv_heads, head_dim] tensor (values likewise); all layers are views
into one [num_layers, num_slots, num_kv_heads, head_dim] allocation per K and V so
the pool is a single allocation that can be released and re-made at a flip. Which
slots belong to which request is not known here: the cache manager owns allocation,
the executor mirrors each request's slot table, and the runner writes and reads
slots through the kernels in kernels/kv_store.py and kernels/attention_*.py.

A pool built with `pad_page=True` holds one more page than it advertises: the
padding page, whose first slot (`pad_slot`) padded entries of a replayed CUDA graph
write and read, so padding never touches a slot the cache manager hands out.

Invariants: num_slots == num_pages * page_size (the slots the cache manager may use);
every buffer has the pool's dtype and device; num_pages >= 1; pad_slot, when there is
one, is num_slots and lies in every buffer.
"""

from __future__ import annotations

import msgspec
import torch

from shunter.actors.executor.models.config import ModelConfig

DEFAULT_HOST_MEM_FRACTION = 0.25
# With no budget at all on a CPU, also stop here: the pool is zeroed up front (it costs
# its full size in RSS and seconds of memset), and a CPU engine cannot use more.
DEFAULT_CPU_MAX_TOKENS = 32768


class KVPoolStats(msgspec.Struct, frozen=True):
    num_pages: int
    page_size: int
    num_slots: int
    num_layers: int
    bytes_per_token: int
    total_bytes: int


def host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux); a conservative 4 GiB elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


class KVPool:
    """K/V storage for every layer; see the module docstring."""

    def __init__(
        self,
        config: ModelConfig,
        num_pages: int,
        *,
        page_size: int = 1,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        pad_page: bool = False,
    ) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.config = config
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_layers = config.num_layers
        self.pad_slot: int | None = self.num_slots if pad_page else None
        allocated = self.num_slots + (page_size if pad_page else 0)
        shape = (config.num_layers, allocated, config.num_kv_heads, config.head_dim)
        self.k_all = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v_all = torch.zeros(shape, dtype=dtype, device=self.device)
        # [num_slots, num_kv_heads, head_dim] per layer
        self.k_buffers = list(self.k_all.unbind(0))
        self.v_buffers = list(self.v_all.unbind(0))

    @property
    def released(self) -> bool:
        return self.k_all.numel() == 0

    def release(self) -> int:
        """Give up the K/V storage (its contents are lost); the tensors stay, empty, so
        whatever holds them sees the change. Returns the bytes freed."""
        freed = self.k_all.nbytes + self.v_all.nbytes
        self._shape = self.k_all.shape
        for t in (self.k_all, self.v_all, *self.k_buffers, *self.v_buffers):
            t.data = torch.empty(0, dtype=self.dtype, device=self.device)
        return freed

    def resume(self) -> None:
        """New K/V storage, zeroed, in the same tensors (each layer's a view into it)."""
        self.k_all.data = torch.zeros(self._shape, dtype=self.dtype, device=self.device)
        self.v_all.data = torch.zeros(self._shape, dtype=self.dtype, device=self.device)
        for i, (k, v) in enumerate(zip(self.k_buffers, self.v_buffers, strict=True)):
            k.data, v.data = self.k_all[i], self.v_all[i]

    @classmethod
    def from_budget(
        cls,
        config: ModelConfig,
        *,
        dtype: torch.dtype,
        device: str | torch.device,
        page_size: int = 1,
        max_total_tokens: int | None = None,
        mem_bytes: int | None = None,
        host_mem_fraction: float | None = None,
        pad_page: bool = False,
    ) -> KVPool:
        """Size the pool from one budget, in this order of precedence: max_total_tokens
        (exact token count, rounded up to whole pages), mem_bytes (bytes for K+V of all
        layers), host_mem_fraction (of MemAvailable now). With no budget: on a CPU 0.25
        of MemAvailable capped at DEFAULT_CPU_MAX_TOKENS; on CUDA 0.8 of free memory."""
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        elem = torch.empty((), dtype=dtype).element_size()
        per_token = config.kv_bytes_per_token(elem)
        if max_total_tokens is not None:
            if max_total_tokens < 1:
                raise ValueError(f"max_total_tokens must be >= 1, got {max_total_tokens}")
            num_tokens = max_total_tokens
        else:
            mem_bytes_given = mem_bytes
            if mem_bytes is None:
                dev = torch.device(device)
                if dev.type == "cuda" and host_mem_fraction is None:
                    free, _ = torch.cuda.mem_get_info(dev)
                    mem_bytes = int(free * 0.8)
                else:
                    frac = (
                        DEFAULT_HOST_MEM_FRACTION
                        if host_mem_fraction is None
                        else host_mem_fraction
                    )
                    if not 0 < frac <= 1:
                        raise ValueError(f"host_mem_fraction must be in (0, 1], got {frac}")
                    mem_bytes = int(host_available_bytes() * frac)
            if mem_bytes < per_token * page_size:
                raise ValueError(
                    f"KV budget of {mem_bytes} bytes is below one page "
                    f"({per_token * page_size} bytes at {per_token} bytes/token)"
                )
            num_tokens = mem_bytes // per_token
            no_budget = mem_bytes_given is None and host_mem_fraction is None
            if no_budget and torch.device(device).type == "cpu":
                num_tokens = min(num_tokens, DEFAULT_CPU_MAX_TOKENS)
        num_pages = (
            -(-num_tokens // page_size) if max_total_tokens is not None else num_tokens // page_size
        )
        if pad_page and max_total_tokens is None:
            num_pages = max(1, num_pages - 1)  # the budget pays for the padding page too
        return cls(config, num_pages, page_size=page_size, dtype=dtype, device=device,
                   pad_page=pad_page)  # fmt: skip

    def slots_of_pages(self, pages: list[int], num_tokens: int) -> torch.Tensor:
        """[num_tokens] int64 slots of tokens 0..num_tokens-1 of a row holding `pages`."""
        if num_tokens > len(pages) * self.page_size:
            raise ValueError(f"{num_tokens} tokens do not fit in {len(pages)} pages")
        p = torch.as_tensor(pages, dtype=torch.int64)
        if self.page_size == 1:
            return p[:num_tokens].clone()
        offs = torch.arange(self.page_size, dtype=torch.int64)
        return (p[:, None] * self.page_size + offs[None, :]).reshape(-1)[:num_tokens]

    def statistics(self) -> KVPoolStats:
        per_token = self.config.kv_bytes_per_token(self.k_all.element_size())
        return KVPoolStats(
            num_pages=self.num_pages,
            page_size=self.page_size,
            num_slots=self.num_slots,
            num_layers=self.num_layers,
            bytes_per_token=per_token,
            total_bytes=per_token * self.num_slots,
        )
