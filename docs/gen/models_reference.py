"""The model reference: the checkpoint families `vlmserve` serves and what each supports,
from the loader's registry (`vlmserve/worker/models/loader.py`: `_SPECS`, its
`model_type` aliases), the vision tower's architectures (`encoders/vision.py`) and the
engine's feature gates, with a line per family from FAMILY_NOTES below (a family the
registry has and the notes lack stops the generator, naming it)."""

from __future__ import annotations

from docs.gen.markdown import REGENERATE, code, header, table

PAGE = "reference/models.md"

# Per family: the image tiling rule and what is worth knowing; the features come from
# the code's gates below.
FAMILY_NOTES: dict[str, tuple[str, str]] = {
    "llava_onevision": (
        "anyres: a grid of tiles picked from the checkpoint's grid pinpoints, plus the base image",
        "SigLIP + Qwen2.",
    ),
    "idefics3": (
        "the longest edge resized, split into square tiles plus a global image",
        "SigLIP + Llama, SmolVLM included. The embedded default model is saved in this "
        "format (its own InternVL-style 48 px tiling, up to 12 tiles plus a thumbnail).",
    ),
    "gemma3": (
        "one 896 px image (256 tokens); `--pan-and-scan` adds 2-4 crops of an elongated image",
        "SigLIP + Gemma 3; sliding-window and global layers (hybrid KV); an image's tokens "
        "attend to each other in full during prefill.",
    ),
    "gemma3_text": ("(text only)", "Gemma 3's text-only `Gemma3ForCausalLM`; hybrid KV."),
    "llama": ("(text only)", "Llama decoders (GQA or MHA; RoPE scaling: linear, llama3, yarn)."),
    "qwen2": ("(text only)", "Qwen2 decoders (q/k/v bias)."),
}


def _features(family: str, multimodal: bool) -> dict[str, bool]:
    """What the engine runs for a family. This mirrors the engine's gates by hand (reading
    them would need a config per family): Gemma 3 layers (DecoderConfig.variant `gemma3`)
    refuse tensor parallelism (`load_model`) and run neither nano-batched layers nor CUDA
    graphs (`ModelRunner` runs those for `variant == "llama"` layers only)."""
    gemma = family.startswith("gemma3")
    return {
        "images": multimodal,
        "tensor parallel": not gemma,
        "nano-batching": not gemma,
        "CUDA graphs": not gemma,
        "hybrid KV": gemma,
    }


def families() -> list[tuple]:
    from encoders.vision import ARCHITECTURES
    from vlmserve.worker.models import loader

    missing = set(loader._SPECS) - set(FAMILY_NOTES)
    if missing:
        raise KeyError(
            f"model families {sorted(missing)} have no entry in docs/gen/models_reference.py "
            f"FAMILY_NOTES: add one, then run `{REGENERATE}`"
        )
    rows = []
    for family, spec in loader._SPECS.items():
        model_types = [family] + [k for k, v in loader._MODEL_TYPES.items() if v == family]
        archs = [a for a, f in ARCHITECTURES.items() if f == family]
        tiling, notes = FAMILY_NOTES[family]
        features = _features(family, spec.multimodal)
        rows.append((family, model_types, archs, tiling, notes, features, spec))
    return rows


def render() -> str:
    from vlmserve.worker.models.gguf_weights import ARCHITECTURES as GGUF_ARCHS
    from vlmserve.worker.models.loader import SUPPORTED_FAMILIES

    rows = families()
    names = list(next(iter(rows))[5])
    feature_rows = [
        (code(family), *("yes" if features[n] else "no" for n in names))
        for family, _, _, _, _, features, _ in rows
    ]
    family_rows = [
        (code(family), ", ".join(code(t) for t in types),
         ", ".join(code(a) for a in archs) or "(by `model_type`)", tiling, notes)
        for family, types, archs, tiling, notes, _, _ in rows
    ]  # fmt: skip
    weight_rows = [
        (code(family), ", ".join(code(p + "embed_tokens.weight") for p in spec.decoder_prefixes),
         ", ".join(code(n) for n in spec.lm_head_names))
        for family, _, _, _, _, _, spec in rows
    ]  # fmt: skip
    return "\n".join([
        header("Supported models", "the model registry in `vlmserve/worker/models/loader.py`"),
        f"vlmserve serves {', '.join(SUPPORTED_FAMILIES)} checkpoints. `--model` takes a "
        "local Hugging Face checkpoint folder: `config.json`, the weights as `*.safetensors` "
        "(sharded with `model.safetensors.index.json` too), the tokenizer and, for a "
        "vision model, `preprocessor_config.json`. The family is read from `config.json`'s "
        "`model_type`; anything else is refused at start with this list. `--model` also "
        f"takes a GGUF file (architectures {', '.join(code(a) for a in sorted(GGUF_ARCHS))}), "
        "dequantized at load: see [GGUF files](../models.md#gguf-files).\n",
        "## Families\n",
        table(("family", "`model_type`", "architectures", "image tiling", "notes"),
              family_rows),  # fmt: skip
        "## Features per family\n",
        table(("family", *names), feature_rows),
        "Every family takes the same image path (header-only token count, the "
        "preprocessing pool, the encoder-output cache keyed by the image's bytes), the "
        "prefix cache, chunked prefill, speculation, structured outputs and every attention "
        "backend.\n",
        "## Where the weights are read\n",
        "The decoder's embedding (the first name found wins; its prefix is the decoder's) and "
        "the LM head (none needed where `config.json` ties the word embeddings):\n",
        table(("family", "embedding", "LM head"), weight_rows),
    ])  # fmt: skip
