"""Structured outputs and tool calls through a real `vlmserve serve` subprocess on
loopback, with the official `openai` client: pydantic `parse` on every request at
temperature 1 (images included), regex and choice always matching, tool calls parsing
against their schemas, streamed == non-streamed, and bad specs answered 4xx.

The checkpoint is a random LLaVA-OneVision with a byte-level BPE tokenizer (it can write
any text; the word-level one cannot write JSON) and a chat template that renders tools
and defines the `<tool_call>` format (so "auto" is served). Its answers are noise that
the grammar shapes. Termination: every schema here is bounded (strings with maxLength,
integers with a range, arrays with maxItems), so the longest valid answer is a few
hundred bytes and max_tokens=MAX_TOKENS (> that many byte tokens) always lets the
grammar close: the tests assert finish_reason "stop", never "length" (json_object, any
object, is unbounded: there most answers must close, and every one that closed must parse).
In tool_choice "auto" the model is unconstrained; a guided_regex sent beside it makes the
random model write `<tool_call>` blocks, which the server must parse."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.vlmserve.server.structured_testing import (
    WEATHER,
    Scene,
    client,
    messages,
    run_all,
    start_server,
)

MAX_TOKENS = 700
NUM_PARSE = 56  # >= 50 pydantic parses at temperature 1


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from start_server(tmp_path_factory)


def test_pydantic_parse_every_time_at_temperature_1(server):
    api = client(server)

    def parse(seed: int):
        return api.beta.chat.completions.parse(
            model="rel", messages=messages(seed, image=seed % 2 == 0), response_format=Scene,
            temperature=1.0, seed=seed, max_tokens=MAX_TOKENS,
        )  # fmt: skip

    answers = run_all(parse, range(NUM_PARSE))
    for answer in answers:
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Scene)
    # The answers are the random model's, not one fixed object.
    assert len({a.choices[0].message.content for a in answers}) > NUM_PARSE // 2
    assert any(a.usage.prompt_tokens_details.image_tokens for a in answers)  # images went in


@pytest.mark.parametrize(
    "field, value, check",
    [
        ("guided_regex", r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)", "regex"),
        ("structured_outputs", {"regex": r"\d{3}-[A-Z]{2}"}, "regex"),
        ("guided_choice", ["yes", "no", 'say "maybe"'], "choice"),
        ("structured_outputs", {"choice": ["α", "β γ"]}, "choice"),
    ],
)
def test_regex_and_choice_always_match(server, field, value, check):
    api = client(server)
    pattern = value["regex"] if isinstance(value, dict) and "regex" in value else value
    choices = value["choice"] if isinstance(value, dict) and "choice" in value else value

    def ask(seed: int):
        return api.chat.completions.create(
            model="rel", messages=messages(seed, image=False), temperature=1.0, seed=seed,
            max_tokens=64, extra_body={field: value},
        )  # fmt: skip

    answers = run_all(ask, range(20))
    texts = [a.choices[0].message.content for a in answers]
    assert all(a.choices[0].finish_reason == "stop" for a in answers)
    if check == "regex":
        assert all(re.fullmatch(pattern, t) for t in texts), texts
    else:
        assert set(texts) <= set(choices), texts
        assert len(set(texts)) > 1  # temperature 1 picks more than one


@pytest.mark.parametrize("strict", [False, True])
def test_json_object_and_json_schema_strict_or_not(server, strict):
    """A json_schema answer follows its schema whether `strict` is true or false (the
    server reads no `strict`: it always constrains, extra properties refused as strict
    mode does); json_object answers are JSON objects, every one that finished."""
    api = client(server)
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": strict}}

    def ask(seed: int):
        return api.chat.completions.create(
            model="rel", messages=messages(seed, image=False), max_tokens=MAX_TOKENS,
            seed=seed, temperature=1.0, response_format=fmt,
        )  # fmt: skip

    for answer in run_all(ask, range(8)):
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        value = json.loads(choice.message.content)
        assert set(value) == {"a"} and value["a"] in (1, 2), value
    if strict:
        return

    def ask_object(seed: int):
        return api.chat.completions.create(
            model="rel", messages=messages(seed, image=False), max_tokens=MAX_TOKENS,
            seed=seed, temperature=1.0, response_format={"type": "json_object"},
        )  # fmt: skip

    # Any object is unbounded: a string may run long, so most (measured: all 16 at
    # temperature 1, up to 204 tokens) but not necessarily every answer closes within
    # MAX_TOKENS. Every one that closed is an object; one cut is cut at MAX_TOKENS.
    answers = run_all(ask_object, range(16))
    closed = [a for a in answers if a.choices[0].finish_reason == "stop"]
    assert len(closed) >= 12, [a.choices[0].finish_reason for a in answers]
    for answer in answers:
        text = answer.choices[0].message.content
        assert text.startswith("{")
        if answer not in closed:
            assert answer.choices[0].finish_reason == "length"
            assert answer.usage.completion_tokens == MAX_TOKENS
    objects = [json.loads(a.choices[0].message.content) for a in closed]
    assert all(isinstance(o, dict) for o in objects)
    assert any(o for o in objects)  # not only {}: the model wrote members too


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
      "schema": {"type": "objekt"}}}}, "objekt"),
    ({"guided_json": {"type": "integer", "minimum": 5, "maximum": 2}}, "minimum"),
    ({"guided_regex": "(ab"}, "parenthesis"),
    ({"structured_outputs": {"grammar": "root ::= foo"}}, "foo"),
    ({"guided_choice": []}, "choice"),
    ({"response_format": {"type": "xml"}}, "xml"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "only one"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}],
      "tool_choice": "required"}, "name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "nope"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "both"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nah"}}}],
      "tool_choice": "required"}, "nah"),
]  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
def test_bad_specs_are_4xx_with_a_message(server, stream):
    for extra, needle in BAD:
        body = {"messages": messages(0, image=False), "max_tokens": 8, "stream": stream, **extra}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        assert needle in r.json()["error"]["message"], (extra, r.text)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_schema_fuzz_small_no_5xx_and_blocks_back(server):
    """A small run of the reliability suite's schema fuzz section."""
    import asyncio

    from benchmarks.reliability.common import count
    from benchmarks.reliability.fuzz_schema import _send_all, make_bodies

    before = server.settled_vitals()
    outcomes = asyncio.run(_send_all(server.url, make_bodies(48, seed=1), concurrency=4))
    c = count(outcomes)
    assert c["5xx"] == 0 and c["lost"] == 0 and c["unexpected"] == 0, [
        (o.label, o.status, o.message) for o in outcomes if o.verdict in ("5xx", "lost")
    ]
    assert all(o.message for o in outcomes if o.verdict == "4xx")
    assert c["ok"] > 0 and c["4xx"] > 0  # both kinds were sent
    assert server.settled_vitals().free_blocks == before.free_blocks
    assert server.integrity()["ok"]


def test_completions_endpoint_takes_the_same_constraints(server):
    """/v1/completions reads response_format and the guided_* fields too; n > 1 choices each
    follow the constraint (their own matcher)."""
    for extra, check in [
        ({"guided_regex": r"[a-d]{2,4}-\d"}, lambda t: re.fullmatch(r"[a-d]{2,4}-\d", t)),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "s", "schema": {"type": "object", "properties": {"k": {"enum": [1, 2]}},
                                    "required": ["k"]}}}},
         lambda t: json.loads(t)["k"] in (1, 2)),
    ]:  # fmt: skip
        body = {"prompt": "answer:", "max_tokens": 64, "temperature": 1.0, "seed": 5, "n": 3,
                **extra}  # fmt: skip
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert len(choices) == 3
        assert all(c["finish_reason"] == "stop" and check(c["text"]) for c in choices), choices
    bad = {"prompt": "x", "guided_regex": "(", "max_tokens": 4}
    r = httpx.post(server.url + "/v1/completions", json=bad, timeout=60)
    assert r.status_code == 400 and "regex" in r.json()["error"]["message"]
