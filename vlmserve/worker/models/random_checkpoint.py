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
