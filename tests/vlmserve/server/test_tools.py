"""Tool plans and tool-call parsing (the server side of `tools` / `tool_choice`)."""

from __future__ import annotations

import json

import pytest

from vlmserve.server.constraints import structured_of
from vlmserve.server.tools import ToolStream, message_of, parse_calls, plan_tools

F = {
    "type": "function",
    "function": {
        "name": "f",
        "parameters": {
            "type": "object",
            "properties": {"x": {"type": "integer"}},
            "required": ["x"],
        },
    },
}
G = {"type": "function", "function": {"name": "g"}}
TEMPLATE_WITH_CALLS = "{% for t in tools %}{{ t }}{% endfor %} <tool_call> </tool_call>"
# fmt: skip


def test_plans_for_each_tool_choice():
    assert plan_tools({}, None) is None
    assert plan_tools({"tools": [F], "tool_choice": "none"}, None).structured is None
    named = plan_tools({"tools": [F, G], "tool_choice": {"type": "function",
                        "function": {"name": "f"}}}, None)  # fmt: skip
    assert named.mode == "named" and json.loads(named.structured.spec)["required"] == ["x"]
    required = plan_tools({"tools": [F, G], "tool_choice": "required"}, None)
    schema = json.loads(required.structured.spec)
    assert [s["properties"]["name"]["const"] for s in schema["items"]["anyOf"]] == ["f", "g"]
    assert "maxItems" not in schema
    single = plan_tools(
        {"tools": [F], "tool_choice": "required", "parallel_tool_calls": False}, None
    )
    assert json.loads(single.structured.spec)["maxItems"] == 1
    assert plan_tools({"tools": [F]}, TEMPLATE_WITH_CALLS).mode == "auto"  # the default


def test_auto_without_a_tool_call_format_is_refused_naming_it():
    with pytest.raises(ValueError, match="auto.*tool-call format.*required"):
        plan_tools({"tools": [F]}, "{{ messages }}")


@pytest.mark.parametrize(
    "extra, needle",
    [
        ({"tools": "f"}, "list"),
        ({"tools": [{"type": "retrieval"}]}, "function"),
        ({"tools": [F, F]}, "twice"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}, "schema"),
        ({"tools": [F], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "'g'"),
        ({"tool_choice": "required"}, "needs tools"),
    ],
)
def test_malformed_tools_name_the_problem(extra, needle):
    with pytest.raises(ValueError, match=needle):
        plan_tools({"tool_choice": "required", **extra}, TEMPLATE_WITH_CALLS)


def test_parse_auto_blocks_and_keep_the_rest_as_content():
    plan = plan_tools({"tools": [F]}, TEMPLATE_WITH_CALLS)
    text = (
        'Sure. <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
        '<tool_call>{"name": "g", "arguments": "{}"}</tool_call><tool_call>not json</tool_call>'
    )
    content, calls = parse_calls(plan, text)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("f", {"x": 1}), ("g", {})]  # fmt: skip
    assert content == "Sure. <tool_call>not json</tool_call>"
    assert message_of(plan, "no calls here") == (
        {"role": "assistant", "content": "no calls here"},
        False,
    )


def test_named_stream_sends_arguments_as_they_come():
    plan = plan_tools({"tools": [F], "tool_choice": {"type": "function",
                       "function": {"name": "f"}}}, None)  # fmt: skip
    stream = ToolStream(plan)
    first, second = stream.delta('{"x": '), stream.delta("4}")
    assert first["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x": '}
    assert first["tool_calls"][0]["id"].startswith("call_")
    assert second == {"tool_calls": [{"index": 0, "function": {"arguments": "4}"}}]}
    assert stream.final() is None


def test_required_cut_by_max_tokens_stays_content():
    plan = plan_tools({"tools": [F], "tool_choice": "required"}, None)
    assert parse_calls(plan, '[{"name": "f", "argu') == ('[{"name": "f", "argu', [])


def test_constraint_fields():
    assert structured_of({}) is None
    assert structured_of({"response_format": {"type": "text"}}) is None
    assert structured_of({"response_format": {"type": "json_object"}}).kind == "json_object"
    spec = structured_of({"guided_json": '{"type": "object"}'})
    assert spec.kind == "json" and json.loads(spec.spec) == {"type": "object"}
    assert structured_of({"structured_outputs": {"choice": ["a", "b"]}}).choices == ["a", "b"]
    assert structured_of({"guided_grammar": 'root ::= "a"'}).kind == "grammar"
    with pytest.raises(ValueError, match="guided_choice: choice must be a list"):
        structured_of({"guided_choice": "a"})
    with pytest.raises(ValueError, match="unknown fields"):
        structured_of({"structured_outputs": {"regex": "a", "structural_tag": {}}})
