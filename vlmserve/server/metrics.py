"""Prometheus text exposition (format 0.0.4) without a client library.

Counters and histograms are updated from the event loop and the engine thread, so every
update takes the metric's lock. Gauges are read at scrape time from a callback.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable

Labels = tuple[tuple[str, str], ...]

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _labels(labels: Labels, extra: tuple[tuple[str, str], ...] = ()) -> str:
    items = labels + extra
    if not items:
        return ""
    escaped = (
        (k, v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')) for k, v in items
    )
    return "{" + ",".join(f'{k}="{v}"' for k, v in escaped) + "}"


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class Counter:
    def __init__(self, name: str, help_text: str) -> None:
        self.name, self.help = name, help_text
        self._values: dict[Labels, float] = {}
        self._lock = threading.Lock()

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        return self._values.get(tuple(sorted(labels.items())), 0.0)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        with self._lock:
            items = sorted(self._values.items())
        if not items:
            items = [((), 0.0)]
        lines += [f"{self.name}{_labels(k)} {_number(v)}" for k, v in items]
        return lines


class Gauge:
    """Read at scrape time: `read()` returns {labels: value}."""

    def __init__(self, name: str, help_text: str, read: Callable[[], dict[Labels, float]]):
        self.name, self.help, self._read = name, help_text, read

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} gauge"]
        lines += [f"{self.name}{_labels(k)} {_number(v)}" for k, v in sorted(self._read().items())]
        return lines


class Histogram:
    def __init__(
        self, name: str, help_text: str, buckets: tuple[float, ...] = LATENCY_BUCKETS
    ) -> None:
        assert list(buckets) == sorted(buckets), "bucket bounds must increase"
        self.name, self.help, self.buckets = name, help_text, buckets
        # Per label set: [count per bucket (non-cumulative; last = +Inf)], sum, count.
        self._series: dict[Labels, tuple[list[int], list[float]]] = {}
        self._lock = threading.Lock()

    def observe(self, value: float, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            counts, total = self._series.setdefault(key, ([0] * (len(self.buckets) + 1), [0.0]))
            counts[bisect.bisect_left(self.buckets, value)] += 1
            total[0] += value

    def count(self, **labels: str) -> int:
        series = self._series.get(tuple(sorted(labels.items())))
        return sum(series[0]) if series else 0

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        with self._lock:
            items = sorted((k, (list(c), t[0])) for k, (c, t) in self._series.items())
        if not items:
            items = [((), ([0] * (len(self.buckets) + 1), 0.0))]
        for key, (counts, total) in items:
            running = 0
            for bound, n in zip((*self.buckets, math.inf), counts, strict=True):
                running += n
                le = (("le", _number(bound)),)
                lines.append(f"{self.name}_bucket{_labels(key, le)} {running}")
            lines.append(f"{self.name}_sum{_labels(key)} {_number(total)}")
            lines.append(f"{self.name}_count{_labels(key)} {running}")
        return lines


class Registry:
    def __init__(self) -> None:
        self._metrics: list[Counter | Gauge | Histogram] = []

    def add(self, metric):
        self._metrics.append(metric)
        return metric

    def render(self) -> str:
        return "\n".join(line for m in self._metrics for line in m.render()) + "\n"


class ServerMetrics:
    """The serving metrics the issue lists; `stats()` supplies the engine-side gauges."""

    def __init__(self, stats: Callable[[], dict[str, float]]) -> None:
        r = self.registry = Registry()
        self.requests = r.add(Counter("vlmserve_requests_total", "Finished requests by outcome."))
        self.ttft = r.add(
            Histogram("vlmserve_time_to_first_token_seconds", "Arrival to first token.")
        )
        self.tpot = r.add(
            Histogram("vlmserve_time_per_output_token_seconds", "Mean gap between output tokens.")
        )
        self.e2e = r.add(
            Histogram("vlmserve_e2e_request_latency_seconds", "Arrival to last token.")
        )
        self.stage = r.add(
            Histogram("vlmserve_preprocess_seconds", "Per-stage preprocessing time per request.")
        )
        self.prompt_tokens = r.add(Counter("vlmserve_prompt_tokens_total", "Prompt tokens."))
        self.cached_tokens = r.add(
            Counter(
                "vlmserve_prefix_cache_hit_tokens_total",
                "Prompt tokens served from the prefix cache.",
            )
        )
        self.generation_tokens = r.add(
            Counter("vlmserve_generation_tokens_total", "Output tokens.")
        )
        self.stats = stats

        def gauge(name: str, key: str, help_text: str) -> None:
            r.add(Gauge(name, help_text, lambda: {(): self.stats().get(key, 0.0)}))

        gauge("vlmserve_num_requests_waiting", "waiting", "Requests queued in the scheduler.")
        gauge("vlmserve_num_requests_running", "running", "Requests running in the engine.")
        gauge("vlmserve_num_requests_pending", "pending", "Requests in the server (admission).")
        gauge("vlmserve_kv_blocks_total", "num_blocks", "KV cache blocks in the pool.")
        gauge("vlmserve_kv_blocks_used", "used_blocks", "KV cache blocks held by requests.")
        gauge("vlmserve_kv_cache_usage_ratio", "kv_usage", "Fraction of KV blocks in use.")
        gauge(
            "vlmserve_encoder_cache_hits_total", "encoder_cache_hits", "Encoder-output cache hits."
        )
        gauge(
            "vlmserve_encoder_cache_misses_total",
            "encoder_cache_misses",
            "Encoder-output cache misses.",
        )
        gauge(
            "vlmserve_encoder_cache_bytes",
            "encoder_cache_bytes",
            "Bytes of pooled image embeddings held by the encoder-output cache.",
        )
        gauge(
            "vlmserve_num_preemptions_total",
            "num_preemptions",
            "Sequences preempted (recomputed later) for lack of KV blocks.",
        )
        for stage in ("queue", "read", "decode", "resize", "handoff"):
            gauge(f"vlmserve_preprocess_{stage}_seconds_total", f"preprocess_{stage}_s_total",
                  f"Seconds the preprocessing pool spent in its {stage} stage.")  # fmt: skip

    def render(self) -> str:
        return self.registry.render()
