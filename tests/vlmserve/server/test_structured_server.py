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

import base64
import io
import json
import re
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from typing import Literal

import httpx
import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from benchmarks.reliability.server import ServerProcess
from vlmserve.worker.models.random_checkpoint import make_vlm_checkpoint

MAX_TOKENS = 700
NUM_PARSE = 56  # >= 50 pydantic parses at temperature 1
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|> system You may call: {% for t in tools %}"
    "{{ t['function']['name'] }} {{ t['function']['parameters'] | tojson }} {% endfor %}"
    'Answer with <tool_call> {"name": ..., "arguments": ...} </tool_call><|im_end|> '
    "{% endif %}{% for m in messages %}<|im_start|> {{ m['role'] }} "
    "{% if m['content'] is string %}{{ m['content'] }} {% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<image> "
    "{% else %}{{ p['text'] }} {% endif %}{% endfor %}{% endif %}"
    "{% for c in m['tool_calls'] or [] %}<tool_call> {{ c['function'] | tojson }} </tool_call> "
    "{% endfor %}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


class Colour(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Shape(BaseModel):
    kind: Literal["circle", "square", "star"]
    colour: Colour
    size: int = Field(ge=0, le=99)


class Scene(BaseModel):
    title: str = Field(max_length=12)
    shapes: list[Shape] = Field(max_length=3)
    tags: list[str] = Field(max_length=2)
    note: str | None = Field(default=None, max_length=8)
    count: int | None = Field(default=None, ge=-5, le=500)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"enum": ["c", "f"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit", "days"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "maxLength": 12},
                "top": {"type": "boolean"},
            },
            "required": ["query", "top"],
        },
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_vlm_checkpoint(
        tmp_path_factory.mktemp("ov_bytes"), "llava_onevision", vocab=512, tokenizer="bytes"
    )
    (path / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    args = ("--model", str(path), "--async-scheduling", "--max-num-seqs", "32")
    with ServerProcess(*args, "--block-size", "16", "--num-kv-blocks", "2048") as proc:
        yield proc


def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def png_url(seed: int) -> str:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(1, 255, (40, 60, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def messages(seed: int, image: bool = True) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": png_url(seed)}}] if image else []
    return [{"role": "user", "content": [*parts, {"type": "text", "text": f"describe {seed}"}]}]


def run_all(fn, seeds) -> list:
    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(fn, seeds))


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


def _check_call(call, tools_by_name):
    assert call.type == "function" and call.id.startswith("call_")
    params = tools_by_name[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), params)


@pytest.mark.parametrize("choice", ["required", "named"])
def test_tool_calls_parse_against_their_schemas(server, choice):
    api = client(server)
    tools = [WEATHER, SEARCH]
    by_name = {t["function"]["name"]: t for t in tools}
    tool_choice = (
        "required" if choice == "required"
        else {"type": "function", "function": {"name": "search"}}
    )  # fmt: skip

    def ask(seed: int):
        return api.chat.completions.create(
            model="rel", messages=messages(seed), tools=tools, tool_choice=tool_choice,
            parallel_tool_calls=seed % 2 == 0, temperature=1.0, seed=seed,
            max_tokens=MAX_TOKENS,
        )  # fmt: skip

    answers = run_all(ask, range(12))
    for seed, answer in enumerate(answers):
        choice_ = answer.choices[0]
        calls = choice_.message.tool_calls
        assert calls and choice_.message.content is None
        assert choice_.finish_reason == ("tool_calls" if choice == "required" else "stop")
        if seed % 2:  # parallel_tool_calls=False: one call
            assert len(calls) == 1
        for call in calls:
            _check_call(call, by_name)
            if choice == "named":
                assert call.function.name == "search"
    if choice == "required":  # the model picks among the tools
        assert {c.function.name for a in answers for c in a.choices[0].message.tool_calls} == set(
            by_name
        )


def _streamed(api: OpenAI, **kw) -> tuple[str, dict[int, dict], str]:
    content, calls, reason = "", {}, None
    for chunk in api.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"name": None, "arguments": ""})
            if call.function.name:
                entry["name"] = call.function.name
            entry["arguments"] += call.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    return content, calls, reason


@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": {"type": "json_schema",
                             "json_schema": {"name": "s", "schema": Scene.model_json_schema()}}},
        {"extra_body": {"guided_regex": r"[a-c]{1,5}!"}},
        {"tools": [WEATHER, SEARCH], "tool_choice": "required"},
        {"tools": [WEATHER],
         "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    ],
    ids=["schema", "regex", "required", "named"],
)  # fmt: skip
def test_streaming_agrees_with_non_streaming(server, extra):
    api = client(server)
    kw = dict(model="rel", messages=messages(7), temperature=1.0, seed=11, max_tokens=MAX_TOKENS)
    whole = api.chat.completions.create(**kw, **extra).choices[0]
    content, calls, reason = _streamed(api, **kw, **extra)
    assert reason == whole.finish_reason
    assert content == (whole.message.content or "")
    expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == expected


_CITY_CALL = (
    r'<tool_call> \{"name": "get_weather", "arguments": '
    r'\{"city": "[a-z]{1,8}", "unit": "[cf]", "days": [1-7]\}\} </tool_call>'
)
_SEARCH_CALL = (
    r'<tool_call> \{"name": "search", "arguments": '
    r'\{"query": "[a-z ]{1,12}", "top": (true|false)\}\} </tool_call>'
)
# What the model writes in "auto" (a regex makes the random model write it; "auto" is
# otherwise unconstrained), and what the server must make of it: (content, call names).
AUTO_CASES = {
    "one call after text": (r"Checking\. " + _CITY_CALL, "Checking.", ["get_weather"]),
    "two calls": (_CITY_CALL + " " + _SEARCH_CALL, None, ["get_weather", "search"]),
    "no call": (r"[a-z]{2,8}", "text", []),
    "a block that is not a call": (r'<tool_call> \{"oops": [1-9]\} </tool_call>', "text", []),
}


def _written(content: str | None, calls: list[tuple[str, str]]) -> str:
    """The text the model wrote, put back together from the parsed message."""
    blocks = [f'<tool_call> {{"name": "{n}", "arguments": {a}}} </tool_call>' for n, a in calls]
    return " ".join([content] * (content is not None) + blocks)


@pytest.mark.parametrize("case", list(AUTO_CASES))
def test_auto_renders_tools_and_parses_tool_call_blocks(server, case):
    """tool_choice "auto": the tools go through the chat template into the prompt, and the
    `<tool_call>` blocks the model writes come back as tool_calls (the text around them
    as content, finish_reason "tool_calls"), streamed (one chunk at the end) and not,
    alike; text with no call, or a block that is not a call, stays content."""
    api = client(server)
    regex, content, names = AUTO_CASES[case]
    tools = [WEATHER, SEARCH]
    by_name = {t["function"]["name"]: t for t in tools}
    kw = dict(model="rel", messages=messages(3), max_tokens=MAX_TOKENS, temperature=1.0,
              tools=tools, tool_choice="auto", extra_body={"guided_regex": regex})  # fmt: skip
    plain = api.chat.completions.create(model="rel", messages=messages(3), max_tokens=4)

    def ask(seed: int):
        return api.chat.completions.create(**kw, seed=seed), _streamed(api, **kw, seed=seed)

    arguments = set()
    for whole, (s_content, s_calls, s_reason) in run_all(ask, range(4)):
        # The template rendered the tools into the prompt.
        assert whole.usage.prompt_tokens > plain.usage.prompt_tokens + 20
        choice = whole.choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        assert [n for n, _ in calls] == names
        assert choice.finish_reason == ("tool_calls" if names else "stop")
        if content == "text":  # all of it: what the model wrote stays as it was
            assert re.fullmatch(regex, choice.message.content), choice.message.content
        else:
            assert choice.message.content == content
        assert re.fullmatch(regex, _written(choice.message.content, calls))
        for call in choice.message.tool_calls or []:
            _check_call(call, by_name)
            arguments.add(call.function.arguments)
        if len(calls) > 1:
            assert len({c.id for c in choice.message.tool_calls}) == len(calls)
        # Streamed: the same message and finish reason (the calls in one chunk at the end).
        assert s_reason == choice.finish_reason
        assert s_content == (choice.message.content or "")
        assert [(c["name"], c["arguments"]) for _, c in sorted(s_calls.items())] == calls
    assert len(arguments) > 1 or not names  # the model's arguments, not one fixed call


def test_a_tool_calling_turn_goes_back_through_the_template(server):
    """An assistant turn's tool_calls and the tool's answer reach the chat template (the
    prompt the engine runs holds both), and the server answers such a history."""
    api = client(server)
    history = [
        *messages(3),
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 C"},
    ]  # fmt: skip
    r = httpx.post(server.url + "/tokenize", json={"messages": history}, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(server.url + "/detokenize", json={"tokens": r.json()["tokens"]}, timeout=60)
    prompt = r.json()["prompt"]
    assert "<tool_call>" in prompt and "get_weather" in prompt and "Oslo" in prompt, prompt
    assert "tool 12 C" in prompt, prompt
    again = api.chat.completions.create(
        model="rel", messages=history, max_tokens=4, tools=[WEATHER]
    )
    assert again.choices[0].finish_reason in ("stop", "length")


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
