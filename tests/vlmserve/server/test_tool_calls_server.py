"""Tool calls through a real `vlmserve serve` subprocess on loopback with the official
`openai` client (structured_testing.py's server): required and named calls parse against
their schemas, streamed == non-streamed, and tool_choice "auto": a guided_regex sent beside
it makes the random model write `<tool_call>` blocks (or text, or both), which the server
must parse, streamed and not; a tool-calling turn goes back through the chat template."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from openai import OpenAI

from tests.vlmserve.server.structured_testing import (
    SEARCH,
    WEATHER,
    Scene,
    client,
    messages,
    run_all,
    start_server,
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from start_server(tmp_path_factory)


MAX_TOKENS = 700


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
