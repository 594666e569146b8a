"""The engine's figures: `engine_stats` (what `Engine.stats()` returns and `serve` exports
on /metrics) and the one line the offline front doors (generate, demo, caption) print when
they finish: the KV pool, speculation, the encoder cache and the preprocessing pool."""

from __future__ import annotations

from encoders.cache import EncoderCacheStats
from scheduler.spec_policy import SpecMetrics


def engine_stats(
    scheduler: dict[str, float],
    num_steps: int,
    num_computed_prompt_tokens: int,
    encoder_cache: EncoderCacheStats,
    pool: dict[str, float],
    spec: SpecMetrics | None,
) -> dict[str, float]:
    """Gauges and counters: queue, KV pool and preemptions (`Scheduler.stats()`), steps,
    prompt tokens computed, encoder cache, preprocessing stage seconds (`pool`),
    speculation."""
    stats = {
        **scheduler,
        "num_steps": float(num_steps),
        "computed_prompt_tokens": float(num_computed_prompt_tokens),
        "encoder_cache_hits": float(encoder_cache.hits),
        "encoder_cache_misses": float(encoder_cache.misses),
        "encoder_cache_bytes": float(encoder_cache.num_bytes),
    }
    stats |= {f"preprocess_{k}": float(v) for k, v in pool.items()}
    if spec is not None:
        stats |= {
            "spec_proposed": float(spec.num_proposed_tokens),
            "spec_accepted": float(spec.num_accepted_tokens),
        }
    return stats


def render_engine_stats(stats: dict[str, float]) -> str:
    """`[engine: ...]` from an `Engine.stats()` dict; a figure absent there is left out."""
    parts = [f"{int(stats['num_steps'])} steps", f"KV pool {int(stats['num_blocks'])} blocks"]
    if "spec_proposed" in stats:
        proposed, accepted = int(stats["spec_proposed"]), int(stats["spec_accepted"])
        rate = accepted / proposed if proposed else 0.0
        parts.append(f"speculation {proposed} drafted, {accepted} accepted ({rate:.0%})")
    else:
        parts.append("speculation off")
    hits, misses = int(stats["encoder_cache_hits"]), int(stats["encoder_cache_misses"])
    if hits or misses:
        kib = stats["encoder_cache_bytes"] / 1024
        size = f"{kib / 1024:.1f} MiB" if kib >= 1024 else f"{kib:.0f} KiB"
        parts.append(f"encoder cache {hits} hits, {misses} misses, {size} held")
    if "preprocess_workers" in stats:
        workers, images = int(stats["preprocess_workers"]), int(stats["preprocess_images"])
        parts.append(f"preprocess pool {workers} workers, {images} images")
    return "[engine: " + "; ".join(parts) + "]"
