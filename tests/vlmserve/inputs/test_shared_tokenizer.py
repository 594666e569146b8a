"""Tokenising on several threads with nothing made on a request's path
(vlmserve/inputs/shared_tokenizer.py): the pool of ready copies, the direct Rust encode
path and its equality with the tokenizer's own ids, and the prompt processor using them."""

from __future__ import annotations

import copy
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from transformers import AutoTokenizer

from tests.helpers import make_engine
from vlmserve.inputs.processing import Request
from vlmserve.inputs.shared_tokenizer import CopyPool, direct_encoder


class Counted:
    """Counts its deep copies (every one made, by any thread)."""

    made = 0

    def __deepcopy__(self, memo):
        Counted.made += 1
        return Counted()


def test_a_filled_pool_never_copies_on_borrow():
    Counted.made = 0
    pool = CopyPool(Counted(), size=3)
    pool.fill()
    assert Counted.made == 3 == pool.num_made
    seen = set()
    for _ in range(10):
        with pool.borrow() as mine:
            seen.add(id(mine))
    assert Counted.made == 3 and len(seen) <= 3


def test_borrowers_at_once_get_distinct_copies_and_wait_past_the_size():
    pool = CopyPool({"vocab": [1, 2, 3]}, size=2)
    pool.fill()
    held, entered = [], threading.Event()
    release = threading.Event()

    def hold():
        with pool.borrow() as mine:
            held.append(mine)
            if len(held) == 2:
                entered.set()
            release.wait(10)

    threads = [threading.Thread(target=hold) for _ in range(3)]
    for thread in threads:
        thread.start()
    assert entered.wait(10)
    time.sleep(0.1)
    assert len(held) == 2 and held[0] is not held[1]  # the third waits for one back
    release.set()
    for thread in threads:
        thread.join(10)
    assert len(held) == 3 and pool.num_made == 2 and held[2] in held[:2]


def test_an_unfilled_pool_copies_on_first_use_up_to_its_size():
    Counted.made = 0
    pool = CopyPool(Counted(), size=2)
    with pool.borrow():
        with pool.borrow():
            pass
    assert Counted.made == 2


TEXTS = ["red circle left", "Hello, world!  two spaces\nnew line", "naïve café 東京 🙂", ""]


def with_bos(tokenizer):
    """`tokenizer` adding its BOS in front when asked to (as Gemma's and Llama's do)."""
    from tokenizers.processors import TemplateProcessing

    bos = tokenizer.convert_tokens_to_ids("<s>")
    special = [("<s>", bos)]
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=special
    )
    assert tokenizer("red")["input_ids"][0] == bos  # the processor is on
    return tokenizer


@pytest.mark.parametrize("fixture", ["llama_path", "gemma3_path", "idefics3_path", "bos"])
def test_the_direct_encoder_gives_the_tokenizers_ids(fixture, request):
    if fixture == "bos":
        tokenizer = with_bos(AutoTokenizer.from_pretrained(request.getfixturevalue("llama_path")))
    else:
        tokenizer = AutoTokenizer.from_pretrained(request.getfixturevalue(fixture))
    encoder = direct_encoder(tokenizer)
    assert encoder is not None, f"{type(tokenizer).__name__}: no direct path"
    specials = " ".join(tokenizer.all_special_tokens)
    for text in [*TEXTS, f"{specials} between {specials}"]:
        for add_special in (False, True):
            want = tokenizer(text, add_special_tokens=add_special)["input_ids"]
            assert encoder(text, add_special) == want, (text, add_special)


def test_the_direct_encoder_is_refused_for_a_tokenizer_with_its_own_encoding(llama_path):
    tokenizer = AutoTokenizer.from_pretrained(llama_path)
    cls = type(tokenizer)

    def shouting(self, text, **kw):
        return cls._encode_plus(self, text.upper() if isinstance(text, str) else text, **kw)

    tokenizer.__class__ = type("Shouting", (cls,), {"_encode_plus": shouting})
    assert direct_encoder(tokenizer) is None


def test_threads_encode_at_once_with_one_encoder(gemma3_path):
    tokenizer = AutoTokenizer.from_pretrained(gemma3_path)
    encoder = direct_encoder(tokenizer)
    texts = [f"{text} number {i}" * (1 + i % 7) for i in range(400) for text in TEXTS[:3]]
    want = [tokenizer(text, add_special_tokens=True)["input_ids"] for text in texts]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda text: encoder(text, True), texts))
    assert got == want


def test_processing_makes_no_tokenizer_copy_after_start(gemma3_path, monkeypatch):
    """The engine's prompt processor tokenises from any thread without a deep copy: the
    direct path where it applies, else copies the warm-up made."""
    from transformers import PreTrainedTokenizerFast

    engine = make_engine(gemma3_path)
    copies = []

    def counted_deepcopy(self, memo):
        copies.append(type(self).__name__)
        cls, args, state, *rest = self.__reduce_ex__(4)
        return copy._reconstruct(self, memo, cls, args, state, *rest)

    monkeypatch.setattr(PreTrainedTokenizerFast, "__deepcopy__", counted_deepcopy, raising=False)
    with ThreadPoolExecutor(4) as pool:
        prompts = list(pool.map(lambda i: engine.prepare(Request(prompt=f"red {i}")), range(8)))
    assert all(p.prompt.token_ids for p in prompts) and copies == []

    engine.processor._encoder = None  # the copies' path: made by `warm`, before serving
    engine.processor._tokenizers = CopyPool(engine.processor.tokenizer)
    made = engine.processor.warm()
    assert list(made) == ["tokenizer copies x4"] and len(copies) == 4
    with ThreadPoolExecutor(4) as pool:
        again = list(pool.map(lambda i: engine.prepare(Request(prompt=f"red {i}")), range(8)))
    assert [p.prompt.token_ids for p in again] == [p.prompt.token_ids for p in prompts]
    assert len(copies) == 4
