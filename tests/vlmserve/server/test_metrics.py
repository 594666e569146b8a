"""/metrics on prometheus_client: the exposition parsed back with its own parser. Types
(every `*_total` a counter, latencies histograms), values after real increments, the
engine-side typing rule, and that two apps in one process share nothing."""

from __future__ import annotations

import io
import math

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.helpers import chat, greedy, make_engine
from vlmserve.engine.core import Engine
from vlmserve.server.metrics import (
    ENGINE_SERIES,
    LATENCY_BUCKETS,
    EngineSeries,
    ServerMetrics,
    engine_series,
)
from vlmserve.server.metrics import Counter as KeywordCounter

# Every series the hand-written exposition had, with the type it has now. Same names and
# labels, except `vlmserve_kv_blocks_total` (a pool size, not a counter) is now
# `vlmserve_num_kv_blocks`.
SERIES_TYPES = {
    "vlmserve_requests_total": "counter",
    "vlmserve_prompt_tokens_total": "counter",
    "vlmserve_prefix_cache_hit_tokens_total": "counter",
    "vlmserve_generation_tokens_total": "counter",
    "vlmserve_time_to_first_token_seconds": "histogram",
    "vlmserve_time_per_output_token_seconds": "histogram",
    "vlmserve_e2e_request_latency_seconds": "histogram",
    "vlmserve_preprocess_seconds": "histogram",
    "vlmserve_num_requests_waiting": "gauge",
    "vlmserve_num_requests_running": "gauge",
    "vlmserve_num_requests_pending": "gauge",
    "vlmserve_num_kv_blocks": "gauge",
    "vlmserve_kv_blocks_used": "gauge",
    "vlmserve_kv_cache_usage_ratio": "gauge",
    "vlmserve_encoder_cache_bytes": "gauge",
    "vlmserve_encoder_cache_hits_total": "counter",
    "vlmserve_encoder_cache_misses_total": "counter",
    "vlmserve_num_preemptions_total": "counter",
    **{f"vlmserve_preprocess_{stage}_seconds_total": "counter"
       for stage in ("queue", "read", "decode", "resize", "handoff")},
}  # fmt: skip


def scrape(metrics: ServerMetrics) -> dict[str, tuple[str, list[Sample]]]:
    """Series name -> (type, samples). A counter's series name is its `_total` sample's."""
    out = {}
    for family in text_string_to_metric_families(metrics.render()):
        name = family.name + "_total" if family.type == "counter" else family.name
        assert name not in out, f"{name} exposed twice"
        out[name] = (family.type, family.samples)
    return out


def value(series: dict, name: str, **labels: str) -> float:
    """The one sample `name{labels}`; a histogram's `_bucket/_count/_sum` included."""
    family = name if name in series else name.rsplit("_", 1)[0]
    [match] = [s.value for s in series[family][1] if s.name == name and s.labels == labels]
    return match


def check_types(series: dict) -> None:
    for name, (kind, samples) in series.items():
        for sample in samples:
            if sample.name.endswith("_total"):
                assert kind == "counter", f"{sample.name} is a {kind}"
            assert not sample.name.endswith("_created"), sample.name
        if kind == "histogram":
            check_histogram(name, samples)


def check_histogram(name: str, samples: list[Sample]) -> None:
    label_sets = {tuple(sorted((k, v) for k, v in s.labels.items() if k != "le")) for s in samples}
    for labels in label_sets:
        mine = [s for s in samples if tuple(sorted((k, v) for k, v in s.labels.items()
                                                   if k != "le")) == labels]  # fmt: skip
        buckets = [s for s in mine if s.name == name + "_bucket"]
        bounds = [float(s.labels["le"]) for s in buckets]
        assert bounds == [*LATENCY_BUCKETS, math.inf], (name, labels)
        counts = [s.value for s in buckets]
        assert counts == sorted(counts), f"{name}{labels} buckets not cumulative: {counts}"
        [count] = [s.value for s in mine if s.name == name + "_count"]
        assert counts[-1] == count


@pytest.fixture(scope="module")
def engine(llava_ov_path, random_image) -> Engine:
    """A real engine after one image request: the preprocessing pool's keys are in stats."""
    engine = make_engine(llava_ov_path, num_blocks=64, budget=256, max_num_seqs=4)
    png = io.BytesIO()
    random_image(1, 60, 40).save(png, "PNG")  # bytes: decoded in the preprocessing pool
    [out] = engine.generate([chat([png.getvalue()], "hi", greedy(2))])
    assert out.error is None, out.error
    return engine


def test_engine_stats_are_exposed_with_their_types(engine):
    metrics = ServerMetrics(engine.stats)
    metrics.requests.inc(outcome="length")
    metrics.stage.observe(0.02, stage="fetch")
    series = scrape(metrics)
    check_types(series)
    assert {name: series[name][0] for name in SERIES_TYPES} == SERIES_TYPES
    assert value(series, "vlmserve_num_kv_blocks") == 64
    assert value(series, "vlmserve_encoder_cache_misses_total") == 1
    assert value(series, "vlmserve_preprocess_decode_seconds_total") > 0
    # Every key the engine reports is exposed under the name the rule gives it, and was
    # typed on purpose: a new count must join ENGINE_COUNTS, a new level this list.
    levels = {"preprocess_pending", "preprocess_workers", "preprocess_decode_pixels_in_use"}
    for key in engine.stats():
        assert engine_series(key).name in series, key
        kind = engine_series(key).kind
        assert kind == "counter" or key in ENGINE_SERIES or key in levels, f"{key}: {kind}?"


def test_values_after_increments():
    metrics = ServerMetrics(lambda: {})
    metrics.requests.inc(outcome="stop")
    metrics.requests.inc(2, outcome="stop")
    metrics.requests.inc(outcome='a"b')
    metrics.prompt_tokens.inc(40)
    metrics.generation_tokens.inc(7)
    for seconds in (0.004, 0.3, 0.3, 100.0):
        metrics.ttft.observe(seconds)
    metrics.stage.observe(0.2, stage="process")
    series = scrape(metrics)
    check_types(series)
    assert value(series, "vlmserve_requests_total", outcome="stop") == 3
    assert value(series, "vlmserve_requests_total", outcome='a"b') == 1
    assert metrics.requests.value(outcome="stop") == 3
    assert metrics.requests.value(outcome="never") == 0
    assert value(series, "vlmserve_prompt_tokens_total") == 40
    assert value(series, "vlmserve_generation_tokens_total") == 7
    assert value(series, "vlmserve_prefix_cache_hit_tokens_total") == 0
    ttft = "vlmserve_time_to_first_token_seconds"
    assert value(series, ttft + "_bucket", le="0.005") == 1
    assert value(series, ttft + "_bucket", le="0.25") == 1
    assert value(series, ttft + "_bucket", le="0.5") == 3
    assert value(series, ttft + "_bucket", le="60.0") == 3
    assert value(series, ttft + "_bucket", le="+Inf") == 4
    assert value(series, ttft + "_count") == 4
    assert value(series, ttft + "_sum") == pytest.approx(100.604)
    stage = "vlmserve_preprocess_seconds"
    assert value(series, stage + "_count", stage="process") == 1
    assert value(series, stage + "_bucket", stage="process", le="0.1") == 0
    assert value(series, stage + "_bucket", stage="process", le="0.25") == 1


def test_engine_keys_are_typed_by_rule():
    assert engine_series("num_preemptions") == ENGINE_SERIES["num_preemptions"]
    assert engine_series("preprocess_read_s_total") == EngineSeries(
        "vlmserve_preprocess_read_seconds_total", "counter", "Engine stat preprocess_read_s_total."
    )
    assert engine_series("preprocess_decode_cpu_s_total").name == (
        "vlmserve_preprocess_decode_cpu_seconds_total"
    )
    assert engine_series("widgets_total")[:2] == ("vlmserve_widgets_total", "counter")
    assert engine_series("spec_accepted")[:2] == ("vlmserve_spec_accepted_total", "counter")
    assert engine_series("preprocess_crashes")[:2] == (
        "vlmserve_preprocess_crashes_total", "counter",
    )  # fmt: skip
    assert engine_series("preprocess_pending")[:2] == ("vlmserve_preprocess_pending", "gauge")
    assert engine_series("odd key")[:2] == ("vlmserve_odd_key", "gauge")


def test_stats_are_read_at_scrape_time_and_whatever_arrives_is_exported():
    stats = {"num_preemptions": 2.0, "preprocess_read_s_total": 0.5}
    metrics = ServerMetrics(lambda: stats)
    series = scrape(metrics)
    assert value(series, "vlmserve_num_preemptions_total") == 2
    assert value(series, "vlmserve_preprocess_read_seconds_total") == 0.5
    assert value(series, "vlmserve_num_requests_waiting") == 0  # table keys: always there
    del stats["preprocess_read_s_total"]  # a key that stops arriving is no longer exported
    stats |= {"num_preemptions": 5.0, "preprocess_images": 3.0, "waiting": 4.0}
    series = scrape(metrics)
    check_types(series)
    assert "vlmserve_preprocess_read_seconds_total" not in series
    assert value(series, "vlmserve_num_preemptions_total") == 5
    assert value(series, "vlmserve_preprocess_images_total") == 3
    assert value(series, "vlmserve_num_requests_waiting") == 4


def test_hybrid_kv_blocks_are_one_gauge_labelled_by_group():
    stats = {"kv_blocks_in_use_full": 40.0, "kv_blocks_in_use_sliding": 85.0,
             "kv_blocks_peak_full": 50.0, "kv_blocks_peak_sliding": 90.0}  # fmt: skip
    series = scrape(ServerMetrics(lambda: stats))
    check_types(series)
    assert value(series, "vlmserve_kv_blocks_in_use", group="full") == 40
    assert value(series, "vlmserve_kv_blocks_in_use", group="sliding") == 85
    assert value(series, "vlmserve_kv_blocks_in_use_peak", group="sliding") == 90
    assert "vlmserve_kv_blocks_in_use_full" not in series  # not also unlabelled
    assert "vlmserve_kv_blocks_in_use" not in scrape(ServerMetrics(dict))  # one group: none


def test_two_instances_share_no_state():
    first, second = ServerMetrics(lambda: {"waiting": 1.0}), ServerMetrics(lambda: {})
    first.requests.inc(outcome="stop")
    first.ttft.observe(0.1)
    first.prompt_tokens.inc(3)
    a, b = scrape(first), scrape(second)
    assert value(a, "vlmserve_requests_total", outcome="stop") == 1
    assert b["vlmserve_requests_total"][1] == []  # no outcome seen yet
    assert value(a, "vlmserve_prompt_tokens_total") == 3
    assert value(b, "vlmserve_prompt_tokens_total") == 0
    assert value(b, "vlmserve_time_to_first_token_seconds_count") == 0
    assert value(a, "vlmserve_num_requests_waiting") == 1
    assert value(b, "vlmserve_num_requests_waiting") == 0
    assert first.registry is not second.registry


def test_keyword_counter_takes_labels_as_keywords():
    counter = KeywordCounter("c_total", "help", ("outcome",))
    counter.inc(outcome="x")
    assert counter.value(outcome="x") == 1
    with pytest.raises(ValueError):
        counter.inc()  # a labelled counter needs its labels
