"""The vLLM side of `benchmarks/serving/vs_vllm.py`: run by the vLLM virtual environment's Python
(never by the project's), so it imports nothing from this repository.

    VENV/bin/python benchmarks/lib/vllm_worker.py SPEC.json RESULT.json

SPEC (written by vs_vllm.py): the checkpoint folder, the engine settings, the warm-up and
measured requests (token ids, or a prompt and a JPEG path). RESULT: load, warm-up and
generation seconds, each request's output token ids and prompt length, and a digest of
each image's decoded pixels (to check that both sides decode the JPEGs alike).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

# Python puts this script's folder first on sys.path, where a module named like a package
# transformers and vLLM probe for (the `kernels` hub package) would be taken for it.
_HERE = Path(__file__).resolve().parent
sys.path = [p for p in sys.path if Path(p or ".").resolve() != _HERE]


def _prompt(request: dict) -> dict:
    if "prompt_token_ids" in request:
        return {"prompt_token_ids": request["prompt_token_ids"]}
    from PIL import Image

    with Image.open(request["image"]) as image:  # exact decode: no draft mode
        pixels = image.convert("RGB")
    return {"prompt": request["prompt"], "multi_modal_data": {"image": pixels}}


def _pixel_digest(prompt: dict) -> str | None:
    image = prompt.get("multi_modal_data", {}).get("image")
    return None if image is None else hashlib.sha256(image.tobytes()).hexdigest()


def _ngram(tokens: int) -> dict:
    """vLLM's n-gram drafts as vlmserve's: up to `tokens` a step, suffixes of 2 to 4 tokens."""
    return {
        "method": "ngram", "num_speculative_tokens": tokens,
        "prompt_lookup_min": 2, "prompt_lookup_max": 4,
    }  # fmt: skip


def _spec_counters(llm) -> dict:
    """vLLM's draft counters (its Prometheus metrics), warm-up included."""
    names = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    found = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    return {n: found.get(f"vllm:spec_decode_{n}") for n in names}


def _generate(llm, requests: list[dict]) -> tuple[float, list, list[dict]]:
    from vllm import SamplingParams

    params = [
        SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True)
        for r in requests
    ]
    start = time.perf_counter()
    prompts = [_prompt(r) for r in requests]  # JPEG decoding is timed, as in vlmserve
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, outputs, prompts


def main(spec_path: str, result_path: str) -> None:
    import vllm
    from vllm import LLM

    spec = json.loads(open(spec_path).read())
    engine = spec["engine"]
    image = spec["workload"] in ("image", "gemma3")
    drafts = engine.get("vllm_speculative_tokens", engine.get("speculative_tokens"))
    start = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        dtype=engine.get("dtype", "float32"),
        seed=0,
        max_model_len=engine["max_model_len"],
        max_num_batched_tokens=engine["max_num_batched_tokens"],
        max_num_seqs=engine["max_num_seqs"],
        skip_tokenizer_init=not image,
        limit_mm_per_prompt=spec.get("limit_mm_per_prompt", {"image": 1, "video": 0})
        if image
        else None,
        # transformers' PIL image processor: the pixels vlmserve reproduces bit for bit (its
        # default torchvision one differs by a grey level or two)
        mm_processor_kwargs={"use_fast": False} if image else None,
        **({"block_size": engine["block_size"]} if engine.get("block_size") else {}),
        # its draft counters need its stats on (one log line every few seconds)
        **({"speculative_config": _ngram(drafts), "disable_log_stats": False} if drafts else {}),
    )  # fmt: skip
    load_s = time.perf_counter() - start
    warmup_s, _, _ = _generate(llm, spec["warmup"])
    seconds, outputs, prompts = _generate(llm, spec["requests"])
    cache = llm.llm_engine.vllm_config.cache_config
    result = {
        "system": "vllm",
        "version": vllm.__version__,
        "load_s": load_s,
        "warmup_s": warmup_s,
        "seconds": seconds,
        "output_token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "num_prompt_tokens": [len(o.prompt_token_ids or []) for o in outputs],
        "pixel_sha256": [_pixel_digest(p) for p in prompts],
        "block_size": cache.block_size,
        "spec_decode": _spec_counters(llm) if drafts else None,
    }
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # vLLM spawns its engine process: the guard is required
    main(sys.argv[1], sys.argv[2])
