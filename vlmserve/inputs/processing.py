"""From a request (chat messages or a raw prompt, plus images) to prompt token ids and
the placeholder layout of each image.

The checkpoint's HF processor supplies the chat template and the tokenizer. Images of the
supported families (LLaVA-OneVision, Idefics3 / SmolVLM, Gemma 3 with or without
pan-and-scan) take our path instead of the HF image processor: header-only layout and
exact token count, the placeholder text the HF processor would write (so the token ids
are identical), tiles from the preprocessing pool (`encoders.stage.prepare_images`).
Other processors, and `use_pool=False` (`--hf-image-processor`), keep the HF image
processor on the request thread.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from encoders.cache import EncoderCache
from encoders.config import EncoderConfig
from encoders.errors import PromptTooLongError, TooManyImagesError
from encoders.image_spec import ImageSpec
from encoders.images import ImageSource, load_image
from encoders.pixel_budget import PixelBudget, shared_budget
from encoders.stage import ImageWork, pool_metrics, submit_images, warm_pool
from encoders.tiling.pan_and_scan import pan_and_scan_crops
from scheduler.sequence import ImagePlaceholder
from vlmserve.inputs.shared_tokenizer import CopyPool, direct_encoder
from vlmserve.worker.models.loader import LoadedModel


@dataclass
class Request:
    """One generation request. Either `messages` (OpenAI-style chat: content is a string
    or a list of parts `{"type": "text", "text": ...}` / `{"type": "image", "image": src}`)
    or `prompt` (already templated text) with `images` in placeholder order, or
    `prompt_token_ids` (text only)."""

    messages: list[dict] | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None  # text-only, already tokenised
    images: list[ImageSource] = field(default_factory=list)
    sampling: object = None  # vlmserve.sample.params.SamplingParams; None = defaults
    request_id: str | None = None
    # n > 1 fanned out by a caller: a sibling with the same prompt whose prefill this one
    # waits for, to share its prompt's KV (`vlmserve.engine.request_options`).
    share_prompt_with: str | None = None
    tools: list[dict] | None = None  # OpenAI tool specs the chat template renders


@dataclass(frozen=True)
class ProcessedPrompt:
    token_ids: list[int]
    images: list[ImagePlaceholder]  # the scheduler's view: content key, positions, tiles
    # The encoder's record of each image, in order (ImageWork, or a VisionInput on the HF
    # image processor's path): the runner's, handed over with the request.
    works: list[object] = field(default_factory=list)


# No tokenizer averages more characters per token than this, so a prompt over
# max_model_len * MAX_CHARS_PER_TOKEN characters cannot fit: refused before tokenising
# (a 50 MB prompt would otherwise keep a preparer thread busy for many seconds).
MAX_CHARS_PER_TOKEN = 64


def check_prompt_chars(request: Request, max_model_len: int) -> None:
    """PromptTooLongError for text that cannot fit however it tokenises."""
    texts = [request.prompt or ""]
    for message in request.messages or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts += [p.get("text") or "" for p in content if isinstance(p, dict)]
    num_chars = sum(len(text) for text in texts if isinstance(text, str))
    limit = max_model_len * MAX_CHARS_PER_TOKEN
    if num_chars > limit:
        raise PromptTooLongError(
            f"prompt is {num_chars} characters: it cannot fit the model's context of "
            f"{max_model_len} tokens (the limit is {limit} characters)"
        )


def place_images(
    token_ids: Sequence[int], image_token_id: int, images: Sequence[tuple[bytes, int]]
) -> list[ImagePlaceholder]:
    """Each image's placeholder positions, in order: images are (content key, number of
    tokens) and take the image-token positions one run after the other. ValueError when
    the prompt's image tokens and the images' counts differ."""
    positions = [i for i, t in enumerate(token_ids) if t == image_token_id]
    placeholders, cursor = [], 0
    for key, count in images:
        placeholders.append(ImagePlaceholder(key, positions[cursor : cursor + count]))
        cursor += count
    if cursor != len(positions):
        raise ValueError(
            f"prompt has {len(positions)} image placeholder tokens, its images need {cursor}"
        )
    return placeholders


def split_messages(messages: list[dict]) -> tuple[list[dict], list[ImageSource]]:
    """Messages for the chat template (image parts reduced to `{"type": "image"}`) and the
    image sources in order."""
    templated, images = [], []
    for message in messages:
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"a message must be a dict with a role, got {message!r}")
        content = message.get("content", "")
        # A tool-calling turn keeps its calls / call id for the template.
        calls = {key: message[key] for key in ("tool_calls", "tool_call_id") if key in message}
        if isinstance(content, str):
            templated.append(
                {"role": message["role"], "content": [{"type": "text", "text": content}], **calls}
            )
            continue
        parts = []
        for part in content:
            kind = part.get("type")
            if kind == "text":
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image":
                parts.append({"type": "image"})
                images.append(part["image"])
            else:
                raise ValueError(f"unsupported content part type {kind!r}")
        templated.append({"role": message["role"], "content": parts, **calls})
    return templated, images


def prompt_from_ids(request: Request, vocab_size: int) -> ProcessedPrompt:
    """A text-only prompt given as token ids, checked against the vocabulary."""
    if request.images or request.messages is not None or request.prompt is not None:
        raise ValueError("prompt_token_ids cannot be combined with messages, prompt or images")
    ids = [int(t) for t in request.prompt_token_ids]
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if not ids or bad:
        raise ValueError(
            f"prompt_token_ids must be non-empty ids in [0, {vocab_size}), got {bad[:3]}"
        )
    return ProcessedPrompt(ids, [])


def place_works(
    token_ids: Sequence[int], image_token_id: int, works: Sequence[ImageWork]
) -> list[ImagePlaceholder]:
    """`place_images` for images on the pool path: keyed by their encoder-cache key, with
    their tile counts (the scheduler's encoder-budget unit) known from the header."""
    images = [(work.cache_key, work.layout.num_tokens) for work in works]
    placed = place_images(token_ids, image_token_id, images)
    for placeholder, work in zip(placed, works, strict=True):
        placeholder.num_tiles = work.layout.num_tiles
    return placed


def check_image_count(num_images: int, max_images: int) -> None:
    if num_images > max_images:
        raise TooManyImagesError(f"request has {num_images} images, the limit is {max_images}")


class HFPromptProcessor:
    """Wraps the checkpoint's HF processor (or tokenizer, for text-only models)."""

    def __init__(
        self,
        path: str,
        model: LoadedModel,
        max_images: int,
        encoder: EncoderConfig | None = None,
        encoder_cache: EncoderCache | None = None,
    ) -> None:
        from transformers import AutoProcessor, AutoTokenizer

        self.model = model
        self.max_images = max_images
        self.encoder = encoder or EncoderConfig()
        self.encoder_cache = encoder_cache
        self.image_spec: ImageSpec | None = None  # None: the HF image processor is used
        if model.vision is not None:
            self.processor = AutoProcessor.from_pretrained(path)
            self.tokenizer = self.processor.tokenizer
            if self.encoder.use_pool:
                self.image_spec = ImageSpec.from_hf(
                    self.processor, self.encoder.jpeg_draft, self.encoder.pan_and_scan
                )
                warm_pool(self.encoder)
        else:
            self.processor = None
            self.tokenizer = AutoTokenizer.from_pretrained(path)
        # process() runs on several threads at once (Engine.prepare): one private Rust
        # tokenizer they all call, else ready copies (`warm` makes them before serving).
        start = time.perf_counter()
        self._encoder = direct_encoder(self.tokenizer)
        self._encoder_s = time.perf_counter() - start  # reported by `warm`
        self._tokenizers = CopyPool(self.tokenizer) if self._encoder is None else None
        hf_images = model.vision is not None and self.image_spec is None
        self._processors = CopyPool(self.processor) if hf_images else None

    @property
    def thread_safe_backend(self) -> object | None:
        """The private Rust tokenizer every thread may encode and decode with (None: the
        tokenizer has no direct path)."""
        return self._encoder.backend if self._encoder is not None else None

    def warm(self) -> dict[str, float]:
        """Make every copy a request could need now (the warm-up, before serving): the
        seconds per kind of copy made."""
        made = {"shared tokenizer": self._encoder_s} if self._encoder is not None else {}
        for name, pool in (("tokenizer", self._tokenizers), ("processor", self._processors)):
            if pool is not None:
                start = time.perf_counter()
                pool.fill()
                made[f"{name} copies x{pool.size}"] = time.perf_counter() - start
        return made

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """`text`'s token ids, as the checkpoint's tokenizer gives them; any thread."""
        if self._encoder is not None:
            return self._encoder(text, add_special_tokens)
        with self._tokenizers.borrow() as tokenizer:
            return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def render(self, request: Request) -> tuple[str, list[ImageSource], bool]:
        """(prompt text, image sources, whether special tokens are still to be added)."""
        if request.messages is not None:
            templated, sources = split_messages(request.messages)
            owner = self.processor or self.tokenizer
            if getattr(owner, "chat_template", None) is None:
                raise ValueError("this checkpoint has no chat template: send a raw prompt")
            extra = {"tools": request.tools} if request.tools else {}
            text = owner.apply_chat_template(
                templated, add_generation_prompt=True, tokenize=False, **extra
            )
            return text, sources, False  # the template wrote BOS and friends
        if request.prompt is None:
            raise ValueError("a request needs messages or a prompt")
        return request.prompt, list(request.images), True

    def process(self, request: Request) -> ProcessedPrompt:
        if request.prompt_token_ids is not None:
            return prompt_from_ids(request, self.model.decoder.cfg.vocab_size)
        text, sources, add_special = self.render(request)
        check_image_count(len(sources), self.max_images)
        if not sources:
            return ProcessedPrompt(self.encode(text, add_special), [])
        if self.model.vision is None:
            raise ValueError("this model is text-only and cannot take images")
        if self.image_spec is not None:
            return self._with_pool(text, sources, add_special)
        loaded = [load_image(s, self.encoder.max_pixels, self._budget()) for s in sources]
        images, hashes = [img for img, _ in loaded], [h for _, h in loaded]
        return self._with_images(text, images, hashes, add_special)

    def _with_images(
        self, text: str, images: list[Image.Image], hashes: list[bytes], add_special: bool
    ) -> ProcessedPrompt:
        from encoders.vision import vision_inputs_from_hf

        family = self.model.family
        batch_images = [images] if family == "idefics3" else images
        extra = {"do_pan_and_scan": self.encoder.pan_and_scan} if family == "gemma3" else {}
        with self._processors.borrow() as processor:
            outputs = processor(
                text=[text], images=batch_images, return_tensors="pt",
                add_special_tokens=add_special, **extra,
            )  # fmt: skip
            if family == "gemma3":  # the processor drops num_crops: the same rule gives it
                outputs = {**outputs, "num_crops": gemma3_num_crops(processor, images, extra)}
            if family == "idefics3" and len(images) > 1:
                # The Idefics3 processor drops each image's tile grid from its output; only
                # the image processor reports it, and it is needed to split the tiles.
                grid = processor.image_processor(images, return_row_col_info=True)
                outputs = {**outputs, "rows": grid["rows"], "cols": grid["cols"]}
        token_ids = outputs["input_ids"][0].tolist()
        inputs = vision_inputs_from_hf(family, outputs)
        count = self.model.vision.num_image_tokens
        placed = [(key, count(v)) for v, key in zip(inputs, hashes, strict=True)]
        image_token_id = self.model.image_token_id
        return ProcessedPrompt(
            token_ids, place_images(token_ids, image_token_id, placed), list(inputs)
        )

    def _budget(self) -> PixelBudget:
        return shared_budget(self.encoder.resolved_max_decode_pixels)

    def pool_metrics(self) -> dict[str, float]:
        """The preprocessing pool's counters and per-stage seconds ({} without a pool)."""
        return {} if self.image_spec is None else pool_metrics(self.encoder)

    def _with_pool(
        self, text: str, sources: list[ImageSource], add_special: bool
    ) -> ProcessedPrompt:
        image_token = self.processor.image_token  # the prompt's marker (Gemma 3: its BOI)
        pieces = text.split(image_token)
        if len(pieces) - 1 != len(sources):
            raise ValueError(
                f"prompt has {len(pieces) - 1} {image_token} markers for {len(sources)} images"
            )
        # As the HF processor is called here (a flat image list): every image of a
        # prompt gets its full layout, multi-image prompts included (multi_image=False).
        # No waiting here: the header gave each layout and token count, so the request
        # is tokenised and queued while the pool decodes; the engine marks it ready when
        # its tiles exist, and a bad image found then fails that request alone.
        works = submit_images(sources, self.image_spec, self.encoder, self.encoder_cache)
        expanded = pieces[0] + "".join(
            self.image_spec.prompt_text(work.layout, image_token) + piece
            for work, piece in zip(works, pieces[1:], strict=True)
        )
        token_ids = self.encode(expanded, add_special)
        return ProcessedPrompt(
            token_ids, place_works(token_ids, self.model.image_token_id, works), works
        )


def gemma3_num_crops(processor: object, images: list[Image.Image], kwargs: dict) -> list[int]:
    """Pan-and-scan crops per image under the processor's settings (its defaults, which
    win over the image processor's, then `kwargs`)."""
    settings = {**getattr(processor, "images_kwargs", {}), **kwargs}
    if not settings.get("do_pan_and_scan"):
        return [0] * len(images)
    return [
        len(
            pan_and_scan_crops(
                image.width,
                image.height,
                min_crop_size=settings["pan_and_scan_min_crop_size"],
                max_crops=settings["pan_and_scan_max_num_crops"],
                min_ratio=settings["pan_and_scan_min_ratio_to_activate"],
            )
        )  # fmt: skip
        for image in images
    ]


def eos_token_ids(path: str, config: dict, tokenizer: object) -> set[int]:
    """EOS ids from generation_config.json, else config.json, else the tokenizer."""
    sources = []
    gen_path = Path(path) / "generation_config.json"
    if gen_path.is_file():
        sources.append(json.loads(gen_path.read_text()).get("eos_token_id"))
    sources += [config.get("eos_token_id"), config.get("text_config", {}).get("eos_token_id")]
    sources.append(getattr(tokenizer, "eos_token_id", None))
    for value in sources:
        if value is not None:
            return set(value) if isinstance(value, list) else {int(value)}
    return set()
