"""One line of engine figures that the offline front doors (generate, demo, caption) print
when they finish: the KV pool, speculation, the encoder cache and the preprocessing pool,
read from `Engine.stats()` (the same numbers `serve` exports on /metrics)."""

from __future__ import annotations


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
