"""Tiny random checkpoints in the real HF formats, built from the transformers config
classes and written with `save_pretrained` (safetensors + config.json + tokenizer +
processor). Tests, benchmarks and demos use them: nothing can be downloaded here."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

WORDS = (
    "a an the is are what where how many colour color red green blue yellow circle square "
    "triangle star cross left right top bottom centre center one two three four there image "
    "picture describe this of in on and with word written small large big please tell me "
    "user assistant system User: Assistant: System:"
).split()
NUM_FILLER_WORDS = 160

_QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} "
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<image> "
    "{% else %}{{ p['text'] }} {% endif %}{% endfor %}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
_IDEFICS3_TEMPLATE = (
    "<|begin_of_text|> {% for m in messages %}{{ m['role'] | capitalize }}: "
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<image> "
    "{% else %}{{ p['text'] }} {% endif %}{% endfor %}<end_of_utterance> {% endfor %}"
    "{% if add_generation_prompt %}Assistant: {% endif %}"
)


def word_tokenizer(special: list[str], eos: str):
    """A whitespace word-level tokenizer over WORDS + filler words + `special`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab_list = ["<unk>", "<pad>", *special, *WORDS, *(f"w{i}" for i in range(NUM_FILLER_WORDS))]
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys(vocab_list))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        eos_token=eos,
        additional_special_tokens=special,
    )


# Text the byte-level tokenizer's merges are learnt from: prompt words and JSON, so the
# vocabulary holds multi-byte tokens such as `{"`, `": ` and whole words, as real ones do.
_BPE_CORPUS = (
    " ".join(WORDS),
    '{"name": "red circle", "count": 3, "colour": "blue", "tags": ["left", "top"]}',
    '[{"name": "search", "arguments": {"query": "star", "limit": 2}}, null, true, false]',
    "<tool_call> {} </tool_call> 0123456789 -+.eE,:;!?'\\/()[]{}<>_ abcdefghijklmnopqrstuvwxyz",
)

TokenizerKind = Literal["words", "bytes"]


def byte_tokenizer(special: list[str], eos: str, vocab: int):
    """A byte-level BPE tokenizer (GPT-2 / Llama 3 / Qwen style) of `vocab` entries: the
    256 byte tokens, `special`, and merges learnt from _BPE_CORPUS. Any text round-trips,
    so it can write JSON, which the word-level one cannot (structured outputs need it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab < len(alphabet) + len(special) + 1:
        raise ValueError(f"vocab={vocab} is too small for a byte-level tokenizer")
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<pad>", *special], initial_alphabet=alphabet,
        show_progress=False,
    )  # fmt: skip
    core.train_from_iterator(list(_BPE_CORPUS) * 4, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token=eos, additional_special_tokens=special
    )


def make_tokenizer(kind: TokenizerKind, special: list[str], eos: str, vocab: int):
    """The random checkpoints' tokenizer: word-level (default) or byte-level BPE."""
    if kind == "bytes":
        return byte_tokenizer(special, eos, vocab)
    return word_tokenizer(special, eos)


def _text_config(kind: str, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int,
                 **extra):  # fmt: skip
    from transformers import LlamaConfig, Qwen2Config

    cls = Qwen2Config if kind == "qwen2" else LlamaConfig
    extra.setdefault("intermediate_size", hidden * 2)
    extra.setdefault("max_position_embeddings", 4096)
    return cls(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        **extra,
    )


def make_text_checkpoint(
    path: str | Path,
    kind: Literal["llama", "qwen2"] = "llama",
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 256,
    seed: int = 0,
    tokenizer: TokenizerKind = "words",
    **extra,
) -> Path:
    """A random text-only decoder (Llama or Qwen2 class) with a word-level (or, with
    tokenizer="bytes", byte-level BPE) tokenizer."""
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = _text_config(kind, vocab, hidden, layers, heads, kv_heads, **extra)
    model = (Qwen2ForCausalLM if kind == "qwen2" else LlamaForCausalLM)(config)
    path = Path(path)
    model.save_pretrained(path)
    make_tokenizer(tokenizer, ["<s>", "</s>"], "</s>", vocab).save_pretrained(path)
    return path


def make_vlm_checkpoint(
    path: str | Path,
    family: Literal["llava_onevision", "idefics3"],
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 256,
    tile: int = 32,
    patch: int = 8,
    seed: int = 0,
    vision_hidden: int = 32,
    vision_layers: int = 2,
    vision_heads: int = 4,
    vision_intermediate: int | None = None,  # None: 2 * vision_hidden
    max_grid: int = 3,
    aspect_ratio: str = "anyres_max_4",
    tokenizer: TokenizerKind = "words",
    **text_extra,
) -> Path:
    """A random VLM with its HF processor (tokenizer, image processor, chat template).
    LLaVA-OneVision only: anyres grids up to `max_grid` x `max_grid` tiles and
    `aspect_ratio` (the real family: 6 and "anyres_max_9"). `text_extra` goes to the
    decoder's config (intermediate_size, max_position_embeddings). tokenizer="bytes": a
    byte-level BPE tokenizer of `vocab` entries instead of the word-level one."""
    from transformers import SiglipVisionConfig

    torch.manual_seed(seed)
    vision = SiglipVisionConfig(
        hidden_size=vision_hidden, intermediate_size=vision_intermediate or 2 * vision_hidden,
        num_hidden_layers=vision_layers, num_attention_heads=vision_heads,
        image_size=tile, patch_size=patch,
    )  # fmt: skip
    path = Path(path)
    text = (vocab, hidden, layers, heads, kv_heads)
    if family == "llava_onevision":
        _make_llava_onevision(
            path, vision, text, tile, max_grid, aspect_ratio, text_extra, tokenizer
        )
    else:
        _make_idefics3(path, vision, *text, tile, text_extra, tokenizer)
    return path


def _make_llava_onevision(path, vision, text, tile, max_grid, aspect_ratio, text_extra, kind):  # noqa: PLR0913
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        LlavaOnevisionImageProcessor,
        LlavaOnevisionProcessor,
        LlavaOnevisionVideoProcessor,
    )

    special = ["<image>", "<video>", "<|im_start|>", "<|im_end|>"]
    tokenizer = make_tokenizer(kind, special, "<|im_end|>", text[0])
    grid = range(1, max_grid + 1)
    pinpoints = [[tile * i, tile * j] for i in grid for j in grid]
    config = LlavaOnevisionConfig(
        text_config=_text_config("qwen2", *text, **text_extra),
        vision_config=vision,
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        video_token_index=tokenizer.convert_tokens_to_ids("<video>"),
        image_grid_pinpoints=pinpoints,
        vision_aspect_ratio=aspect_ratio,
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
    )
    LlavaOnevisionForConditionalGeneration(config).save_pretrained(path)
    size = {"height": tile, "width": tile}
    processor = LlavaOnevisionProcessor(
        image_processor=LlavaOnevisionImageProcessor(size=size, image_grid_pinpoints=pinpoints),
        tokenizer=tokenizer,
        video_processor=LlavaOnevisionVideoProcessor(size=size),
        num_image_tokens=(tile // vision.patch_size) ** 2,
        vision_feature_select_strategy="full",
        vision_aspect_ratio=aspect_ratio,
        chat_template=_QWEN_TEMPLATE,
    )
    processor.save_pretrained(path)


def _make_idefics3(path, vision, vocab, hidden, layers, heads, kv_heads, tile, text_extra, kind):  # noqa: PLR0913
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessor,
        Idefics3Processor,
    )

    special = ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>",
               "<|begin_of_text|>", *(f"<row_{i}_col_{j}>" for i in range(1, 7)
                                      for j in range(1, 7))]  # fmt: skip
    tokenizer = make_tokenizer(kind, special, "<end_of_utterance>", vocab)
    scale = 2
    config = Idefics3Config(
        text_config=_text_config("llama", vocab, hidden, layers, heads, kv_heads, **text_extra),
        vision_config=vision,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=scale,
    )
    Idefics3ForConditionalGeneration(config).save_pretrained(path)
    image_processor = Idefics3ImageProcessor(
        size={"longest_edge": tile * 3},
        max_image_size={"longest_edge": tile},
    )
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=(tile // vision.patch_size) ** 2 // scale**2,
        chat_template=_IDEFICS3_TEMPLATE,
    )
    processor.save_pretrained(path)


# Gemma 3's turn markers, written with spaces around them (the word tokenizer splits on
# whitespace; the real template writes "\n").
_GEMMA3_TEMPLATE = (
    "<bos> {% for m in messages %}<start_of_turn> "
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }} "
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<start_of_image> "
    "{% else %}{{ p['text'] }} {% endif %}{% endfor %}<end_of_turn> {% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn> model {% endif %}"
)
GEMMA3_SPECIAL = ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
                  "<end_of_image>", "<image_soft_token>", "model"]  # fmt: skip


def _perturb_gemma_norms(model: torch.nn.Module, seed: int) -> None:
    """transformers initialises Gemma's (1 + weight) norms and the projection to zeros:
    random values, so that a test notices a missing `1 +` or a dropped projector."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "mm_input_projection" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)


def gemma3_text_config(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int,
                       **extra):  # fmt: skip
    """A Gemma3TextConfig: 5 sliding layers to 1 global (`layer_types` from the config's
    default pattern), local RoPE base 10k, global 1M with linear scaling (as 4b/27b)."""
    from transformers import Gemma3TextConfig

    extra.setdefault("intermediate_size", hidden * 2)
    extra.setdefault("max_position_embeddings", 4096)
    extra.setdefault("sliding_window", 64)
    extra.setdefault("head_dim", 16)
    extra.setdefault("query_pre_attn_scalar", 24)
    extra.setdefault(
        "rope_parameters",
        {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}},
    )  # fmt: skip
    return Gemma3TextConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, **extra,
    )  # fmt: skip


def _gemma3_tokenizer():
    tokenizer = word_tokenizer(GEMMA3_SPECIAL, "<end_of_turn>")
    tokenizer.bos_token = "<bos>"
    # What Gemma3Processor reads off the tokenizer.
    tokenizer._set_model_specific_special_tokens(
        {
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        }
    )
    return tokenizer


def make_gemma3_checkpoint(
    path: str | Path,
    *,
    hidden: int = 64,
    layers: int = 12,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 256,
    image_size: int = 32,
    patch: int = 4,
    tokens_per_image: int = 16,
    vision_hidden: int = 32,
    vision_layers: int = 2,
    vision_heads: int = 4,
    vision_intermediate: int | None = None,
    pan_and_scan: bool = False,
    text_only: bool = False,
    seed: int = 0,
    **text_extra,
) -> Path:
    """A random Gemma 3 (Gemma3ForConditionalGeneration, or Gemma3ForCausalLM with
    `text_only`) with its processor. 12 layers: layers 5 and 11 global, the rest sliding
    over `sliding_window` (default 64) positions. The tower's (image_size / patch)^2
    patches average-pool to `tokens_per_image`. `pan_and_scan`: the processor crops
    elongated images (min crop `image_size`) into extra 'images'."""
    from transformers import (
        Gemma3Config,
        Gemma3ForCausalLM,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessor,
        Gemma3Processor,
        SiglipVisionConfig,
    )

    torch.manual_seed(seed)
    path = Path(path)
    tokenizer = _gemma3_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in GEMMA3_SPECIAL}
    text = gemma3_text_config(
        vocab, hidden, layers, heads, kv_heads, bos_token_id=ids["<bos>"],
        eos_token_id=ids["<end_of_turn>"], pad_token_id=1, **text_extra,
    )  # fmt: skip
    if text_only:
        model = Gemma3ForCausalLM(text)
        _perturb_gemma_norms(model, seed)
        model.save_pretrained(path)
        tokenizer.chat_template = _GEMMA3_TEMPLATE
        tokenizer.save_pretrained(path)
        return path
    vision = SiglipVisionConfig(
        hidden_size=vision_hidden, intermediate_size=vision_intermediate or 2 * vision_hidden,
        num_hidden_layers=vision_layers, num_attention_heads=vision_heads,
        image_size=image_size, patch_size=patch, vision_use_head=False,
    )  # fmt: skip
    config = Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=tokens_per_image,
        boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
    )  # fmt: skip
    model = Gemma3ForConditionalGeneration(config)
    _perturb_gemma_norms(model, seed)
    model.save_pretrained(path)
    image_processor = Gemma3ImageProcessor(
        size={"height": image_size, "width": image_size}, do_pan_and_scan=pan_and_scan,
        pan_and_scan_min_crop_size=image_size, pan_and_scan_max_num_crops=4,
        pan_and_scan_min_ratio_to_activate=1.2,
    )  # fmt: skip
    processor = Gemma3Processor(
        image_processor=image_processor, tokenizer=tokenizer,
        image_seq_length=tokens_per_image, chat_template=_GEMMA3_TEMPLATE,
    )  # fmt: skip
    processor.save_pretrained(path)
    return path


def to_bfloat16_checkpoint(src: str | Path, dst: str | Path) -> Path:
    """A copy of the checkpoint at `src` stored in bfloat16, as real checkpoints ship:
    every floating tensor rounded to bfloat16 and config.json's dtype (top level and
    sub-configs) set to bfloat16. Tokenizer and processor files are copied as they are."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for file in src.iterdir():
        if file.suffix == ".safetensors":
            tensors = {
                name: t.to(torch.bfloat16) if t.is_floating_point() else t
                for name, t in load_file(file).items()
            }
            save_file(tensors, dst / file.name, metadata={"format": "pt"})
        elif file.name == "config.json":
            config = json.loads(file.read_text())
            for part in (config, *(v for v in config.values() if isinstance(v, dict))):
                for key in ("dtype", "torch_dtype"):
                    if key in part:
                        part[key] = "bfloat16"
            config["dtype"] = "bfloat16"
            (dst / file.name).write_text(json.dumps(config, indent=2))
        elif file.is_file():
            shutil.copy(file, dst / file.name)
    return dst
