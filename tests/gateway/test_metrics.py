"""The Prometheus text the gateway renders: well-formed lines, cumulative buckets."""

from __future__ import annotations

import re

from shunter.bus.messages import SchedulerStats
from shunter.gateway.metrics import Histogram, Metrics

VALUE = r'"(?:[^"\\\n]|\\.)*"'  # escaped quotes, backslashes and newlines only
LINE = re.compile(
    rf"^[a-zA-Z_:][a-zA-Z0-9_:]*\{{[a-z_]+={VALUE}(,[a-z_]+={VALUE})*\}} -?[0-9.e+-]+$"
)


def test_histogram_buckets_are_cumulative():
    h = Histogram("x_seconds", "doc", (0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 2.0, float("nan")):
        h.observe(v)
    lines = h.render('m="a"')
    assert 'x_seconds_bucket{m="a",le="0.1"} 2' in lines  # le is inclusive
    assert 'x_seconds_bucket{m="a",le="1.0"} 3' in lines
    assert 'x_seconds_bucket{m="a",le="+Inf"} 4' in lines
    assert 'x_seconds_count{m="a"} 4' in lines  # NaN is not an observation


def test_rendered_text_is_well_formed():
    m = Metrics('we"ird\nname')
    m.request_started(2)
    m.first_token(0.02)
    m.tokens(3, 0.03)
    m.request_finished("stop", num_prompt_tokens=5, num_completion_tokens=4,
                       num_cached_tokens=2, e2e_s=0.1, decode_s=0.06)  # fmt: skip
    m.request_failed()
    m.stats = SchedulerStats(1, 3, 4, 10, 100, 0.5, 12.5)
    text = m.render()
    assert text.endswith("\n")
    samples = [ln for ln in text.splitlines() if not ln.startswith("#")]
    bad = [ln for ln in samples if not LINE.match(ln)]
    assert not bad, bad
    assert 'model_name="we\\"ird\\nname"' in text
    values = {
        ln.split("{")[0]: float(ln.rsplit(" ", 1)[1]) for ln in samples if "_bucket" not in ln
    }
    assert values["sglang:prompt_tokens_total"] == 5
    assert values["sglang:generation_tokens_total"] == 4
    assert values["sglang:num_running_reqs"] == 3 and values["sglang:num_queue_reqs"] == 4
    assert values["sglang:token_usage"] == 0.1 and values["sglang:cache_hit_rate"] == 0.5
    assert values["sglang:num_in_flight_reqs"] == 0
    assert values["sglang:inter_token_latency_seconds_count"] == 3
    assert values["sglang:time_per_output_token_seconds_sum"] == 0.02  # 0.06 s / 3 tokens
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert f"# TYPE sglang:{name} histogram" in text


def test_cache_families_follow_the_latest_cache_stats():
    """No shunter:* KV rows before the first CacheStats; the device rows without a host
    tier; with one, the host's pages, its hits and the copies both ways."""
    from shunter.bus.messages import CacheStats

    m = Metrics("m")
    assert "shunter:" not in m.render()
    m.cache = CacheStats(num_pages=100, num_free=60, num_in_tree=30, num_queried_tokens=50,
                         num_hit_tokens=20, num_evicted_pages=7)  # fmt: skip
    text = m.render()
    samples = [ln for ln in text.splitlines() if ln.startswith("shunter:")]
    assert all(LINE.match(ln) for ln in samples), samples
    assert 'shunter:kv_pages{model_name="m",tier="device",state="in_use"} 10' in samples
    assert 'shunter:prefix_hit_tokens_total{model_name="m",tier="device"} 20' in samples
    assert 'shunter:kv_pages_evicted_total{model_name="m"} 7' in samples
    assert 'tier="host"' not in text and "kv_pages_copied_total" not in text
    m.cache = CacheStats(num_pages=100, num_free=60, num_in_tree=30, num_queried_tokens=50,
                         num_hit_tokens=20, num_evicted_pages=7, num_host_pages=400,
                         num_host_free=350, num_host_in_tree=40, num_host_writing=10,
                         num_host_hit_tokens=12, num_spilled_pages=50, num_loaded_pages=12,
                         num_copies_failed=1)  # fmt: skip
    samples = [ln for ln in m.render().splitlines() if ln.startswith("shunter:")]
    assert all(LINE.match(ln) for ln in samples), samples
    assert 'shunter:prefix_hit_tokens_total{model_name="m",tier="device"} 8' in samples
    assert 'shunter:prefix_hit_tokens_total{model_name="m",tier="host"} 12' in samples
    assert 'shunter:kv_pages{model_name="m",tier="host",state="writing"} 10' in samples
    assert 'shunter:kv_pages_copied_total{model_name="m",direction="to_device"} 12' in samples


def test_store_families_show_whenever_a_store_is_configured():
    """An empty store (a fresh directory, or one just cleared) is still a store: its
    gauge says 0 rather than vanishing."""
    from shunter.bus.messages import CacheStats

    m = Metrics("m")
    host = dict(num_pages=100, num_free=60, num_in_tree=30, num_queried_tokens=50,
                num_hit_tokens=20, num_evicted_pages=7, num_host_pages=400)  # fmt: skip
    m.cache = CacheStats(**host)
    assert "shunter:store_blocks" not in m.render()
    m.cache = CacheStats(**host, store_block_tokens=64)
    samples = [ln for ln in m.render().splitlines() if ln.startswith("shunter:")]
    assert all(LINE.match(ln) for ln in samples), samples
    assert 'shunter:store_blocks{model_name="m"} 0' in samples
    assert 'shunter:prefix_hit_tokens_total{model_name="m",tier="store"} 0' in samples
    assert 'shunter:store_blocks_evicted_total{model_name="m"} 0' in samples
    m.cache = CacheStats(**host, store_block_tokens=64, num_store_blocks=3, num_stored_blocks=5,
                         num_store_blocks_evicted=2)  # fmt: skip
    assert 'shunter:store_blocks{model_name="m"} 3' in m.render()
    assert 'shunter:store_blocks_evicted_total{model_name="m"} 2' in m.render()
