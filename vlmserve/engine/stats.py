"""The engine's figures: `engine_stats` (what `Engine.stats()` returns and `serve` exports
on /metrics) and the one line the offline front doors (generate, demo, caption) print when
they finish: the KV pool, speculation, the encoder cache and the preprocessing pool."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vlmserve.engine.core import Engine


def engine_stats(engine: Engine) -> dict[str, float]:
    """Gauges and counters: queue, KV pool, prefix and encoder caches, preprocessing stage
    seconds, speculation."""
    scheduler, bm = engine.scheduler, engine.scheduler.block_manager
    used = bm.num_blocks - bm.num_free_blocks
    stats = {
        "waiting": float(len(scheduler.waiting)),
        "running": float(len(scheduler.running)),
        "num_blocks": float(bm.num_blocks),
        "free_blocks": float(bm.num_free_blocks),
        "used_blocks": float(used),
        "peak_used_blocks": float(engine.peak_used_blocks),
        "kv_usage": used / bm.num_blocks,
        "num_steps": float(engine.num_steps),
        "num_preemptions": float(scheduler.num_preemptions),
        "recomputed_tokens_total": float(scheduler.num_recomputed_tokens),
        "computed_prompt_tokens": float(engine.num_computed_prompt_tokens),
    }
    cache = engine.runner.encoder_cache.stats()
    stats |= {
        "encoder_cache_hits": float(cache.hits),
        "encoder_cache_misses": float(cache.misses),
        "encoder_cache_bytes": float(cache.num_bytes),
    }
    pool = engine.processor.pool_metrics()
    stats |= {f"preprocess_{k}": float(v) for k, v in pool.items()}
    spec = engine.spec_metrics
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
