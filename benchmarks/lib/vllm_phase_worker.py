"""The vLLM side of `benchmarks/serving/vllm_phases.py`: run by the vLLM virtual environment's
Python (never by the project's), so it imports nothing from this repository.

    VENV/bin/python benchmarks/lib/vllm_phase_worker.py SPEC.json RESULT.json

The engine is built as `vllm_worker.py` builds it for `vs_vllm --workload real` (the same
dtype, lengths, batch budget and KV bytes), except for prefix caching, off here as on the
vlmserve side: each phase reruns the same prompts, which must not hit the cache. Each
phase in SPEC["phases"] reruns every request with the phase's `max_tokens` and records the
seconds; with SPEC["profile"], a last run is profiled (torch.profiler's table of the
engine process, `iterations` steps after `delay` steps) and the table's path recorded.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path = [p for p in sys.path if Path(p or ".").resolve() != _HERE]


def _run(llm, requests: list[dict], max_tokens: int | None) -> float:
    """Seconds to generate every request, `max_tokens` each (None: each request's own)."""
    from vllm import SamplingParams

    lengths = [max_tokens or r["max_tokens"] for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outputs] == lengths
    return seconds


def main(spec_path: str, result_path: str) -> None:
    import vllm
    from vllm import LLM

    spec = json.loads(Path(spec_path).read_text())
    engine = spec["engine"]
    profile = spec.get("profile")
    extra = {}
    if profile:
        extra["profiler_config"] = {
            "profiler": "torch",
            "torch_profiler_dir": profile["dir"],
            "torch_profiler_with_stack": False,
            "torch_profiler_use_gzip": True,
        }
    start = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        dtype=engine["dtype"],
        seed=0,
        max_model_len=engine["max_model_len"],
        max_num_batched_tokens=engine["max_num_batched_tokens"],
        max_num_seqs=engine["max_num_seqs"],
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
        **extra,
    )
    load_s = time.perf_counter() - start
    _run(llm, spec["warmup"], 4)  # one batch, every request max_tokens=4
    phases = []
    for phase in spec["phases"]:
        seconds = _run(llm, spec["requests"], phase["max_tokens"])
        phases.append({**phase, "seconds": seconds})
        print(f"[vllm] {phase['name']}: {seconds:.2f}s", flush=True)
    result = {"system": "vllm", "version": vllm.__version__, "load_s": load_s, "phases": phases}
    if profile:
        llm.start_profile(delay_iterations=profile["delay"], max_iterations=profile["iterations"])
        result["profiled_s"] = _run(llm, spec["requests"], profile["max_tokens"])
        llm.stop_profile()
        time.sleep(5)  # the engine process writes its table after stop
        result["profile_tables"] = [str(p) for p in Path(profile["dir"]).glob("*.txt")]
    cache = llm.llm_engine.vllm_config.cache_config
    result["block_size"] = cache.block_size
    Path(result_path).write_text(json.dumps(result))


if __name__ == "__main__":  # vLLM spawns its engine process: the guard is required
    main(sys.argv[1], sys.argv[2])
