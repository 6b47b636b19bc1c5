"""The host-memory KV tier on a real server: a prompt's prefix evicted from a small
device pool comes back from the host pool (prompt_tokens_details.cached_tokens counts
it), the greedy answer is the same as the first time, and the recorded bus shows the
copies: every backup and load answered ok, both censuses whole, and the cache manager's
decisions replay from its recorded inbox. Backups as pages are cached (write_through)
or as they are evicted (write_back). Over ZMQ too (multi-process, heavy)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.request

import openai
import pytest

from shunter.actors.executor.block_files import file_name, list_keys
from shunter.bus.log import LogReader
from shunter.bus.messages import (
    BlocksErased,
    Census,
    CensusBroken,
    DecodeFailed,
    EraseBlocks,
    FetchPages,
    LoadPages,
    PagesFetched,
    PagesLoaded,
    PagesSpilled,
    PagesStored,
    SpillPages,
    StoreCleared,
    StoreListed,
)

TOPICS = ["rivers of Europe", "the history of glass", "how bees dance", "tide pools",
          "the first printing presses", "volcanoes of Iceland"]  # fmt: skip


def _prompt(topic: str) -> str:
    # about 150 tokens, all of them distinct per topic after the first words
    facts = " ".join(f"Fact {i} about {topic} is worth a sentence of its own." for i in range(10))
    return f"Write one line about {topic}. {facts} Now the line:"


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_a_prefix_evicted_from_the_device_comes_back_from_the_host(
    start_server, call, mode, tmp_path, policy
):
    # 512 device slots hold about three prompts; the host pool holds four times that.
    # write_back copies a prompt's pages as they are evicted, write_through as they are cached.
    args = ("--enable-hierarchical-cache", "--hicache-ratio", "4", "--max-total-tokens", "512",
            "--max-running-requests", "2", "--enable-metrics",
            "--hicache-write-policy", policy)  # fmt: skip
    with start_server(tmp_path / "srv", mode, *args) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")

        def complete(topic: str):
            return client.completions.create(model="SmolLM2-135M-Instruct", prompt=_prompt(topic),
                                             max_tokens=8, temperature=0)  # fmt: skip

        first = complete(TOPICS[0])
        for topic in TOPICS[1:]:  # push the first prompt's pages off the device
            complete(topic)
        again = complete(TOPICS[0])
        assert again.choices[0].text == first.choices[0].text
        cached = again.usage.prompt_tokens_details.cached_tokens
        assert cached >= again.usage.prompt_tokens - 16, again.usage
        status, info = call(server, "/get_server_info", method="GET")
        assert status == 200 and info["enable_hierarchical_cache"] is True
        assert info["executor"]["num_host_pages"] == 4 * info["num_kv_pages"]
        # /metrics shows the copies once a Tick has carried the cache manager's figures
        deadline, loaded = time.monotonic() + 10, 0.0
        while time.monotonic() < deadline and loaded < cached - 8:
            text = server.get("/metrics")[1].decode()
            m = re.search(
                r'shunter:kv_pages_copied_total\{[^}]*direction="to_device"\} (\S+)', text
            )
            loaded = float(m.group(1)) if m else 0.0
            time.sleep(0.2)
        assert loaded >= cached - 8, text
        hits = re.search(r'shunter:prefix_hit_tokens_total\{[^}]*tier="host"\} (\S+)', text)
        assert hits and float(hits.group(1)) >= cached - 8, text
        assert re.search(r'shunter:kv_pages\{[^}]*tier="host",state="cached"\} [1-9]', text), text
        info = call(server, "/get_server_info", method="GET")[1]
        assert info["cache"]["num_host_pages"] == 4 * info["num_kv_pages"]
        status, err = call(server, "/hicache/storage-backend/clear")  # no store to clear
        assert status == 400 and "--hicache-storage-backend file" in err["error"]["message"]

    msgs = [m for _, m in LogReader(server.events_dir).messages()]
    spills = [m for m in msgs if isinstance(m, SpillPages)]
    loads = [m for m in msgs if isinstance(m, LoadPages)]
    assert spills and loads
    replies = {m.copy_id: m for m in msgs if isinstance(m, PagesSpilled | PagesLoaded)}
    assert all(replies[m.copy_id].ok for m in spills + loads)
    # (the prompts' shared first words stayed on the device: all the rest was loaded)
    assert sum(len(m.device_pages) for m in loads) >= cached - 8
    census = [m for m in msgs if isinstance(m, Census)]
    assert {c.tier for c in census} == {"device", "host"} and all(c.ok for c in census)
    assert not [m for m in msgs if isinstance(m, CensusBroken | DecodeFailed)]
    # the copies' replies are in the cache manager's recorded inbox: it replays exactly
    r = subprocess.run([sys.executable, "-m", "shunter.ops.busctl", "replay", str(server.events_dir),
                        "--actor", "cache", "--allow-short-recording"],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0 and "identical" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("prefetch", ["wait_complete", "best_effort", "timeout"])
def test_a_later_server_reads_the_prefix_back_from_the_file_store(
    start_server, call, mode, tmp_path, prefetch
):
    """A prompt served once is written to the file store (in whole blocks of 64 tokens)
    as its backup lands; a new server on the same model and directory lists the blocks
    at start and answers the prompt again with them cached: read into host pages, loaded
    to the device, the same greedy answer (best_effort: answered at once, computing the
    prompt while the blocks are read; timeout: waits, the read taking far less than
    its second). Then it clears the store (both paths): the block
    files are gone and the server goes on storing. Both cache managers replay."""
    store = tmp_path / "store"
    args = ("--enable-hierarchical-cache", "--enable-metrics", "--hicache-storage-backend",
            "file", "--hicache-storage-dir", str(store),
            "--hicache-storage-prefetch-policy", prefetch)  # fmt: skip
    answers, servers = [], []
    for run in ("first", "second"):
        with start_server(tmp_path / run, mode, *args) as server:
            client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
            r = client.completions.create(model="SmolLM2-135M-Instruct", prompt=_prompt(TOPICS[2]),
                                          max_tokens=8, temperature=0)  # fmt: skip
            answers.append(r)
            if run == "first":  # the blocks are written once the backup has landed
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline and len(list(store.rglob("*.kv"))) < 2:
                    time.sleep(0.1)
                assert len(list(store.rglob("*.kv"))) >= 2
            else:
                hit = r'shunter:prefix_hit_tokens_total\{[^}]*tier="store"\} [1-9]'
                deadline = time.monotonic() + 10
                while not re.search(hit, text := server.get("/metrics")[1].decode()):
                    assert time.monotonic() < deadline, text
                    time.sleep(0.2)
                _clear_then_store_again(server, client, store)
        servers.append(server)
    first, again = answers
    assert again.choices[0].text == first.choices[0].text
    blocks = again.usage.prompt_tokens // 64
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert blocks >= 2 and (cached == 0 if prefetch == "best_effort" else cached >= 64 * blocks)
    msgs = [m for _, m in LogReader(servers[1].events_dir).messages()]
    (listed,) = [m for m in msgs if isinstance(m, StoreListed)]
    fetches = [m for m in msgs if isinstance(m, FetchPages)]
    assert len(listed.keys) >= 2 and fetches and set(fetches[0].keys) <= set(listed.keys)
    assert all(m.ok for m in msgs if isinstance(m, PagesFetched))
    assert all(c.ok for c in msgs if isinstance(c, Census))
    assert [m.ok for m in msgs if isinstance(m, StoreCleared)] == [True, True]
    assert not [m for m in msgs if isinstance(m, DecodeFailed)]
    for s in servers:
        r = subprocess.run([sys.executable, "-m", "shunter.ops.busctl", "replay",
                            str(s.events_dir), "--actor", "cache", "--allow-short-recording"],
                           capture_output=True, text=True, timeout=300)  # fmt: skip
        assert r.returncode == 0 and "identical" in r.stdout, r.stdout + r.stderr


def _clear_then_store_again(server, client, store) -> None:
    """POST /hicache/storage-backend/clear, then SGLang's older GET path: every block
    file goes and /metrics counts none; a new prompt's blocks are written as before."""
    req = urllib.request.Request(server.base_url + "/hicache/storage-backend/clear", data=b"",
                                 method="POST")  # fmt: skip
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200 and r.read() == b"Hierarchical cache storage backend cleared.\n"
    assert not list(store.rglob("*.kv"))
    status, body = server.get("/clear_hicache_storage_backend")
    assert status == 200 and body.startswith(b"Deprecated endpoint.")
    deadline = time.monotonic() + 10
    while not re.search(
        r"shunter:store_blocks\{[^}]*\} 0", text := server.get("/metrics")[1].decode()
    ):
        assert time.monotonic() < deadline, text
        time.sleep(0.2)
    client.completions.create(model="SmolLM2-135M-Instruct", prompt=_prompt(TOPICS[4]),
                              max_tokens=2, temperature=0)  # fmt: skip
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and len(list(store.rglob("*.kv"))) < 2:
        time.sleep(0.1)
    assert len(list(store.rglob("*.kv"))) >= 2


def _metric(server, name: str) -> float:
    m = re.search(rf"{name}\{{[^}}]*\}} (\S+)", server.get("/metrics")[1].decode())
    return float(m.group(1)) if m else -1.0


def _wait_for(what, deadline_s: float = 20.0) -> None:
    deadline = time.monotonic() + deadline_s
    while not what():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_a_capped_store_is_trimmed_at_start_and_stays_under_its_cap(start_server, mode, tmp_path):
    """Four prompts fill a store with no cap; a server capped at three and a half block
    files on the same directory deletes the oldest at start, down to three, and stays
    there as it writes more (least recently used out first); /metrics counts the
    evictions and its cache manager replays."""
    store = tmp_path / "store"
    args = ("--enable-hierarchical-cache", "--enable-metrics", "--hicache-storage-backend",
            "file", "--hicache-storage-dir", str(store))  # fmt: skip

    def files() -> list:
        return sorted(store.rglob("*.kv"))

    def complete(server, topic: str) -> None:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
        client.completions.create(model="SmolLM2-135M-Instruct", prompt=_prompt(topic),
                                  max_tokens=8, temperature=0)  # fmt: skip

    with start_server(tmp_path / "first", mode, *args) as server:
        for topic in TOPICS[:4]:
            complete(server, topic)
        _wait_for(lambda: _metric(server, "shunter:store_blocks") >= 8)
    (path,) = {f.parent for f in files()}
    before = list_keys(path, oldest_first=True)
    size = files()[0].stat().st_size
    assert len(before) >= 8
    cap = 3.5 * size
    with start_server(tmp_path / "second", mode, *args,
                      "--hicache-storage-max-size", f"{cap / 1e9:.9f}") as server:  # fmt: skip
        _wait_for(lambda: _metric(server, "shunter:store_blocks_evicted_total") >= len(before) - 3)
        _wait_for(lambda: len(files()) == 3)  # the trim's erase ran
        assert [f.name for f in files()] == sorted(file_name(k) for k in before[-3:])
        for topic in TOPICS[4:]:
            complete(server, topic)
            assert len(files()) <= 3
        stored = r'shunter:store_blocks_copied_total\{[^}]*direction="to_store"\} [1-9]'
        _wait_for(lambda: re.search(stored, server.get("/metrics")[1].decode()))
        # a write in flight has evicted its room but counts its blocks only once it lands
        _wait_for(lambda: _metric(server, "shunter:store_blocks") == 3)
        assert _metric(server, "shunter:store_blocks_evicted_total") > len(before) - 3
        assert len(files()) == 3 and sum(f.stat().st_size for f in files()) <= cap
    msgs = [m for _, m in LogReader(server.events_dir).messages()]
    erases = [m for m in msgs if isinstance(m, EraseBlocks)]
    assert erases[0].keys == before[:-3] and not erases[0].everything
    assert all(m.ok for m in msgs if isinstance(m, BlocksErased | PagesStored))
    r = subprocess.run([sys.executable, "-m", "shunter.ops.busctl", "replay",
                        str(server.events_dir), "--actor", "cache", "--allow-short-recording"],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0 and "identical" in r.stdout, r.stdout + r.stderr
