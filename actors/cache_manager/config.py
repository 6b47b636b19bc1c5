"""Cache manager configuration: one frozen Struct, validated on construction.

The config also travels inside the cache manager's `Ready.info` (see `to_info` /
`from_info`), so a recorded event log carries what is needed to rebuild the core for
replay.
"""

from __future__ import annotations

import msgspec

from shunter.actors.cache_manager.radix import EVICTION_POLICIES

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES = ("wait_complete", "best_effort", "timeout")
SELECTIVE_HITS = 2


class CacheConfig(msgspec.Struct, frozen=True, kw_only=True):
    num_pages: int
    """Pages in the device KV pool (the executor's pool size divided by page_size)."""

    page_size: int = 1
    """Tokens per page. The tree matches and caches whole pages only."""

    disable_radix_cache: bool = False
    """No prefix sharing: matches are always empty and released pages are freed."""

    eviction_policy: str = "lru"
    """Which unlocked leaves go first when leases need pages: "lru" (least recently
    matched) or "lfu" (fewest matches, then least recent). Time is a logical counter
    advanced once per handled message, never a clock."""

    emit_kv_events: bool = True
    """Publish BlockStored / BlockRemoved / AllBlocksCleared (this also computes the
    per-page block hash chain)."""

    num_host_pages: int = 0
    """Pages in the host pool (the executor's host tier); 0: no host tier."""

    write_policy: str = "write_through"
    """When cached pages are backed up to the host tier: "write_through" (as soon as they
    enter the tree), "write_through_selective" (once a match has reached them
    SELECTIVE_HITS times, so pages used once do not cost a copy) or "write_back" (when
    device eviction takes them: the grant that asked waits for the copy)."""

    store_block_tokens: int = 0
    """Tokens per block of the file store below the host tier (store_tier.py), a
    multiple of page_size; 0: no file store. Needs the host tier."""

    store_max_blocks: int = 0
    """Most blocks the file store may hold (--hicache-storage-max-size over the size of
    a block's file); past it the least recently used go (store_tier.py). 0: no cap."""

    store_prefetch_policy: str = "wait_complete"
    """Whether a match waits for the blocks it reads from the file store:
    "wait_complete" (it does, then loads them) or "best_effort" (it never does: it is
    answered with what the device and host tiers hold, and the read fills the host tier
    for the matches after it) or "timeout" (it waits, but for no longer than
    store_tier.prefetch_timeout_ns of the tokens past its match, measured by the
    scheduler's Ticks, then goes on as under best_effort)."""

    store_path: str = ""
    """The file store's directory (the executor's, for this model and layout), which
    the shell lists at start; the core never reads it."""

    actor_id: str = "cache"
    """This instance's id on the bus."""

    def __post_init__(self) -> None:
        if not isinstance(self.num_pages, int) or self.num_pages < 1:
            raise ValueError(f"num_pages must be a positive integer, got {self.num_pages!r}")
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise ValueError(f"page_size must be a positive integer, got {self.page_size!r}")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"eviction_policy {self.eviction_policy!r} is not supported "
                f"(choose from {', '.join(EVICTION_POLICIES)})"
            )
        if not isinstance(self.num_host_pages, int) or self.num_host_pages < 0:
            raise ValueError(f"num_host_pages must be >= 0, got {self.num_host_pages!r}")
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"write_policy {self.write_policy!r} is not supported "
                f"(choose from {', '.join(WRITE_POLICIES)})"
            )
        if self.store_block_tokens and (
            self.store_block_tokens < 0
            or self.store_block_tokens % self.page_size
            or not self.num_host_pages
        ):
            raise ValueError(f"store_block_tokens must be a multiple of page_size "
                             f"({self.page_size}) with a host tier, got "
                             f"{self.store_block_tokens!r}")  # fmt: skip
        if (
            not isinstance(self.store_max_blocks, int)
            or self.store_max_blocks < 0
            or (self.store_max_blocks and not self.store_block_tokens)
        ):
            raise ValueError(f"store_max_blocks must be >= 0 (0: no cap), and needs a file "
                             f"store, got {self.store_max_blocks!r}")  # fmt: skip
        if self.store_prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(
                f"store_prefetch_policy {self.store_prefetch_policy!r} is not supported "
                f"(choose from {', '.join(PREFETCH_POLICIES)})"
            )
        if not self.actor_id:
            raise ValueError("actor_id must not be empty")

    @property
    def num_tokens(self) -> int:
        """KV slots in the pool."""
        return self.num_pages * self.page_size

    def to_info(self) -> dict[str, int | float | str]:
        """The config as `Ready.info` (flat str -> int|float|str; bools as 0/1)."""
        return {
            "num_pages": self.num_pages,
            "page_size": self.page_size,
            "disable_radix_cache": int(self.disable_radix_cache),
            "eviction_policy": self.eviction_policy,
            "emit_kv_events": int(self.emit_kv_events),
            "num_host_pages": self.num_host_pages,
            "write_policy": self.write_policy,
            "store_block_tokens": self.store_block_tokens,
            "store_path": self.store_path,
            "store_max_blocks": self.store_max_blocks,
            "store_prefetch_policy": self.store_prefetch_policy,
        }

    @classmethod
    def from_info(cls, info: dict[str, int | float | str], actor_id: str = "cache") -> CacheConfig:
        """Rebuild the config from a recorded `Ready.info` (inverse of `to_info`)."""
        try:
            return cls(
                num_pages=int(info["num_pages"]),
                page_size=int(info.get("page_size", 1)),
                disable_radix_cache=bool(int(info.get("disable_radix_cache", 0))),
                eviction_policy=str(info.get("eviction_policy", "lru")),
                emit_kv_events=bool(int(info.get("emit_kv_events", 1))),
                num_host_pages=int(info.get("num_host_pages", 0)),
                write_policy=str(info.get("write_policy", "write_through")),
                store_block_tokens=int(info.get("store_block_tokens", 0)),
                store_path=str(info.get("store_path", "")),
                store_max_blocks=int(info.get("store_max_blocks", 0)),
                store_prefetch_policy=str(info.get("store_prefetch_policy", "wait_complete")),
                actor_id=actor_id,
            )
        except KeyError as e:
            raise ValueError(f"cache Ready.info lacks {e.args[0]!r}: {info!r}") from None
