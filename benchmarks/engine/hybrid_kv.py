"""KV blocks one long Gemma-3-shaped sequence holds with the hybrid KV manager against
all-global layers, measured on the engine (scheduler/kv_blocks.py).

A random text-only Gemma 3 checkpoint with the 5:1 layer pattern (12 layers: 2 global,
10 sliding over `--window` positions) serves one request of `--context` tokens (prompt +
`--output` generated) in chunks of `--budget`. After every step the blocks each kind of
KV cache group holds are read from the engine's stats; the table gives the last decode
step's (the steady state) and the peaks (a prefill chunk adds its own blocks to every
sliding group), against what all-global layers would hold in the same blocks (every group
the whole context) and the cost model's `kv_bytes_per_sequence` ratio for the same shape.
Blocks only: the timing of this run is not the point (a short run under load).

    .venv/bin/python -m benchmarks.engine.hybrid_kv            # 8k context, window 1024
    .venv/bin/python -m benchmarks.engine.hybrid_kv --quick    # 2k context, window 256
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from benchmarks.lib.common import table, write_result
from scheduler.config import CacheConfig, SchedulerConfig, seq_peak_blocks
from search.costmodel import cost_model as cm
from search.costmodel.presets import ModelShape
from vlmserve.config import EngineConfig, ModelConfig
from vlmserve.engine.core import Engine
from vlmserve.inputs.processing import Request
from vlmserve.sample.params import SamplingParams
from vlmserve.worker.models.random_checkpoint import make_gemma3_checkpoint

LAYERS, BLOCK = 12, 16


def run(path: Path, context: int, output: int, budget: int) -> dict:
    engine = Engine(
        EngineConfig(
            ModelConfig(str(path), max_model_len=context + 16),
            CacheConfig(block_size=BLOCK, memory_bytes=256 << 20),
            SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=2),
        )
    )
    prompt = [1 + (i * 7) % 250 for i in range(context - output)]
    params = SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)
    engine.add_request(Request(prompt_token_ids=prompt, sampling=params))
    peak = {"full": 0.0, "sliding": 0.0, "total": 0.0}  # each at its own step
    last = dict(peak)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        if engine.has_unfinished():  # what the step that just ran held
            stats = engine.scheduler.stats()
            last = {k: stats[f"kv_blocks_in_use_{k}"] for k in ("full", "sliding")}
            last["total"] = last["full"] + last["sliding"]
            peak = {k: max(peak[k], v) for k, v in last.items()}
    runner = engine.runner
    return {
        "seconds": time.perf_counter() - start,
        "groups": [(g.sliding_window, list(g.layers)) for g in runner.kv_layout.groups],
        "layers_per_block": runner.kv_layout.layers_per_block,
        "block_bytes": runner.block_bytes,
        "pool_blocks": runner.num_blocks,
        "peak": peak,
        "last_step": last,
        "scheduler_stats": engine.scheduler.stats(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--quick", action="store_true", help="2k context, window 256")
    args = parser.parse_args()
    if args.quick:
        args.context, args.window = 2048, 256
    with tempfile.TemporaryDirectory() as tmp:
        path = make_gemma3_checkpoint(
            Path(tmp) / "gemma3", text_only=True, layers=LAYERS, sliding_window=args.window,
            max_position_embeddings=args.context + 64,
        )  # fmt: skip
        result = run(path, args.context, args.output, args.budget)
    groups = result["groups"]
    all_global = len(groups) * -(-args.context // BLOCK)  # every group the whole context
    decode = result["last_step"]["total"]  # the last decode step: the steady state
    bound = seq_peak_blocks([g[0] for g in groups], BLOCK, args.context, 1)
    shape = ModelShape(
        "gemma3-random", num_layers=LAYERS, hidden_size=64, num_heads=4, num_kv_heads=2,
        head_dim=16, intermediate_size=128, vocab_size=256,
        sliding_window=args.window, num_sliding_layers=LAYERS - LAYERS // 6,
    )  # fmt: skip
    model_ratio = cm.kv_bytes_per_sequence(shape, args.context) / cm.kv_bytes_all_global(
        shape, args.context
    )
    peak, last = result["peak"], result["last_step"]
    rows = [
        {"what": "last decode step", "full": last["full"], "sliding": last["sliding"],
         "total": decode},
        {"what": "peak (each kind at its own step)", "full": peak["full"],
         "sliding": peak["sliding"], "total": peak["total"]},
        {"what": "decode bound (seq_peak_blocks)", "total": bound},
        {"what": "all-global layers, same blocks", "total": all_global},
    ]  # fmt: skip
    print(table(rows, ["what", "full", "sliding", "total"]))
    ratio = decode / all_global
    mib = result["block_bytes"] / 2**20
    print(
        f"\n{args.context:,} tokens, window {args.window:,}, blocks of {BLOCK} tokens x "
        f"{result['layers_per_block']} layers ({result['block_bytes']:,} B): decoding, the "
        f"sequence holds {ratio:.1%} of all-global's blocks ({decode * mib:.1f} MiB vs "
        f"{all_global * mib:.1f} MiB; cost model {model_ratio:.1%}); its prefill peak "
        f"(chunks of {args.budget}) {peak['total'] / all_global:.1%}; run "
        f"{result['seconds']:.1f} s"
    )
    path = write_result(
        "hybrid_kv" + ("_quick" if args.quick else ""),
        {
            "config": vars(args) | {"layers": LAYERS, "block_size": BLOCK},
            **result,
            "decode_blocks": decode,
            "all_global_blocks": all_global,
            "decode_over_all_global": ratio,
            "prefill_peak_over_all_global": peak["total"] / all_global,
            "cost_model_ratio": model_ratio,
            "decode_bound_blocks": bound,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
