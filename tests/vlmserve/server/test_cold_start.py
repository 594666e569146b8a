"""The first requests after /health turns 200 wait for nothing built on first use (issue
41; issue 38 part 5), on a real server (uvicorn on loopback, the openai client).

The checkpoint: a tiny random Llama with a 262,144-token byte-level vocabulary (Gemma 3's
size): its tokenizer's deep copy and xgrammar's tables for it take seconds here, as the
real checkpoint's do. Before the fix, each of the server's 4 preparer threads deep-copied
the tokenizer on its first request, the first logprobs request deep-copied it on the event
loop, and the first constrained request imported xgrammar, copied the tokenizer and built
its tables while other requests waited.

Bounds are relative to the same server's latency once warm and idle, measured in the same
test: six concurrent first requests' first tokens within 2x the same six's once warm +
0.5 s; a 4-token request beside a grammar's compile within 2x its idle latency + 0.5 s
(the slack: a loaded 2-core machine's scatter, the compile's thread taking one of its two
cores; a fraction of the seconds the old path cost).
"""

from __future__ import annotations

import copy
import json
import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from scheduler.config import CacheConfig, SchedulerConfig
from tests.vlmserve.server.server_testing import KEY, MODEL, serve
from vlmserve.config import EngineConfig, ModelConfig
from vlmserve.engine.core import Engine
from vlmserve.sample.structured import StructuredConfig

pytestmark = pytest.mark.slow

VOCAB = 262_144
COPY_SLEEP_S = 5.0  # the stand-in's extra deep-copy time (a 262k tokenizer: ~2 s on a Xeon)
HEADERS = {"Authorization": f"Bearer {KEY}"}


def big_vocab_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer of `vocab_size` entries: the 256 byte tokens, 3 special
    tokens and random letter strings (no merges: any text encodes as bytes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for special in ("<pad>", "<s>", "</s>"):
        vocab[special] = len(vocab)
    rng = random.Random(0)
    while len(vocab) < vocab_size:
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyzĠ") for _ in range(rng.randint(2, 9)))
        vocab.setdefault(word, len(vocab))
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


@pytest.fixture(scope="module")
def big_vocab_path(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("big_vocab")
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        tie_word_embeddings=True, pad_token_id=256, bos_token_id=257, eos_token_id=258,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)
    big_vocab_tokenizer(VOCAB).save_pretrained(path)
    return path


def engine_factory(path):
    config = EngineConfig(
        ModelConfig(str(path)),
        CacheConfig(num_blocks=1024, block_size=16),
        SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16),
        structured=StructuredConfig(compile_timeout_s=300),  # the big choice never times out
        warmup=True,  # as `serve` runs it
        warmup_max_seconds=5,
    )
    return lambda: Engine(config)


@pytest.fixture
def slow_copies(monkeypatch):
    """The tokenizer class's deep copy, COPY_SLEEP_S slower (a stand-in for a big one)."""
    from transformers import PreTrainedTokenizerFast

    def slow_deepcopy(self, memo):
        time.sleep(COPY_SLEEP_S)
        cls, args, state, *rest = self.__reduce_ex__(4)
        return copy._reconstruct(self, memo, cls, args, state, *rest)

    monkeypatch.setattr(PreTrainedTokenizerFast, "__deepcopy__", slow_deepcopy, raising=False)


def completion(url: str, prompt: str, max_tokens: int = 4, **extra) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **extra}  # fmt: skip
    response = httpx.post(url + "/v1/completions", json=body, headers=HEADERS, timeout=600)
    assert response.status_code == 200, response.text
    return response.json()


def first_token_s(url: str, prompt: str, **extra) -> float:
    """Seconds from sending a streamed completion to its first chunk with text."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "stream": True, **extra}  # fmt: skip
    start = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=HEADERS,
                      timeout=600) as response:  # fmt: skip
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                return time.perf_counter() - start
    raise AssertionError("the stream ended without a token")


def latency_s(url: str, prompt: str, **extra) -> float:
    start = time.perf_counter()
    completion(url, prompt, **extra)
    return time.perf_counter() - start


def test_first_requests_after_start_wait_for_no_tokenizer_copy(big_vocab_path, slow_copies):
    """Six concurrent streamed completions (one with logprobs) sent as /health turns 200:
    the slowest first token within 2x the slowest of the same six sent again once warm,
    + 0.5 s. Before the fix each waited for its preparer thread's deep copy (COPY_SLEEP_S
    + the copy itself), and the logprobs one for a copy made on the event loop."""
    prompts = [f"request {i} asks about the colour of the sky" for i in range(6)]
    extras = [{"logprobs": 2}] + [{}] * (len(prompts) - 1)

    def together(url: str) -> list[float]:
        with ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(lambda p, e: first_token_s(url, p, **e), prompts, extras))

    with serve(engine_factory(big_vocab_path)) as served:
        firsts = together(served.base_url)
        warm = statistics.median(max(together(served.base_url)) for _ in range(3))
    bound = 2 * warm + 0.5
    print(f"first tokens {[round(s, 3) for s in firsts]} s; warm {warm:.3f} s, bound {bound:.3f}")
    assert max(firsts) <= bound, (firsts, warm)


def test_a_short_request_is_not_held_up_by_grammar_work(big_vocab_path):
    """A 4-token request sent beside the first constrained request after start finishes
    within 2x the idle latency + 0.5 s; so do 4-token requests sent one after another
    while a 20,000-option choice compiles (their median; none past twice the bound).
    Before the fix the first constrained request imported xgrammar, copied the tokenizer
    and built its tables meanwhile; a compile on the engine thread would hold every
    request for its length."""
    with serve(engine_factory(big_vocab_path)) as served:
        url = served.base_url
        idle = statistics.median(latency_s(url, f"idle request {i}") for i in range(5))
        bound = 2 * idle + 0.5

        # The first constrained request after start, a short one beside it.
        # (a constraint quick to compile: the first one's cost is what is measured here)
        yes_no = {"structured_outputs": {"choice": ["yes", "no"]}}
        with ThreadPoolExecutor(2) as pool:
            constrained = pool.submit(completion, url, "yes or no", 8, **yes_no)
            time.sleep(0.05)  # its preparation under way
            beside = latency_s(url, "a short one beside it")
            assert constrained.result()["choices"][0]["text"] in ("yes", "no")

        # A 20,000-option choice compiling: short requests one after another meanwhile.
        rng = random.Random(1)
        options = [str(i) for i in range(16_000)] + [
            "".join(rng.choice("abcdefghij") for _ in range(6)) + str(i) for i in range(4_000)
        ]  # (the words: seconds to compile; digits alone compile in a fraction of one)
        choice = {"structured_outputs": {"choice": options}}
        done = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            started = time.perf_counter()
            compiling = pool.submit(completion, url, "choose", 24, **choice)
            compiling.add_done_callback(lambda _: done.set())
            during = []
            while not done.is_set():
                during.append(latency_s(url, f"short request {len(during)}"))
            answer = compiling.result()["choices"][0]["text"]
            compile_s = time.perf_counter() - started
    print(f"idle {idle:.3f} s, bound {bound:.3f} s; beside the first constrained {beside:.3f} s;"
          f" choice {compile_s:.1f} s, during it {[round(s, 3) for s in during]}")  # fmt: skip
    assert answer in options
    assert beside <= bound, (beside, idle)
    assert len(during) >= 3, f"the choice compiled in {compile_s:.2f} s: too soon to tell"
    # Typical within the bound, none past twice it: on a shared 2-core machine one of many
    # may meet a burst of other load; a stall would hold them for the compile's length.
    assert statistics.median(during) <= bound and max(during) <= 2 * bound, (during, idle)
