"""The two workloads of `benchmarks/serving/vs_vllm.py`, written to disk for both contenders: a
checkpoint folder and a spec (engine settings, warm-up and measured requests).

- text: the offline-throughput workload (`benchmarks/engine/offline_throughput.py`), prompts
  given as token ids.
- image: a LLaVA-OneVision-shaped random checkpoint (SigLIP tower at the family's tile
  384 / patch 14, anyres grids up to 6 x 6 with `anyres_max_9`, the text workload's decoder
  sizes in the family's Qwen2 class), one distinct 1024 x 768 JPEG per request and a short
  question.
- gemma3: a Gemma-3-shaped random checkpoint (the text workload's decoder sizes with Gemma 3's
  layers: 5 sliding-window layers to 1 global, QK-norm, sandwich norms; its SigLIP tower at
  896 px / patch 14 pooled to 256 tokens), the image workload's JPEGs and questions.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from benchmarks.engine.offline_throughput import parse_args as offline_args
from benchmarks.engine.offline_throughput import workload as offline_workload
from encoders.tiling.anyres import anyres_layout
from scheduler.config import DEFAULT_DRAFTS, SpeculativeConfig
from vlmserve.worker.models.random_checkpoint import (
    WORDS,
    make_gemma3_checkpoint,
    make_text_checkpoint,
    make_vlm_checkpoint,
)

IMAGE_SIZE = (1024, 768)  # (width, height)
TILE, PATCH, MAX_GRID, ASPECT_RATIO = 384, 14, 6, "anyres_max_9"
# The SigLIP tower's sizes (SigLIP-base widths; the layer count is a CLI flag).
VISION_HIDDEN, VISION_HEADS, VISION_INTERMEDIATE = 768, 12, 3072
BLOCK_SIZE = 16  # vlmserve's KV block (offline_throughput.make_engine)
PROMPT = "<|im_start|> user <image> {question} <|im_end|> <|im_start|> assistant"
# Gemma 3: its tower at the released 896 px / patch 14, 256 tokens per image; the window
# short enough that an image request's decode crosses it.
GEMMA3_TILE, GEMMA3_PATCH, GEMMA3_TOKENS, GEMMA3_WINDOW = 896, 14, 256, 256
GEMMA3_NEWLINES = ("\n", "\n\n", "\n\n\n", "\n\n\n\n")
GEMMA3_PROMPT = (
    "<bos> <start_of_turn> user <start_of_image> {question} <end_of_turn> <start_of_turn> model"
)
# The serving part sends chat messages: the text checkpoint's template passes them through.
TEXT_CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def text_args(quick: bool) -> argparse.Namespace:
    """The offline-throughput benchmark's own arguments (its defaults, or its --quick)."""
    return offline_args(["--quick"] if quick else [])


def kv_bytes_per_token(args: argparse.Namespace) -> int:
    head_dim = args.hidden // args.heads
    elem = 2 if args.dtype == "bfloat16" else 4  # both engines' KV in the model dtype
    return 2 * args.layers * args.kv_heads * head_dim * elem  # K and V


def kv_cache_gib(prompt_lens: list[int], output_lens: list[int], args) -> int:
    """vLLM's KV budget: whole GiB covering vlmserve's pool (`make_engine`: every request
    at once plus 64 blocks), so neither side preempts."""
    tokens = sum(prompt_lens) + sum(output_lens)
    pool = (tokens // BLOCK_SIZE + 64) * BLOCK_SIZE * kv_bytes_per_token(args)
    return max(1, math.ceil(pool / 2**30))


def decoder_sizes(args: argparse.Namespace) -> dict:
    """The offline-throughput decoder's sizes as checkpoint-builder keywords."""
    return {
        "hidden": args.hidden, "layers": args.layers, "heads": args.heads,
        "kv_heads": args.kv_heads, "vocab": args.vocab, "intermediate_size": args.intermediate,
    }  # fmt: skip


def write_text_workload(root: Path, args: argparse.Namespace) -> dict:
    model = root / "model"
    params = {
        "text": [
            args.hidden,
            args.layers,
            args.heads,
            args.kv_heads,
            args.vocab,
            args.intermediate,
        ],
        "chat_template": TEXT_CHAT_TEMPLATE,
        "covered_vocab": True,
    }
    if _stale(root, params):
        make_text_checkpoint(model, "llama", **decoder_sizes(args))
        add_chat_template(model, TEXT_CHAT_TEMPLATE)
        cover_vocab(model, args.vocab)
        _mark(root, params)
    requests = offline_workload(args)
    warm_args = argparse.Namespace(**{**vars(args), "seed": args.seed + 1, "num_requests": 2})
    warmup = [(ids[:64], 4) for ids, _ in offline_workload(warm_args)]
    spec = {
        "model": str(model),
        "workload": "text",
        "requests": [{"prompt_token_ids": ids, "max_tokens": n} for ids, n in requests],
        "warmup": [{"prompt_token_ids": ids, "max_tokens": n} for ids, n in warmup],
        "prompt_lens_estimate": [len(ids) for ids, _ in requests],
        "engine": _engine(args, 4096, [len(ids) for ids, _ in requests], [n for _, n in requests]),
    }
    return _save(root, spec)


REAL_PROMPT_TOKENS = (128, 1024)  # uniform, both ends included
REAL_OUTPUT_TOKENS = (64, 256)
# Real prose for the real checkpoint's prompts: the project's own documentation.
REAL_TEXT = ("README.md", "benchmarks/README.md", "docs")


def real_corpus_ids(tokenizer) -> list[int]:
    repo = Path(__file__).resolve().parents[2]
    files = []
    for name in REAL_TEXT:
        path = repo / name
        files += sorted(path.glob("*.md")) if path.is_dir() else [path]
    text = "\n\n".join(f.read_text() for f in files)
    return tokenizer(text, add_special_tokens=False).input_ids


def write_real_workload(root: Path, dtype: str, num_requests: int, seed: int = 0) -> dict:
    """The real checkpoint (Gemma 3 270M, its bfloat16 HF folder: the same weights for both
    engines) on `num_requests` real-text prompts of 128-1,024 tokens (BOS + a slice of the
    project's docs), 64-256 output tokens each, greedy, ignore_eos."""
    from transformers import AutoTokenizer

    from benchmarks.lib.real_model import fetch_hf_dir

    model = fetch_hf_dir()
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    corpus = real_corpus_ids(tokenizer)
    rng = random.Random(seed)

    def draw(n: int, low: int, high: int) -> list[tuple[list[int], int]]:
        out = []
        for _ in range(n):
            length = rng.randint(low, high)
            start = rng.randrange(len(corpus) - length)
            ids = [tokenizer.bos_token_id] + corpus[start : start + length - 1]
            out.append((ids, rng.randint(*REAL_OUTPUT_TOKENS)))
        return out

    requests = draw(num_requests, *REAL_PROMPT_TOKENS)
    warmup = [(ids[:64], 4) for ids, _ in draw(2, 64, 64)]
    config = json.loads((model / "config.json").read_text())
    elem = 2 if dtype == "bfloat16" else 4
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"]
    per_token *= config["head_dim"] * elem
    tokens = sum(len(ids) + n for ids, n in requests)
    pool = (tokens // BLOCK_SIZE + 64) * BLOCK_SIZE * per_token
    root.mkdir(parents=True, exist_ok=True)
    spec = {
        "model": str(model),
        "workload": "real",
        "requests": [{"prompt_token_ids": ids, "max_tokens": n} for ids, n in requests],
        "warmup": [{"prompt_token_ids": ids, "max_tokens": n} for ids, n in warmup],
        "prompt_lens_estimate": [len(ids) for ids, _ in requests],
        "engine": {
            "max_model_len": 2048,
            "max_num_batched_tokens": 2048,
            "max_num_seqs": 256,
            "kv_cache_gib": max(1, math.ceil(pool / 2**30)),
            "dtype": dtype,
        },
    }
    return _save(root, spec)


def write_image_workload(
    root: Path,
    args: argparse.Namespace,
    num_requests: int,
    max_tokens: int,
    vision_layers: int,
    checkpoint: bool = True,
) -> dict:
    """`checkpoint=False`: the requests only (their JPEGs written), no LLaVA checkpoint."""
    model = root / "model"
    sizes = [args.hidden, args.layers, args.heads, args.kv_heads, args.vocab, args.intermediate]
    params = {
        "image": [*sizes, vision_layers, TILE, PATCH, MAX_GRID, ASPECT_RATIO],
        "covered_vocab": True,
    }
    if checkpoint and _stale(root, params):
        make_vlm_checkpoint(
            model,
            "llava_onevision",
            **decoder_sizes(args),
            max_position_embeddings=8192,
            tile=TILE,
            patch=PATCH,
            vision_hidden=VISION_HIDDEN,
            vision_layers=vision_layers,
            vision_heads=VISION_HEADS,
            vision_intermediate=VISION_INTERMEDIATE,
            max_grid=MAX_GRID,
            aspect_ratio=ASPECT_RATIO,
        )
        nest_vision_tower(model / "model.safetensors")
        cover_vocab(model, args.vocab)
        _mark(root, params)
    rng = random.Random(args.seed)
    requests, warmup = [], []
    for i in range(num_requests + 1):
        path = root / "images" / f"{i:03d}.jpg"
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            synthetic_jpeg(path, seed=args.seed * 1000 + i)
        question = " ".join(rng.choices(WORDS[:40], k=rng.randint(5, 9)))
        request = {
            "prompt": PROMPT.format(question=question),
            "question": question,
            "image": str(path),
            "max_tokens": max_tokens,
        }
        (warmup if i == num_requests else requests).append(request)
    warmup[0]["max_tokens"] = 4
    prompt_lens = [image_prompt_len(r["prompt"]) for r in requests]
    spec = {
        "model": str(model),
        "workload": "image",
        "requests": requests,
        "warmup": warmup,
        "prompt_lens_estimate": prompt_lens,
        "engine": _engine(args, 8192, prompt_lens, [max_tokens] * num_requests),
    }
    return _save(root, spec)


def write_gemma3_workload(
    root: Path, args: argparse.Namespace, num_requests: int, max_tokens: int, vision_layers: int
) -> dict:
    """The image workload on a Gemma-3-shaped checkpoint (same JPEGs, same questions)."""
    model = root / "model"
    sizes = [args.hidden, args.layers, args.heads, args.kv_heads, args.vocab, args.intermediate]
    params = {
        "gemma3": [*sizes, vision_layers, GEMMA3_TILE, GEMMA3_PATCH, GEMMA3_TOKENS, GEMMA3_WINDOW],
        "covered_vocab": True,
        "newlines": True,
        "nested_tower": 2,
    }
    if _stale(root, params):
        head_dim = args.hidden // args.heads
        make_gemma3_checkpoint(
            model, hidden=args.hidden, layers=args.layers, heads=args.heads,
            kv_heads=args.kv_heads, vocab=args.vocab, intermediate_size=args.intermediate,
            head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=GEMMA3_WINDOW,
            max_position_embeddings=8192, image_size=GEMMA3_TILE, patch=GEMMA3_PATCH,
            tokens_per_image=GEMMA3_TOKENS, vision_hidden=VISION_HIDDEN,
            vision_layers=vision_layers, vision_heads=VISION_HEADS,
            vision_intermediate=VISION_INTERMEDIATE,
        )  # fmt: skip
        # vLLM's Gemma 3 processor looks up the real tokenizer's newline-run tokens (it
        # merges "\n" + "\n\n" after its image replacement): give them ids. The word-level
        # pre-tokenizer splits on whitespace, so neither side ever emits them.
        cover_vocab(model, args.vocab, extra=GEMMA3_NEWLINES)
        nest_vision_tower(model / "model.safetensors")
        _mark(root, params)
    image_spec = write_image_workload(root / "llava", args, num_requests, max_tokens, 0, False)
    requests, warmup = image_spec["requests"], image_spec["warmup"]
    for request in requests + warmup:  # the same JPEG and question in Gemma 3's prompt
        request["prompt"] = GEMMA3_PROMPT.format(question=request["question"])
    prompt_lens = [len(r["prompt"].split()) - 1 + GEMMA3_TOKENS + 2 for r in requests]
    spec = {
        "model": str(model),
        "workload": "gemma3",
        "requests": requests,
        "warmup": warmup,
        "prompt_lens_estimate": prompt_lens,
        "engine": _engine(args, 8192, prompt_lens, [max_tokens] * num_requests),
        # Gemma 3 has no video modality: vLLM refuses a limit for one.
        "limit_mm_per_prompt": {"image": 1},
    }
    return _save(root, spec)


def kv_report(model: Path, context: int, cache_bytes: int) -> dict:
    """KV bytes per sequence at `context` tokens for the checkpoint's layers (the cost model:
    sliding layers hold their window, vLLM's hybrid manager) against all-global, and the
    released Gemma 3 presets' for scale."""
    from search.costmodel import cost_model as cm
    from search.costmodel.presets import get_model, model_from_hf_config

    out = {"context": context, "cache_bytes_per_element": cache_bytes}
    for name, shape in [("checkpoint", model_from_hf_config(model / "config.json")),
                        ("gemma-3-4b", get_model("gemma-3-4b")),
                        ("gemma-3-27b", get_model("gemma-3-27b"))]:  # fmt: skip
        hybrid = cm.kv_bytes_per_sequence(shape, context, cache_bytes)
        full = cm.kv_bytes_all_global(shape, context, cache_bytes)
        out[name] = {
            "num_layers": shape.num_layers, "num_sliding_layers": shape.num_sliding_layers,
            "sliding_window": shape.sliding_window, "hybrid_bytes": hybrid,
            "all_global_bytes": full, "hybrid_over_all_global": hybrid / full,
        }  # fmt: skip
    return out


def cover_vocab(model: Path, vocab_size: int, extra: tuple[str, ...] = ()) -> None:
    """Give every id of the model a word of its own (`extra`, then w<i> fillers after the
    tokenizer's words; existing ids unchanged). Random weights emit any id, and ids past the
    tokenizer decode to nothing: a stream of them has no text, so no first token to time."""
    from tokenizers import Tokenizer, models

    path = model / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(path))
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    for word in extra:
        vocab.setdefault(word, len(vocab))
    i = 0
    while len(vocab) < vocab_size:
        vocab.setdefault(f"w{i}", len(vocab))
        i += 1
    tokenizer.model = models.WordLevel(vocab, unk_token="<unk>")
    tokenizer.save(str(path))


def add_chat_template(model: Path, template: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(model)


def nest_vision_tower(path: Path) -> None:
    """Rename `vision_tower.*` to `vision_tower.vision_model.*` (what `save_pretrained`
    writes is refused by vLLM: "There is no module or parameter named
    'vision_tower.embeddings' in LlavaOnevisionForConditionalGeneration", and the same in
    Gemma3ForConditionalGeneration). vlmserve loads either layout."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    old, new = "vision_tower.", "vision_tower.vision_model."
    renamed = {
        (new + name[len(old) :] if name.startswith(old) and not name.startswith(new) else name): t
        for name, t in tensors.items()
    }
    save_file(renamed, path, metadata={"format": "pt"})


def image_prompt_len(prompt: str) -> int:
    """Prompt tokens of an IMAGE_SIZE image and `prompt` (word-level tokenizer: one token
    per word; the <image> word becomes the anyres placeholder run). For KV sizing only:
    both engines report their own counts."""
    layout = anyres_layout(
        *IMAGE_SIZE,
        tile_size=TILE,
        num_patches=(TILE // PATCH) ** 2,
        grid_pinpoints=[
            [TILE * i, TILE * j] for i in range(1, MAX_GRID + 1) for j in range(1, MAX_GRID + 1)
        ],
        max_num_patches=int(ASPECT_RATIO.removeprefix("anyres_max_")),
    )
    return len(prompt.split()) - 1 + layout.num_tokens


def synthetic_jpeg(path: Path, seed: int, quality: int = 90) -> None:
    """A seeded 1024 x 768 picture: a colour gradient, a few dozen shapes, fine noise (so
    each image costs a real JPEG decode and no two are alike)."""
    rng = np.random.default_rng(seed)
    width, height = IMAGE_SIZE
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = rng.uniform(0, 255, (2, 3))
    t = (x / width + y / height)[..., None] / 2
    pixels = (base[0] * (1 - t) + base[1] * t + rng.normal(0, 6, (height, width, 3))).clip(0, 255)
    image = Image.fromarray(pixels.astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(20, 40))):
        x0, y0 = int(rng.integers(0, width - 40)), int(rng.integers(0, height - 40))
        box = (x0, y0, x0 + int(rng.integers(20, 300)), y0 + int(rng.integers(20, 300)))
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=colour)
    image.save(path, "JPEG", quality=quality)


def _stale(root: Path, params: dict) -> bool:
    """Whether root/model must be (re)written: none, or one of other sizes (removed)."""
    stamp = root / "model" / "vs_vllm_params.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == params:
        return False
    if (root / "model").exists():
        shutil.rmtree(root / "model")
    return True


def _mark(root: Path, params: dict) -> None:
    (root / "model" / "vs_vllm_params.json").write_text(json.dumps(params))


def _engine(args, max_model_len: int, prompt_lens: list[int], output_lens: list[int]) -> dict:
    return {
        "max_model_len": max_model_len,
        "max_num_batched_tokens": args.token_budget,
        "max_num_seqs": 256,
        "kv_cache_gib": kv_cache_gib(prompt_lens, output_lens, args),
        # both engines run the (float32) checkpoint in this dtype: --dtype on both
        "dtype": "bfloat16" if args.dtype == "bfloat16" else "float32",
    }


def _save(root: Path, spec: dict) -> dict:
    (root / "spec.json").write_text(json.dumps(spec))
    spec["path"] = str(root / "spec.json")
    return spec


# -- n-gram drafts (--speculative-tokens) -------------------------------------------------


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--speculative-tokens", type=int, default=None, metavar="K",
        help="vlmserve drafts up to K n-gram tokens a step with adaptive γ (n 2-4, from the "
        "prompt and output; 0: none; default: its own default, adaptive γ up to "
        f"{DEFAULT_DRAFTS}): writes *_spec{{K}}.json",
    )  # fmt: skip
    p.add_argument(
        "--vllm-speculative-tokens", type=int, default=0, metavar="K",
        help="offline, vLLM drafts up to K (its ngram method, n 2-4; default 0: none, its own "
        "default and its fastest here): writes *_vllm{K}.json",
    )  # fmt: skip


def ngram_config(tokens: int | None) -> SpeculativeConfig:
    """vlmserve's drafts for --speculative-tokens: adaptive γ up to `tokens` (None: the
    engine's default), suffixes of 2 to 4 tokens (vLLM's prompt_lookup_min / _max in its
    worker); 0: none."""
    return SpeculativeConfig(tokens, min_n=2, max_n=4)


def set_drafts(spec: dict, ours: int | None, vllm: int) -> None:
    """Each engine's drafts in the spec's engine record, the spec file saved again."""
    spec["engine"].update(speculative_tokens=ours, vllm_speculative_tokens=vllm)
    _save(Path(spec.pop("path")).parent, spec)
