"""The file tier of the KV cache, below the host pool (host_pool.py): one file per block
of KV, keyed by content (StorePages / FetchPages, bus/messages/spill.py).

Theory of operation: a block is `block_pages` consecutive pages of a prefix
(`block_tokens` tokens, from a multiple of block_tokens), and its key is a signed 64-bit
hash chain over the prefix's whole blocks, so a key names the content, not where the
block lives. Which blocks the store holds and which host pages hold them are the cache
manager's bookkeeping; FileStore only moves bytes between host pages and files. `write`
gathers a block's slots from the host pool into a file; `fetch` reads files back into
host pages, the first block possibly from page `skip` on (the tree has its head);
`erase` deletes blocks' files, or every block file in the directory (a cleared store).

All of one model's blocks live in `path` = root / <16 hex digits of blake2b(fingerprint)>,
so models (or layouts) never read each other's files; `layout.json` there names the
fingerprint and layout for a human, and a store of another layout refuses to open it. A
block's file is `<key as unsigned 64-bit hex>.kv` (block_files.py):

    header, _HEADER (64 bytes, little-endian): magic, version, block_tokens, num_layers,
        num_kv_heads, head_dim, dtype name (e.g. b"bfloat16"), key (signed)
    K: [num_layers, block_tokens, num_kv_heads, head_dim] of dtype, raw bytes
    V: the same

The store may be given a size cap (`max_bytes`, --hicache-storage-max-size): it is
`max_blocks` whole block files, which the cache manager keeps it under by evicting the
least recently used blocks through `erase` (actors/cache_manager/store_tier.py); the
store itself only says how many fit. A fetch sets each file's modification time to now,
so a file's time is when it was last written or read, and a later run's listing (oldest
first, block_files.py) is in the order of last use.

One worker thread does all the file work, in submission order: the executor core never
waits on a disk, and a fetch queued after a write of the same key finds its file. The
host pages a call names stay put until its future is done (the cache manager answers
nothing about them before the reply). A block's bytes are fsynced before its file gets
its name, so after a crash of the machine a named file is whole (a block whose rename
did not reach the disk is only missing; the directory is not fsynced per block).

Invariants: a file named k holds block k, whole: it appears under its name only by
os.replace of a finished temp file in the same directory, and a block is never
rewritten (same key, same content). A refused call (ValueError) queues nothing.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import os
import pathlib
import struct
import tempfile

import torch

from shunter.actors.executor import block_files
from shunter.actors.executor.host_pool import HostKVPool

_MAGIC = b"SHUNTRKV"
_VERSION = 1
# magic, version, block_tokens, num_layers, num_kv_heads, head_dim, dtype, key, padding
_HEADER = struct.Struct("<8s5I16sq12x")
_U64 = 2**64


class FileStore:
    """Block files under `root` for `pool`'s layout; see the module docstring."""

    def __init__(self, root: str | os.PathLike, pool: HostKVPool, block_pages: int,
                 fingerprint: str, max_bytes: int = 0) -> None:  # fmt: skip
        if block_pages < 1:
            raise ValueError(f"block_pages must be >= 1, got {block_pages}")
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 (0: no cap), got {max_bytes}")
        self.pool = pool
        self.block_pages = block_pages
        self.block_tokens = block_pages * pool.page_size
        num_kv_heads, head_dim = pool.slot_shape
        self._dtype_name = str(pool.dtype).removeprefix("torch.")
        self._layout = (self.block_tokens, pool.num_layers, num_kv_heads, head_dim,
                        self._dtype_name)  # fmt: skip
        self._shape = (pool.num_layers, self.block_tokens, num_kv_heads, head_dim)
        block_bytes = self.block_tokens * pool.num_layers * pool.k_all[0, :1].nbytes
        self._file_bytes = _HEADER.size + 2 * block_bytes  # header, K, V
        self.max_blocks = max_bytes // self._file_bytes  # 0: no cap (max_bytes 0)
        if max_bytes and not self.max_blocks:
            raise ValueError(f"a file store of at most {max_bytes / 1e9:g} GB holds no block "
                             f"(a block's file is {self._file_bytes} bytes)")  # fmt: skip
        digest = hashlib.blake2b(fingerprint.encode(), digest_size=8).hexdigest()
        self.path = pathlib.Path(root) / digest
        self.path.mkdir(parents=True, exist_ok=True)
        self._write_layout(fingerprint)
        self._worker = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="kv-file-store"
        )

    def list_keys(self) -> list[int]:
        """Keys of the whole block files in `path`, sorted; temp files, other names and
        files of the wrong size are not blocks."""
        return block_files.list_keys(self.path, self._file_bytes)

    def write(self, keys: list[int], host_pages: list[int]) -> concurrent.futures.Future[None]:
        """Write block `keys[i]` from host_pages[i * block_pages : (i + 1) * block_pages],
        skipping blocks already on disk. The future is done once every file is."""
        self._check(keys, host_pages, len(keys) * self.block_pages)
        return self._worker.submit(self._write, list(keys), list(host_pages))

    def fetch(self, keys: list[int], skip: int,
              host_pages: list[int]) -> concurrent.futures.Future[None]:  # fmt: skip
        """Read blocks `keys` into host_pages: the first block's pages from `skip` on,
        then every page of the others, in order. The future raises if a file is
        missing, short or of another layout or key."""
        if not 0 <= skip < self.block_pages:
            raise ValueError(f"skip {skip} out of range [0, {self.block_pages})")
        self._check(keys, host_pages, len(keys) * self.block_pages - skip)
        if len(set(host_pages)) != len(host_pages):
            raise ValueError("a host page is a fetch destination twice")
        return self._worker.submit(self._fetch, list(keys), skip, list(host_pages))

    def erase(self, keys: list[int], everything: bool = False) -> concurrent.futures.Future[int]:
        """Delete the files of blocks `keys` (a missing one is no error), or with
        `everything` every block file in `path` and the temp files a killed process
        left there. The future gives the number of files deleted."""
        self._check(keys, [], None)
        return self._worker.submit(self._erase, list(keys), everything)

    def close(self) -> None:
        """Finish the queued work and stop the worker thread."""
        self._worker.shutdown(wait=True)

    def _check(self, keys: list[int], host_pages: list[int], num_pages: int | None) -> None:
        if num_pages is not None and len(host_pages) != num_pages:
            raise ValueError(
                f"{len(keys)} blocks of {self.block_pages} pages need {num_pages} host "
                f"pages, got {len(host_pages)}"
            )
        bad = next((p for p in host_pages if not 0 <= p < self.pool.num_pages), None)
        if bad is not None:
            raise ValueError(f"host page {bad} out of range [0, {self.pool.num_pages})")
        bad = next((k for k in keys if not -(_U64 // 2) <= k < _U64 // 2), None)
        if bad is not None:
            raise ValueError(f"key {bad} is not a signed 64-bit integer")

    def _write(self, keys: list[int], host_pages: list[int]) -> None:
        n = self.block_pages
        for i, key in enumerate(keys):
            final = self.path / block_files.file_name(key)
            if final.exists():  # same key, same content
                continue
            slots = self._slots(host_pages[i * n : (i + 1) * n])
            header = _HEADER.pack(_MAGIC, _VERSION, *self._layout[:4],
                                  self._dtype_name.encode(), key)  # fmt: skip
            fd, tmp = tempfile.mkstemp(prefix=final.name + ".", suffix=".tmp", dir=self.path)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(header)
                    for t in (self.pool.k_all, self.pool.v_all):
                        block = t.index_select(1, slots)  # [L, block_tokens, H, D] cpu
                        f.write(block.reshape(-1).view(torch.uint8).numpy())  # bf16 too
                    f.flush()
                    os.fsync(f.fileno())  # the bytes are on disk before the name is
                os.replace(tmp, final)
            except BaseException:
                pathlib.Path(tmp).unlink(missing_ok=True)
                raise

    def _erase(self, keys: list[int], everything: bool) -> int:
        if everything:  # (the writes queued before this have finished: no temp file is live)
            with os.scandir(self.path) as it:
                files = [e.path for e in it
                         if (block_files.BLOCK_FILE.fullmatch(e.name) or block_files.TEMP_FILE.fullmatch(e.name)) and e.is_file()]  # fmt: skip
        else:
            files = [self.path / block_files.file_name(k) for k in keys]
        num = 0
        for f in files:
            try:
                os.unlink(f)
                num += 1
            except FileNotFoundError:
                pass
        return num

    def _fetch(self, keys: list[int], skip: int, host_pages: list[int]) -> None:
        at = 0  # host_pages consumed so far
        for i, key in enumerate(keys):
            first = skip if i == 0 else 0
            pages = host_pages[at : at + self.block_pages - first]
            at += len(pages)
            k, v = self._read(key)
            slots = self._slots(pages)
            tail = first * self.pool.page_size
            self.pool.k_all.index_copy_(1, slots, k[:, tail:])
            self.pool.v_all.index_copy_(1, slots, v[:, tail:])
            with contextlib.suppress(OSError):  # (a read-only store still reads)
                os.utime(self.path / block_files.file_name(key))  # last used: now

    def _read(self, key: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of block `key` ([L, block_tokens, H, D] each), checked whole."""
        what = f"block {key & (_U64 - 1):016x}"
        file = self.path / block_files.file_name(key)
        try:
            f = open(file, "rb")  # noqa: SIM115 - closed below, after the error mapping
        except FileNotFoundError:
            raise FileNotFoundError(f"{what}: no file {file}") from None
        with f:
            size = os.fstat(f.fileno()).st_size
            if size != self._file_bytes:
                raise ValueError(f"{what}: file is {size} bytes, expected {self._file_bytes}")
            magic, version, *layout, dtype, got_key = _HEADER.unpack(f.read(_HEADER.size))
            if magic != _MAGIC or version != _VERSION:
                raise ValueError(f"{what}: not a version {_VERSION} KV block file")
            layout.append(dtype.rstrip(b"\0").decode(errors="replace"))
            if tuple(layout) != self._layout:
                raise ValueError(f"{what}: layout {tuple(layout)} differs from the store's "
                                 f"{self._layout} (block_tokens, layers, kv heads, head dim, "
                                 f"dtype)")  # fmt: skip
            if got_key != key:
                raise ValueError(f"{what}: file holds block {got_key & (_U64 - 1):016x}")
            out = []
            for _ in range(2):  # K, then V
                t = torch.empty(self._shape, dtype=self.pool.dtype)
                buf = t.view(-1).view(torch.uint8).numpy()
                if f.readinto(buf) != len(buf):
                    raise ValueError(f"{what}: file ends early")
                out.append(t)
        return out[0], out[1]

    def _slots(self, pages: list[int]) -> torch.Tensor:
        """[len(pages) * page_size] int64: every slot of `pages`, page by page."""
        ps = self.pool.page_size
        p = torch.as_tensor(pages, dtype=torch.int64)
        return (p[:, None] * ps + torch.arange(ps)[None, :]).reshape(-1)

    def _write_layout(self, fingerprint: str) -> None:
        """Record the fingerprint and layout in `path`, or ValueError if a store of
        another layout holds the directory (its blocks would fail every fetch)."""
        names = ("block_pages", "page_size", "num_layers", "num_kv_heads", "head_dim", "dtype")
        values = (self.block_pages, self.pool.page_size, self.pool.num_layers,
                  *self.pool.slot_shape, self._dtype_name)  # fmt: skip
        layout = {"fingerprint": fingerprint, **dict(zip(names, values, strict=True))}
        file = self.path / "layout.json"
        if file.exists():
            old = json.loads(file.read_text())
            if old != layout:
                raise ValueError(f"{self.path} holds blocks of layout {old}, not {layout}; "
                                 f"use another fingerprint or root")  # fmt: skip
            return
        fd, tmp = tempfile.mkstemp(prefix="layout.json.", suffix=".tmp", dir=self.path)
        with os.fdopen(fd, "w") as f:
            json.dump(layout, f, indent=1)
        os.replace(tmp, file)
