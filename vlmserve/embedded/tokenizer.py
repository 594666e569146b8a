"""Word-level tokenizer of the embedded model: the scene generator's vocabulary + specials."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from vlmserve.embedded.scenes import vocabulary

PAD_TOKEN = "<pad>"
UNK_TOKEN = "<unk>"
END_TOKEN = "<end>"  # ends every turn; the end-of-sequence token for generation
IMAGE_TOKEN = "<image>"  # one per visual token (9 per 48-px tile)
IMAGE_START_TOKEN = "<img_start>"
IMAGE_END_TOKEN = "<img_end>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (
    PAD_TOKEN,
    UNK_TOKEN,
    END_TOKEN,
    *ROLE_TOKENS,
    IMAGE_START_TOKEN,
    IMAGE_END_TOKEN,
    IMAGE_TOKEN,
)
# Instruction words beyond the scene vocabulary (the caption prompt).
EXTRA_WORDS = ("describe", "image", "a", "an", "this", "of", "please")

# Each image appears in the rendered template as one IMAGE_TOKEN; the processor expands it
# to IMAGE_START_TOKEN + tokens_per_tile * num_tiles IMAGE_TOKEN + IMAGE_END_TOKEN.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "<|{{ message['role'] }}|>"
    "{%- if message['content'] is string %} {{ message['content'] }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' %} <image>"
    "{%- elif item['type'] == 'text' %} {{ item['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif %} <end>\n"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Lower-cased WordLevel tokenizer; punctuation splits off words ('star?' -> star, ?)."""
    words = sorted(set(vocabulary()) | set(EXTRA_WORDS))
    vocab = {token: index for index, token in enumerate([*SPECIAL_TOKENS, *words])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=True)  # joins with spaces, tidies
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        eos_token=END_TOKEN,
        extra_special_tokens={"image_token": IMAGE_TOKEN},
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
