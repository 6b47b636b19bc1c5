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


def list_keys(path: str | os.PathLike, size: int | None = None) -> list[int]:
    """The keys of the block files in directory `path` (of `size` bytes, if given),
    sorted; no directory: none."""
    keys = []
    try:
        it = os.scandir(path)
    except FileNotFoundError:
        return []
    with it:
        for entry in it:
            if not BLOCK_FILE.fullmatch(entry.name) or not entry.is_file():
                continue
            if size is not None and entry.stat().st_size != size:
                continue
            key = int(entry.name[:16], 16)
            keys.append(key - _U64 if key >= _U64 // 2 else key)
    return sorted(keys)
