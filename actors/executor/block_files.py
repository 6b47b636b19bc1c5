"""How the file store names its block files (file_store.py), without torch: the cache
manager's shell lists a store's directory at start with these too.

A block's file is `<key as unsigned 64-bit hex, 16 digits>.kv`; a block being written is
a temp file `<that name>.<random>.tmp` beside it until it is renamed into place.
"""

from __future__ import annotations

import os
import re

BLOCK_FILE = re.compile(r"[0-9a-f]{16}\.kv")
TEMP_FILE = re.compile(r"[0-9a-f]{16}\.kv\..*\.tmp")
_U64 = 2**64


def file_name(key: int) -> str:
    """The file name of block `key` (a signed 64-bit integer)."""
    return f"{key & (_U64 - 1):016x}.kv"


def list_keys(path: str | os.PathLike, size: int | None = None,
              oldest_first: bool = False) -> list[int]:  # fmt: skip
    """The keys of the block files in directory `path` (of `size` bytes, if given),
    sorted, or with `oldest_first` by modification time (a file's is when it was
    written or last read, file_store.py), then key; no directory: none."""
    found: list[tuple[int, int]] = []  # (mtime ns, key)
    try:
        it = os.scandir(path)
    except FileNotFoundError:
        return []
    with it:
        for entry in it:
            if not BLOCK_FILE.fullmatch(entry.name) or not entry.is_file():
                continue
            st = entry.stat() if size is not None or oldest_first else None
            if size is not None and st.st_size != size:  # type: ignore[union-attr]
                continue
            key = int(entry.name[:16], 16)
            mtime = st.st_mtime_ns if oldest_first else 0  # type: ignore[union-attr]
            found.append((mtime, key - _U64 if key >= _U64 // 2 else key))
    return [key for _, key in sorted(found)]
