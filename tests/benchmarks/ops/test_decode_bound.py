"""benchmarks/ops/decode_bound.py on a tiny checkpoint: the weight bytes a decode step reads."""

from __future__ import annotations

import pytest

from benchmarks.ops.decode_bound import decode_batch1
from vlmserve.worker.models.random_checkpoint import make_text_checkpoint


@pytest.mark.slow
def test_decode_bound_counts_every_weight_a_step_reads(tmp_path) -> None:
    hidden, layers, heads, kv_heads, vocab, inter = 64, 2, 4, 2, 500, 96
    make_text_checkpoint(
        tmp_path, "llama", hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
        vocab=vocab, intermediate_size=inter,
    )  # fmt: skip
    row = decode_batch1(str(tmp_path), "cpu", "auto", steps=3)
    head_dim = hidden // heads
    per_layer = (
        hidden * head_dim * (heads + 2 * kv_heads)  # q, k, v
        + heads * head_dim * hidden  # o
        + 3 * hidden * inter  # gate, up, down
        + 2 * hidden  # the two norms
    )
    params = layers * per_layer + hidden + hidden * vocab  # final norm, untied LM head
    assert row["weight_mb"] * 1e6 == params * 4
    assert row["ms_per_step"] > 0 and 0 < row["bound_fraction"]
    bound_ms = row["weight_mb"] * 1e6 / (row["bandwidth_gbps"] * 1e9) * 1e3
    assert row["bound_ms"] == pytest.approx(bound_ms)
