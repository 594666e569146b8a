"""Prometheus exposition (text format 0.0.4) on `prometheus_client`.

Request-side series are counted by the server as requests finish: prometheus_client
counters and histograms (thread-safe; the event loop and the engine thread both update
them). Engine-side series are read from `stats()` at scrape time and typed by
`engine_series(key)`. Each `ServerMetrics` has its own `CollectorRegistry`, never the
global one, so several apps in one process never share a series.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Literal, NamedTuple

import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_PLAIN_0_0_4
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class EngineSeries(NamedTuple):
    name: str
    kind: Literal["counter", "gauge"]
    help: str


# Stats keys with a fixed name; exported on every scrape (0 until the engine reports).
_G: Literal["gauge"] = "gauge"
_C: Literal["counter"] = "counter"
ENGINE_SERIES: dict[str, EngineSeries] = {
    "waiting": EngineSeries(
        "vlmserve_num_requests_waiting", _G, "Requests queued in the scheduler."
    ),
    "running": EngineSeries("vlmserve_num_requests_running", _G, "Requests running in the engine."),
    "pending": EngineSeries(
        "vlmserve_num_requests_pending", _G, "Requests in the server (admission)."
    ),
    "num_blocks": EngineSeries("vlmserve_num_kv_blocks", _G, "KV cache blocks in the pool."),
    "used_blocks": EngineSeries("vlmserve_kv_blocks_used", _G, "KV cache blocks held by requests."),
    "free_blocks": EngineSeries(
        "vlmserve_kv_blocks_free", _G, "KV cache blocks free (cached ones included)."
    ),
    "kv_usage": EngineSeries("vlmserve_kv_cache_usage_ratio", _G, "Fraction of KV blocks in use."),
    "peak_used_blocks": EngineSeries(
        "vlmserve_kv_blocks_used_peak", _G, "Most KV blocks held at once since the start."
    ),
    "encoder_cache_hits": EngineSeries(
        "vlmserve_encoder_cache_hits_total", _C, "Encoder-output cache hits."
    ),
    "encoder_cache_misses": EngineSeries(
        "vlmserve_encoder_cache_misses_total", _C, "Encoder-output cache misses."
    ),
    "encoder_cache_bytes": EngineSeries(
        "vlmserve_encoder_cache_bytes",
        _G,
        "Bytes of pooled image embeddings held by the encoder-output cache.",
    ),
    "num_preemptions": EngineSeries(
        "vlmserve_num_preemptions_total",
        _C,
        "Sequences preempted (recomputed later) for lack of KV blocks.",
    ),
}

# Stats keys that only ever grow but lack a `_total` suffix.
ENGINE_COUNTS = frozenset({
    "num_steps", "computed_prompt_tokens", "spec_proposed", "spec_accepted",
    "preprocess_images", "preprocess_errors", "preprocess_crashes", "preprocess_retries",
    "preprocess_decode_budget_timeouts",
})  # fmt: skip


def engine_series(key: str) -> EngineSeries:
    """How a `stats()` key is exported. In order: the `ENGINE_SERIES` table; `*_s_total`
    (seconds summed) -> counter `vlmserve_*_seconds_total`; `*_total` -> counter
    `vlmserve_*_total`; a key in `ENGINE_COUNTS` -> counter `vlmserve_<key>_total`;
    anything else is a level -> gauge `vlmserve_<key>`."""
    if key in ENGINE_SERIES:
        return ENGINE_SERIES[key]
    base = "vlmserve_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)
    help_text = f"Engine stat {key}."
    if key.endswith("_s_total"):
        return EngineSeries(base.removesuffix("_s_total") + "_seconds_total", "counter", help_text)
    if key.endswith("_total"):
        return EngineSeries(base, "counter", help_text)
    if key in ENGINE_COUNTS:
        return EngineSeries(base + "_total", "counter", help_text)
    return EngineSeries(base, "gauge", help_text)


# Stats keys `<prefix><label value>` exported as one labelled gauge: prefix -> (name, label,
# help). Hybrid KV: the blocks each kind of KV cache group holds.
LABELLED_SERIES = {
    "kv_blocks_in_use_": (
        "vlmserve_kv_blocks_in_use", "group",
        "KV cache blocks held by requests, per kind of KV cache group (full attention, "
        "sliding window); a hybrid-KV model only.",
    ),
    "kv_blocks_peak_": (
        "vlmserve_kv_blocks_in_use_peak", "group",
        "Most KV cache blocks held at once since the start, per kind of KV cache group; "
        "a hybrid-KV model only.",
    ),
}  # fmt: skip


def engine_families(stats: dict[str, float]) -> list[Metric]:
    """One family per stats key (the fixed table's always), typed by `engine_series`; the
    keys of a `LABELLED_SERIES` prefix as one gauge labelled by the rest of the key."""
    families: dict[str, Metric] = {}
    for prefix, (name, label, help_text) in LABELLED_SERIES.items():
        keys = sorted(k for k in stats if k.startswith(prefix))
        if keys:
            family = GaugeMetricFamily(name, help_text, labels=[label])
            for key in keys:
                family.add_metric([key.removeprefix(prefix)], stats[key])
            families[name] = family
    labelled = {k for k in stats if k.startswith(tuple(LABELLED_SERIES))}
    for key in (*ENGINE_SERIES, *sorted(stats.keys() - ENGINE_SERIES.keys() - labelled)):
        series = engine_series(key)
        if series.name in families:  # two keys mapped to one name: the first one wins
            continue
        family = CounterMetricFamily if series.kind == "counter" else GaugeMetricFamily
        families[series.name] = family(series.name, series.help, value=stats.get(key, 0.0))
    return list(families.values())


class Counter:
    """A prometheus_client counter that takes its labels as keywords: `inc(outcome="stop")`."""

    def __init__(self, name: str, help_text: str, labelnames: tuple[str, ...] = ()) -> None:
        self.name = name
        self.metric = prometheus_client.Counter(name, help_text, labelnames, registry=None)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        (self.metric.labels(**labels) if labels else self.metric).inc(amount)

    def value(self, **labels: str) -> float:
        for family in self.metric.collect():
            for sample in family.samples:
                if sample.name == self.name and sample.labels == labels:
                    return sample.value
        return 0.0


class Histogram:
    """A prometheus_client histogram that takes its labels as keywords."""

    def __init__(self, name: str, help_text: str, labelnames: tuple[str, ...] = ()) -> None:
        self.metric = prometheus_client.Histogram(
            name, help_text, labelnames, buckets=LATENCY_BUCKETS, registry=None
        )

    def observe(self, seconds: float, **labels: str) -> None:
        (self.metric.labels(**labels) if labels else self.metric).observe(seconds)


class _Collector:
    """Everything one scrape shows: the request-side metrics, then `stats()`."""

    def __init__(
        self, stats: Callable[[], dict[str, float]], metrics: list[Counter | Histogram]
    ) -> None:
        self.stats, self.metrics = stats, [m.metric for m in metrics]

    def collect(self) -> Iterator[Metric]:
        for metric in self.metrics:
            for family in metric.collect():
                # `*_created` timestamps would add a gauge family per series in 0.0.4.
                family.samples = [s for s in family.samples if not s.name.endswith("_created")]
                yield family
        yield from engine_families(self.stats())


class ServerMetrics:
    """The serving metrics; `stats()` supplies the engine-side series at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, float]]) -> None:
        self.requests = Counter(
            "vlmserve_requests_total", "Finished requests by outcome.", ("outcome",)
        )
        self.ttft = Histogram("vlmserve_time_to_first_token_seconds", "Arrival to first token.")
        self.tpot = Histogram(
            "vlmserve_time_per_output_token_seconds", "Mean gap between output tokens."
        )
        # By class ("text" / "image": whether the request carries images), as the SLO
        # targets and `vlmserve estimate capacity` count them.
        self.class_ttft = Histogram(
            "vlmserve_time_to_first_token_by_class_seconds", "TTFT by request class.", ("class",)
        )
        self.class_tpot = Histogram(
            "vlmserve_time_per_output_token_by_class_seconds",
            "Mean gap between output tokens by request class.",
            ("class",),
        )
        self.e2e = Histogram("vlmserve_e2e_request_latency_seconds", "Arrival to last token.")
        self.stage = Histogram(
            "vlmserve_preprocess_seconds", "Per-stage preprocessing time per request.", ("stage",)
        )
        self.prompt_tokens = Counter("vlmserve_prompt_tokens_total", "Prompt tokens.")
        self.cached_tokens = Counter(
            "vlmserve_prefix_cache_hit_tokens_total", "Prompt tokens served from the prefix cache."
        )
        self.generation_tokens = Counter("vlmserve_generation_tokens_total", "Output tokens.")
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(stats, [
            self.requests, self.ttft, self.tpot, self.class_ttft, self.class_tpot, self.e2e,
            self.stage,
            self.prompt_tokens, self.cached_tokens, self.generation_tokens,
        ]))  # fmt: skip

    def render(self) -> str:
        return generate_latest(self.registry).decode()
