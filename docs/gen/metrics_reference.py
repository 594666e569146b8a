"""The `/metrics` reference: every series `vlmserve serve` exports, its type and labels.

Request-side series are read off a `ServerMetrics` (`vlmserve/server/metrics.py`). The
engine-side ones are what `engine_families` makes of an engine's `stats()` dict, built
here from the same pieces the engine builds it from: a real `Scheduler`'s `stats()` (one
plain, one hybrid-KV), `engine_stats`, a preprocessing pool's `metrics()` and
speculation's counters.
"""

from __future__ import annotations

from docs.gen.markdown import code, header, table

PAGE = "reference/metrics.md"

# What turns a group of engine stats on.
ALWAYS = "always"
HYBRID = "a hybrid-KV model (Gemma 3)"
POOL = "the preprocessing pool (`--preprocess-workers` not 0)"
SPEC = "speculation on (`--speculative-tokens` > 0)"


def _request_rows() -> list[tuple]:
    from vlmserve.server.metrics import LATENCY_BUCKETS, Counter, Histogram, ServerMetrics

    metrics = ServerMetrics(dict)
    rows = []
    for value in vars(metrics).values():
        if not isinstance(value, (Counter, Histogram)):
            continue
        metric = value.metric
        kind = metric._type
        name = metric._name + ("_total" if kind == "counter" else "")
        labels = ", ".join(code(label) for label in metric._labelnames) or "none"
        doc = metric._documentation
        if kind == "histogram":
            doc += f" Buckets (s): {', '.join(str(b) for b in LATENCY_BUCKETS)}."
        rows.append((code(name), kind, labels, doc))
    return rows


def engine_stats_by_condition() -> dict[str, dict[str, float]]:
    """An engine's stats keys, grouped by what makes them appear."""
    from encoders.cache import EncoderCacheStats
    from encoders.pixel_budget import PixelBudget
    from encoders.preprocess import PreprocessPool
    from scheduler.config import CacheConfig, SchedulerConfig
    from scheduler.planner import Scheduler
    from scheduler.spec_policy import SpecMetrics
    from vlmserve.engine.stats import engine_stats

    def stats(windows: tuple, pool: dict, spec: SpecMetrics | None) -> dict[str, float]:
        scheduler = Scheduler(SchedulerConfig(), CacheConfig(), 64, kv_windows=windows)
        cache = EncoderCacheStats(0, 0, 0, 0, 0, 0)
        out = engine_stats(scheduler.stats(), 0, 0, cache, pool, spec)
        # Added by Engine.stats (the KV high-water mark) and, under `serve`, by
        # EngineLoop.stats (requests in the server, not yet in the engine).
        return out | {"peak_used_blocks": 0.0, "pending": 0.0}

    pool = PreprocessPool(0, budget=PixelBudget(1))
    try:
        pool_keys = pool.metrics()
    finally:
        pool.close()
    base = stats((None,), {}, None)
    return {
        ALWAYS: base,
        HYBRID: {k: v for k, v in stats((None, 256), {}, None).items() if k not in base},
        POOL: {k: v for k, v in stats((None,), pool_keys, None).items() if k not in base},
        SPEC: {k: v for k, v in stats((None,), {}, SpecMetrics(0, 0, 0)).items() if k not in base},
    }


def _engine_rows() -> list[tuple]:
    from vlmserve.server.metrics import engine_families

    rows, seen = [], set()
    for condition, stats in engine_stats_by_condition().items():
        families = engine_families(stats) if condition == ALWAYS else _only(stats)
        for family in families:
            if family.name in seen:
                continue
            seen.add(family.name)
            labels = sorted({k for s in family.samples for k in s.labels})
            name = family.name + ("_total" if family.type == "counter" else "")
            shown = ", ".join(code(label) for label in labels) or "none"
            rows.append((code(name), family.type, shown, family.documentation, condition))
    return rows


def _only(stats: dict[str, float]) -> list:
    """The families `stats` alone makes, less the fixed table's (exported always)."""
    from vlmserve.server.metrics import ENGINE_SERIES, engine_families

    fixed = {series.name for series in ENGINE_SERIES.values()}
    return [f for f in engine_families(stats) if f.name not in fixed]


def render() -> str:
    return "\n".join([
        header("`/metrics` series", "`vlmserve/server/metrics.py` and the engine's `stats()`"),
        "`vlmserve serve` exports Prometheus text format 0.0.4 on `GET /metrics`. Every "
        "series is named `vlmserve_*`. Engine-side values are read from the engine at scrape "
        "time; the request-side ones are counted as requests finish.\n",
        "## Request-side series\n",
        table(("series", "type", "labels", "help"), _request_rows()),
        "`outcome` is a finish reason (`stop`, `length`, `tool_calls`, `abort`, ...) or "
        "`http_<status>` for a refused or failed request; `class` is `text` or `image` "
        "(whether the request carries images); `stage` is a preprocessing stage.\n",
        "## Engine-side series\n",
        table(("series", "type", "labels", "help", "exported with"), _engine_rows()),
    ])  # fmt: skip
