"""A GGUF file's blocks where the loader puts them against where they were before, in one
engine: the real Q4_K_M checkpoint decoding one sequence (batch 1, no drafts), its blocks

- `area` (the loader's layout, models/gguf_weights.py): one mapping for the whole file,
  advised onto transparent huge pages, each layer's fused parts views of it;
- `separate`: each weight in a tensor of its own from malloc (4 KiB pages unless the
  system backs every allocation with huge pages), as before.

Both copies are in memory at once; the engine switches between them between rounds of
--steps decode steps (rounds interleaved, medians of every step). Every weight is read
from memory in either (the 262k-row head alone is 178 MB). Ratio = separate / area ms.

    .venv/bin/python -m benchmarks.engine.weight_layout   # -> results/weight_layout.json
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch

from benchmarks.lib.common import table, write_result
from benchmarks.lib.real_model import fetch_gguf
from kernels.malloc_tuning import thp_mode
from kernels.quant_linear import QuantLinear


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=30, help="decode steps a round")
    p.add_argument("--name", default="weight_layout", help="the result file's name")
    args = p.parse_args()
    from scheduler.config import CacheConfig, SchedulerConfig, SpeculativeConfig
    from vlmserve.config import EngineConfig, ModelConfig
    from vlmserve.engine.core import Engine
    from vlmserve.inputs.processing import Request
    from vlmserve.sample.params import SamplingParams

    model = ModelConfig(str(fetch_gguf()), quantization="gguf", max_model_len=4096)
    engine = Engine(EngineConfig(
        model, CacheConfig(block_size=16, memory_bytes=1 << 30),
        SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=8),
        speculative=SpeculativeConfig(num_speculative_tokens=0),
    ))  # fmt: skip
    layers = [m for m in engine.runner.model.decoder.modules() if isinstance(m, QuantLinear)]
    weights = list({id(w): w for m in layers for w in m.parts}.values())
    layouts = {"area": [w.blocks for w in weights], "separate": [w.blocks.clone() for w in weights]}

    def use(name: str) -> None:
        for weight, blocks in zip(weights, layouts[name], strict=True):
            weight.blocks = blocks  # the layers' kernels read each call's from its weight

    rng = random.Random(0)
    prompt = [rng.randrange(1000, 20000) for _ in range(300)]
    total_steps = args.rounds * 2 * (args.steps + 3) + 10
    sampling = SamplingParams(max_tokens=total_steps, temperature=0.0, ignore_eos=True)
    engine.add_request(Request(prompt_token_ids=prompt, sampling=sampling))
    for _ in range(5):  # the prefill, the first decode steps
        engine.step()
    times: dict[str, list[float]] = {name: [] for name in layouts}
    print(f"load average {os.getloadavg()}, {torch.get_num_threads()} threads, THP {thp_mode()}")
    for _ in range(args.rounds):
        for name in layouts:
            use(name)
            for _ in range(3):
                engine.step()
            for _ in range(args.steps):
                start = time.perf_counter()
                engine.step()
                times[name].append(time.perf_counter() - start)
    total = sum(b.nbytes for b in layouts["area"])
    rows = [{
        "layout": name, "step_ms": statistics.median(times[name]) * 1e3,
        "step_ms_p90": statistics.quantiles(times[name], n=10)[-1] * 1e3,
    } for name in layouts]  # fmt: skip
    ratio = rows[1]["step_ms"] / rows[0]["step_ms"]
    print(table(rows, ["layout", "step_ms", "step_ms_p90"]))
    print(f"separate / area: {ratio:.3f}")
    write_result(args.name, {
        "model": "gemma-3-270m Q4_K_M (its blocks)", "batch": 1, "thp": thp_mode(),
        "weight_bytes": total, "rounds": args.rounds, "steps_per_round": args.steps,
        "results": rows, "ratio_separate_over_area": ratio,
    })  # fmt: skip


if __name__ == "__main__":
    main()
