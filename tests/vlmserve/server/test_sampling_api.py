"""Logprobs, n > 1 and the logit controls through a real server (uvicorn on loopback, the
`openai` client), against transformers' float32 logits of the same checkpoint: top
logprobs equal its log_softmax to 1e-5, greedy decoding with penalties and logit_bias
equals a reference loop over its logits, n choices equal separately seeded requests, and
n = 4 on a 2,000-token prompt holds little more KV than n = 1 (`peak_used_blocks`);
chat's prompt_logprobs (text and image prompts) equal its log_softmax to 1e-5."""

from __future__ import annotations

import base64
import contextlib
import io
from collections.abc import Iterator

import httpx
import pytest
import torch
from openai import OpenAI

from benchmarks.reliability.server import in_process_server
from scheduler.config import CacheConfig, SchedulerConfig
from tests.vlmserve.sample.test_controls import reference as controls_reference
from vlmserve.config import EngineConfig, ModelConfig
from vlmserve.engine.core import Engine
from vlmserve.sample.params import SamplerState, SamplingParams
from vlmserve.server.app import ServerConfig, create_app

MODEL = "tiny"


def engine_config(path, num_blocks: int = 1024, block_size: int = 4, async_: bool = True):
    return EngineConfig(
        ModelConfig(str(path)),
        CacheConfig(num_blocks=num_blocks, block_size=block_size),
        SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16, async_scheduling=async_),
    )


@contextlib.contextmanager
def serve(config: EngineConfig) -> Iterator[tuple[str, object]]:
    app = create_app(lambda: Engine(config), ServerConfig(model_name=MODEL))
    with in_process_server(app) as url:
        yield url, app


@pytest.fixture(scope="module")
def server(llava_ov_path) -> Iterator[str]:
    with serve(engine_config(llava_ov_path)) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def hf(llava_ov_path):
    """transformers' model and tokenizer for the same checkpoint, float32."""
    from transformers import AutoTokenizer, LlavaOnevisionForConditionalGeneration

    model = LlavaOnevisionForConditionalGeneration.from_pretrained(llava_ov_path).float().eval()
    return model, AutoTokenizer.from_pretrained(llava_ov_path)


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float32: the distribution after each position."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def hf_greedy(model, ids: list[int], steps: int, controls: SamplingParams | None = None):
    """Greedy tokens and each step's raw log_softmax row; with `controls`, the argmax of
    the controlled logits (the plain-torch reference of `controls.py`)."""
    ids, tokens, rows = list(ids), [], []
    state = None
    if controls is not None:
        state = SamplerState(controls)
        state.prompt_token_ids = tuple(ids)
    for _ in range(steps):
        logits = hf_logits(model, ids)[-1]
        rows.append(torch.log_softmax(logits, -1))
        if state is not None:
            logits = controls_reference(logits, state, tokens)
        tokens.append(int(logits.argmax()))
        ids.append(tokens[-1])
    return tokens, rows


def tokenize(server: str, **body) -> list[int]:
    response = httpx.post(server + "/tokenize", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def check_top(rows: torch.Tensor, tokenizer, top: list[tuple[str, float]], k: int) -> None:
    values, ids = rows.topk(k)
    assert [t for t, _ in top] == [tokenizer.decode([i]) for i in ids.tolist()]
    torch.testing.assert_close(torch.tensor([v for _, v in top]), values, atol=1e-5, rtol=0)


PROMPT = "where is the blue circle and how many are there on the left"


def test_chat_top_logprobs_equal_a_float32_log_softmax(server, client, hf):
    model, tokenizer = hf
    messages = [{"role": "user", "content": PROMPT}]
    ids = tokenize(server, messages=messages)
    tokens, rows = hf_greedy(model, ids, 4)
    kw = dict(model=MODEL, messages=messages, max_tokens=4, temperature=0, logprobs=True,
              top_logprobs=5, extra_body={"ignore_eos": True})  # fmt: skip
    answer = client.chat.completions.create(**kw)
    content = answer.choices[0].logprobs.content
    assert [c.token for c in content] == [tokenizer.decode([t]) for t in tokens]
    for entry, row, token in zip(content, rows, tokens, strict=True):
        assert abs(entry.logprob - float(row[token])) < 1e-5
        check_top(row, tokenizer, [(t.token, t.logprob) for t in entry.top_logprobs], 5)
    streamed = [
        c
        for chunk in client.chat.completions.create(**kw, stream=True)
        for choice in chunk.choices
        if choice.logprobs
        for c in choice.logprobs.content
    ]
    # The same to float32 rounding (the second run hits the prefix cache: other shapes).
    assert [c.token for c in streamed] == [c.token for c in content]
    for a, b in zip(streamed, content, strict=True):
        assert abs(a.logprob - b.logprob) < 1e-5


def test_completion_logprobs_and_echoed_prompt_logprobs(server, client, hf):
    """lm-eval's loglikelihood request: echo + logprobs scores every prompt token."""
    model, tokenizer = hf
    ids = tokenize(server, prompt=PROMPT)
    reference = torch.log_softmax(hf_logits(model, ids), -1)
    answer = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=3, temperature=0, logprobs=3, echo=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    lp = answer.choices[0].logprobs
    assert lp.token_logprobs[0] is None and lp.tokens[0] == tokenizer.decode([ids[0]])
    want = reference[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    got = torch.tensor(lp.token_logprobs[1 : len(ids)])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    for position in (1, len(ids) - 1):
        top = list(lp.top_logprobs[position].items())
        check_top(reference[position - 1], tokenizer, top, 3)
    tokens, rows = hf_greedy(model, ids, 3)
    assert lp.tokens[len(ids) :] == [tokenizer.decode([t]) for t in tokens]
    # vLLM's own field: per position {id: {logprob, rank, decoded_token}}.
    body = {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 1}
    scored = httpx.post(server + "/v1/completions", json=body, timeout=60).json()
    entries = scored["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    last = entries[-1][str(ids[-1])]
    assert abs(last["logprob"] - float(want[-1])) < 1e-5 and last["decoded_token"]
    stream = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=1, stream=True, extra_body={"prompt_logprobs": 1}
    )  # the choice's first chunk carries them
    assert list(stream)[0].choices[0].model_extra["prompt_logprobs"] == entries
    assert answer.choices[0].text.startswith(tokenizer.decode(ids))


def check_prompt_entries(entries: list, ids: list[int], reference: torch.Tensor, k: int) -> None:
    """vLLM's prompt_logprobs: None, then per position {id: {logprob, rank, decoded_token}}
    holding the prompt token and the k most likely, equal to `reference` (log_softmax,
    [len(ids), vocab]) to 1e-5."""
    assert entries[0] is None and len(entries) == len(ids)
    for i in range(1, len(ids)):
        row, entry = reference[i - 1], entries[i]
        mine = entry[str(ids[i])]
        assert abs(mine["logprob"] - float(row[ids[i]])) < 1e-5, i
        assert mine["rank"] == 1 + int((row > row[ids[i]]).sum()) and "decoded_token" in mine
        top = sorted((e["rank"], e["logprob"]) for e in entry.values() if e["rank"] <= k)
        torch.testing.assert_close(
            torch.tensor([lp for _, lp in top[:k]]), row.topk(k).values, atol=1e-5, rtol=0
        )


def test_chat_prompt_logprobs_text_and_image_equal_a_float32_log_softmax(
    server, client, hf, llava_ov_path, random_image
):
    """One entry per prompt token (vLLM's shape, at the top level), the image placeholder
    positions included; streamed in the first chunk; bad values a 400 (a non-integer 422)."""
    from transformers import AutoProcessor

    model, _ = hf
    image = random_image(4, 60, 40)
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    processor = AutoProcessor.from_pretrained(llava_ov_path)
    text_only = [{"role": "user", "content": PROMPT}]
    ids = tokenize(server, messages=text_only)
    cases = [(text_only, {"input_ids": torch.tensor([ids])})]
    template = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
    prompt = processor.apply_chat_template(template, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[prompt], images=[image], return_tensors="pt", add_special_tokens=False)
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": PROMPT}]
    cases.append(([{"role": "user", "content": parts}], dict(inputs)))
    for messages, hf_inputs in cases:
        with torch.no_grad():
            reference = torch.log_softmax(model(**hf_inputs).logits[0].float(), -1)
        ids = hf_inputs["input_ids"][0].tolist()
        kw = dict(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                  extra_body={"ignore_eos": True, "prompt_logprobs": 2})  # fmt: skip
        answer = client.chat.completions.create(**kw)
        entries = answer.model_extra["prompt_logprobs"]
        check_prompt_entries(entries, ids, reference, 2)
        chunks = list(client.chat.completions.create(**kw, stream=True))
        assert [c.model_extra.get("prompt_logprobs") is not None for c in chunks][:2] == [
            True, False,
        ]  # fmt: skip
        streamed = chunks[0].model_extra["prompt_logprobs"]
        check_prompt_entries(streamed, ids, reference, 2)
        assert "prompt_logprobs" not in client.chat.completions.create(**{
            **kw, "extra_body": {"ignore_eos": True}}).model_extra  # fmt: skip
    placeholder = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    positions = [i for i, t in enumerate(ids) if t == placeholder]
    assert len(positions) > 10  # each scores the placeholder's id, as vLLM's
    assert all(str(placeholder) in entries[i] for i in positions)
    for value, status in [(21, 400), (-1, 400), ("two", 422), (True, 422)]:
        body = {"messages": text_only, "max_tokens": 1, "prompt_logprobs": value}
        response = httpx.post(server + "/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == status, (value, response.text)
        assert "prompt_logprobs" in response.json()["error"]["message"], response.text


def test_penalties_and_logit_bias_equal_the_reference_on_transformers_logits(server, client, hf):
    model, tokenizer = hf
    ids = tokenize(server, prompt=PROMPT)
    bias_token, changed = ids[3], []
    for controls in [
        dict(presence_penalty=1.5, frequency_penalty=0.8),
        dict(repetition_penalty=1.7),
        dict(logit_bias={bias_token: 4.0}, repetition_penalty=0.7),
        dict(min_p=0.5, frequency_penalty=-0.5, logit_bias={ids[1]: -100.0}),
    ]:
        params = SamplingParams(max_tokens=8, temperature=0, **controls)
        tokens, _ = hf_greedy(model, ids, 8, params)
        plain, _ = hf_greedy(model, ids, 8)
        body = {k: v for k, v in controls.items() if k not in ("repetition_penalty", "min_p")}
        extra = {k: v for k, v in controls.items() if k in ("repetition_penalty", "min_p")}
        if "logit_bias" in body:
            body["logit_bias"] = {str(k): v for k, v in body["logit_bias"].items()}
        answer = client.completions.create(
            model=MODEL, prompt=ids, max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True, **extra}, **body,
        )  # fmt: skip
        assert answer.choices[0].text == tokenizer.decode(tokens), controls
        changed.append(tokens != plain)
    assert sum(changed) >= 2, changed  # the controls do change answers


def test_bad_words_and_min_tokens(server, client, hf):
    _, tokenizer = hf
    ids = tokenize(server, prompt=PROMPT)
    kw = dict(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    plain = client.completions.create(**kw, extra_body={"ignore_eos": True})
    first = plain.choices[0].text.split()[0]
    banned = client.completions.create(**kw, extra_body={"ignore_eos": True, "bad_words": [first]})
    assert first not in banned.choices[0].text.split()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    # EOS pushed to the top: it stops at once, unless min_tokens holds it back.
    early = dict(model=MODEL, prompt=ids, max_tokens=6, temperature=0,
                 logit_bias={str(eos): 100.0})  # fmt: skip
    assert client.completions.create(**early).usage.completion_tokens == 1
    held = client.completions.create(**early, extra_body={"min_tokens": 4})
    assert held.usage.completion_tokens == 5 and held.choices[0].finish_reason == "stop"


def test_n_choices_equal_separately_seeded_requests(client):
    """Choice i of a seeded n request draws with seed + i; streamed chunks carry index."""
    messages = [{"role": "user", "content": PROMPT}]
    kw = dict(model=MODEL, messages=messages, max_tokens=6, temperature=1.0,
              extra_body={"ignore_eos": True})  # fmt: skip
    answer = client.chat.completions.create(**kw, n=3, seed=11)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    alone = [client.chat.completions.create(**kw, seed=11 + i).choices[0] for i in range(3)]
    texts = [c.message.content for c in answer.choices]
    assert texts == [c.message.content for c in alone]
    assert len(set(texts)) > 1
    assert answer.usage.completion_tokens == 18
    streamed = {0: "", 1: "", 2: ""}
    for chunk in client.chat.completions.create(**kw, n=3, seed=11, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert list(streamed.values()) == texts


@pytest.mark.slow
def test_best_of_keeps_the_highest_cumulative_logprob(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=1.0, seed=5,
              extra_body={"ignore_eos": True})  # fmt: skip
    best = client.completions.create(**kw, n=1, best_of=3, logprobs=0)
    every = client.completions.create(**kw, n=3, logprobs=0)
    sums = [sum(c.logprobs.token_logprobs) for c in every.choices]
    winner = every.choices[max(range(3), key=sums.__getitem__)]
    assert best.choices[0].text == winner.text


@pytest.mark.slow
def test_n4_on_a_long_prompt_holds_little_more_kv_than_n1(llava_ov_path):
    """The choices share the prompt's blocks (held until choice 0's prefill is done)."""
    prompt = " ".join(f"w{i % 50}" for i in range(2000))
    peaks = []
    for n in (1, 4):
        config = engine_config(llava_ov_path, num_blocks=2048, block_size=16)
        with serve(config) as (url, app):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "n": n,
                    "temperature": 1.0, "ignore_eos": True}  # fmt: skip
            response = httpx.post(url + "/v1/completions", json=body, timeout=300)
            assert response.status_code == 200, response.text
            assert len(response.json()["choices"]) == n
            metrics = httpx.get(url + "/metrics").text
            line = next(
                x for x in metrics.splitlines() if x.startswith("vlmserve_kv_blocks_used_peak ")
            )
            peaks.append(float(line.split()[-1]))
    assert peaks[0] >= 2000 / 16
    print(f"peak KV blocks, n=1 vs n=4: {peaks}")
    assert peaks[1] <= 1.25 * peaks[0], peaks


def test_completions_prompts_echo_and_refusals(server, client):
    ids = tokenize(server, prompt=PROMPT)
    kw = dict(model=MODEL, max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    by_text = client.completions.create(prompt=PROMPT, **kw).choices[0].text
    assert client.completions.create(prompt=ids, **kw).choices[0].text == by_text
    many = client.completions.create(prompt=[PROMPT, "one two", PROMPT], n=2, **kw)
    assert [c.index for c in many.choices] == list(range(6))
    assert many.choices[4].text == by_text == many.choices[5].text  # greedy: the same
    echoed = client.completions.create(prompt=PROMPT, echo=True, **kw).choices[0].text
    assert echoed == PROMPT + by_text
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(prompt=PROMPT, stream=True, **kw)
        if c.choices
    )  # fmt: skip
    assert streamed == by_text
    for body, status, word in [
        ({"prompt": PROMPT, "suffix": "end"}, 400, "suffix"),
        ({"prompt": []}, 400, "empty"),
        ({"prompt": [10**9]}, 400, "prompt_token_ids"),
        ({"prompt": PROMPT, "logprobs": 21}, 400, "logprobs"),
        ({"prompt": PROMPT, "n": 2, "best_of": 1}, 400, "best_of"),
        ({"prompt": PROMPT, "logit_bias": {"x": 1}}, 400, "logit_bias"),
        ({"prompt": PROMPT, "logit_bias": {"99999999": 1}}, 400, "vocabulary"),
        ({"prompt": PROMPT, "presence_penalty": 3}, 400, "presence_penalty"),
        ({"prompt": PROMPT, "stream": True, "best_of": 2}, 400, "best_of"),
        ({"prompt": 5}, 422, "prompt"),
    ]:
        response = httpx.post(server + "/v1/completions", json=body, timeout=60)
        assert response.status_code == status, (body, response.text)
        assert word in response.json()["error"]["message"], (body, response.text)


def test_tokenize_detokenize_version(server, hf):
    _, tokenizer = hf
    ids = tokenize(server, prompt=PROMPT)
    assert ids == tokenizer(PROMPT).input_ids
    chat_ids = tokenize(server, messages=[{"role": "user", "content": PROMPT}])
    assert len(chat_ids) > len(ids)
    response = httpx.post(server + "/detokenize", json={"tokens": ids}, timeout=60)
    assert response.json()["prompt"] == tokenizer.decode(ids)
    bad = httpx.post(server + "/detokenize", json={"tokens": [-1]}, timeout=60)
    assert bad.status_code == 400 and "tokens" in bad.json()["error"]["message"]
    both = httpx.post(server + "/tokenize", json={"prompt": "a", "messages": []}, timeout=60)
    assert both.status_code == 400
    version = httpx.get(server + "/version", timeout=60)
    assert version.status_code == 200 and version.json()["version"]
