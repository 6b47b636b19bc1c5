"""SchedulerConfig validation and the mapping from server arguments."""

from __future__ import annotations

import argparse

import pytest

from shunter.actors.scheduler.config import SchedulerConfig, from_server_args
from shunter.ops.server_args import ServerArgs
from shunter.ops.server_cli import parse_server_args


def _tiny_parser() -> argparse.ArgumentParser:
    """The two SGLang spellings of the prefill budget, declared as aliases of one field."""
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--max-prefill-tokens", "--max-prefill-num-token", type=int,
                   dest="max_prefill_tokens", default=16384)  # fmt: skip
    p.add_argument("--page-size", type=int, default=1)
    return p


@pytest.mark.parametrize("flag", ["--max-prefill-tokens", "--max-prefill-num-token"])
def test_both_prefill_budget_spellings_reach_the_same_field(flag):
    ns = _tiny_parser().parse_args([flag, "4096"])
    cfg = from_server_args(ns, num_total_pages=1000, max_context_len=2048)
    assert cfg.max_prefill_tokens == 4096


@pytest.mark.parametrize("flag", ["--max-prefill-tokens", "--max-prefill-num-token"])
def test_serve_arguments_map_onto_the_scheduler_config(flag):
    args = parse_server_args([flag, "3000", "--schedule-policy", "lpm", "--page-size", "16",
                              "--chunked-prefill-size", "512", "--max-running-requests", "64",
                              "--context-length", "1024", "--random-seed", "7"])  # fmt: skip
    cfg = from_server_args(args, num_total_pages=500, max_context_len=2048, eos_token_ids=(2,))
    assert (cfg.max_prefill_tokens, cfg.schedule_policy, cfg.page_size) == (3000, "lpm", 16)
    assert (cfg.chunked_prefill_size, cfg.max_running_requests) == (512, 64)
    assert (cfg.max_context_len, cfg.seed, cfg.eos_token_ids) == (1024, 7, (2,))
    assert cfg.num_total_pages == 500 and cfg.refresh_stale_matches and cfg.in_batch_prefix_sharing


def test_schedule_conservativeness_scales_the_new_token_ratios():
    base = from_server_args(ServerArgs(), num_total_pages=100, max_context_len=4096)
    more = from_server_args(ServerArgs(schedule_conservativeness=1.2), num_total_pages=100,
                            max_context_len=4096)  # fmt: skip
    assert more.init_new_token_ratio == pytest.approx(base.init_new_token_ratio * 1.2)
    assert more.min_new_token_ratio == pytest.approx(base.min_new_token_ratio * 1.2)
    most = from_server_args(ServerArgs(schedule_conservativeness=5), num_total_pages=100,
                            max_context_len=4096)  # fmt: skip
    assert most.init_new_token_ratio == 1.0 and most.min_new_token_ratio <= 1.0


def test_engine_chosen_defaults():
    cfg = from_server_args(ServerArgs(page_size=16), num_total_pages=100, max_context_len=4096)
    assert cfg.chunked_prefill_size % 16 == 0 and cfg.chunked_prefill_size == 8192
    assert cfg.max_running_requests == 256 and cfg.max_context_len == 4096
    small = from_server_args(ServerArgs(), num_total_pages=100, max_context_len=4096)
    assert small.max_running_requests == 50  # at most half the pool's tokens
    off = from_server_args(ServerArgs(chunked_prefill_size=-1, disable_radix_cache=True),
                           num_total_pages=100, max_context_len=4096)  # fmt: skip
    assert off.chunk_tokens is None and not off.refresh_stale_matches
    assert not off.in_batch_prefix_sharing
    assert small.max_batches_in_flight == 2  # overlap, as SGLang, unless disabled
    serial = from_server_args(ServerArgs(disable_overlap_schedule=True), num_total_pages=100,
                              max_context_len=4096)  # fmt: skip
    assert serial.max_batches_in_flight == 1


def test_context_length_may_only_shorten_the_models():
    with pytest.raises(ValueError, match="--context-length 9000: longer than"):
        from_server_args(ServerArgs(context_length=9000), num_total_pages=10, max_context_len=4096)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_running_requests": 0}, "max_running_requests: must be >= 1"),
        ({"chunked_prefill_size": 0}, "chunked_prefill_size: must be >= 1, or -1"),
        ({"chunked_prefill_size": 100, "page_size": 16}, "multiple of page_size"),
        ({"schedule_policy": "sjf"}, "'sjf' is not one of"),
        ({"init_new_token_ratio": 0.05}, "new token ratios"),
        ({"priority_aging_per_s": -1.0}, "priority_aging_per_s"),
        ({"lease_max_surplus_pages": -1}, "lease_max_surplus_pages: must be >= 0"),
        ({"max_batches_in_flight": 3}, "max_batches_in_flight: must be 1 or 2"),
    ],
)
def test_bad_config_is_a_clear_error(fields, message):
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**fields)


def test_config_round_trips_through_json():
    cfg = SchedulerConfig(schedule_policy="priority", eos_token_ids=(2, 3), page_size=4,
                          chunked_prefill_size=64)  # fmt: skip
    assert SchedulerConfig.from_json(cfg.to_json()) == cfg
