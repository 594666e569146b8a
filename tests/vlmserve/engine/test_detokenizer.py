"""Incremental detokenisation against the tokenizer's own full decode: byte-level tokens
that split a UTF-8 character, word-level tokens, stop strings straddling tokens, and the
deltas a stream hands out."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from vlmserve.embedded import DEFAULT_MODEL_DIR
from vlmserve.engine.detokenizer import IncrementalDetokenizer, direct_decoder

TEXT = "héllo wörld ✓ 日本語 — naïve café, ok?"


@pytest.fixture(scope="module")
def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE with no merges: every byte is its own token, so every non-ASCII
    character spans several tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core)


def feed(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add(token) for token in ids]


def test_byte_level_tokens_that_split_characters(byte_tokenizer):
    ids = byte_tokenizer(TEXT)["input_ids"]
    assert len(ids) > len(TEXT)  # multi-byte characters really are split
    detok = IncrementalDetokenizer(byte_tokenizer)
    deltas = feed(detok, ids)
    assert "".join(deltas) == detok.text == byte_tokenizer.decode(ids) == TEXT
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # some tokens complete no character
    # Each delta is whole characters: the text so far always decodes cleanly.
    assert all(TEXT.startswith("".join(deltas[: i + 1])) for i in range(len(deltas)))


def test_word_level_tokens_match_the_full_decode():
    tokenizer = PreTrainedTokenizerFast.from_pretrained(DEFAULT_MODEL_DIR)
    words = "there is a red circle in the top left of the image ."
    ids = tokenizer(words, add_special_tokens=False)["input_ids"]
    ids = [*ids[:3], tokenizer.convert_tokens_to_ids("<image>"), *ids[3:]]  # a special
    detok = IncrementalDetokenizer(tokenizer)
    deltas = feed(detok, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)


def test_stop_string_straddling_tokens_cuts_the_text(byte_tokenizer):
    ids = byte_tokenizer(TEXT)["input_ids"]
    detok = IncrementalDetokenizer(byte_tokenizer, stop=("wör", "never"))
    deltas = feed(detok, ids)
    assert detok.stopped and detok.text == "héllo "
    # Tokens after the match add nothing.
    assert deltas[-1] == "" and detok.add(ids[0]) == ""


def test_streamed_deltas_hold_back_a_possible_stop_start(byte_tokenizer):
    stop = ("日本語 —",)
    ids = byte_tokenizer(TEXT)["input_ids"]
    detok = IncrementalDetokenizer(byte_tokenizer, stop=stop)
    streamed = []
    for token in ids:
        detok.add(token)
        delta = detok.take_delta(finished=detok.stopped)
        # Nothing handed out is ever cut later: it is a prefix of the final text.
        streamed.append(delta)
        if detok.stopped:
            break
    assert "".join(streamed) == detok.text == TEXT[: TEXT.index("日本語")]
    # Without the holdback the "日本" would have gone out before the stop matched.
    unheld = IncrementalDetokenizer(byte_tokenizer)
    sent = ""
    for token in ids:
        sent += unheld.add(token)
        if sent.endswith("日本"):
            break
    assert not detok.text.endswith("日本") and sent.endswith("日本")


def test_stop_string_is_found_only_once_it_completes(byte_tokenizer):
    ids = byte_tokenizer("abcabd")["input_ids"]
    detok = IncrementalDetokenizer(byte_tokenizer, stop=("abd",))
    feed(detok, ids)
    assert detok.text == "abc" and detok.stopped


def test_min_tokens_lets_no_stop_string_end_in_the_first_tokens(byte_tokenizer):
    """vLLM's rule: a stop string counts once it ends after the first min_tokens tokens'
    text, so "l" (the 3rd and 4th bytes) is passed over and the next "l" stops it."""
    text = "hello world"
    ids = byte_tokenizer(text)["input_ids"]
    early = IncrementalDetokenizer(byte_tokenizer, stop=("l",))
    feed(early, ids)
    assert early.text == "he"
    held = IncrementalDetokenizer(byte_tokenizer, stop=("l",), min_tokens=4)
    feed(held, ids)
    assert held.stopped and held.text == "hello wor"
    straddling = IncrementalDetokenizer(byte_tokenizer, stop=("lo",), min_tokens=4)
    feed(straddling, ids)  # "lo" starts in the first 4 tokens and ends after them
    assert straddling.text == "hel"


def test_direct_decoder_gives_the_tokenizers_own_text(byte_tokenizer):
    """The Rust decoder stands in only where transformers' decode returns its text: the
    same deltas and text on split characters, specials skipped, and the tokenizer itself
    kept where a clean-up pass would change the text."""
    words = PreTrainedTokenizerFast.from_pretrained(DEFAULT_MODEL_DIR)
    special = words.convert_tokens_to_ids("<image>")
    word_ids = words("there is a red circle .", add_special_tokens=False)["input_ids"]
    for tokenizer, ids in ((byte_tokenizer, byte_tokenizer(TEXT)["input_ids"]),
                           (words, [*word_ids[:2], special, *word_ids[2:]])):  # fmt: skip
        fast = direct_decoder(tokenizer)
        assert fast is not tokenizer
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == tokenizer.decode(
                ids, skip_special_tokens=skip
            )
        want = IncrementalDetokenizer(tokenizer, stop=("never",))
        got = IncrementalDetokenizer(fast, stop=("never",))
        assert feed(got, ids) == feed(want, ids) and got.text == want.text
    words.clean_up_tokenization_spaces = True
    assert direct_decoder(words) is words
