"""Tool calls: OpenAI's `tools` + `tool_choice`, and `tool_calls` in the answer.

- "required" and a named function are structured outputs over the tools' schemas, so any
  model returns valid calls: a named function's output is its arguments object; "required"
  is a JSON array of `{"name", "arguments"}` (one item when `parallel_tool_calls` is false).
- "auto" needs a chat template that defines a tool-call format: the tools go into the
  template, the model decides, and its `<tool_call>{"name": …, "arguments": …}</tool_call>`
  blocks (Hermes / Qwen 2.5 style) become `tool_calls`. Other templates get a 400 naming
  the limitation. "auto" and "none" generate unconstrained; "none" renders no tools.
Streaming: a named call's arguments stream as they are generated; "required" and "auto"
answers are parsed once complete and sent as one chunk (the text is not streamed).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from vlmserve.sample.structured import StructuredOutput

ToolMode = Literal["none", "auto", "required", "named"]
TOOL_CALL_TAG = "<tool_call>"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolPlan:
    """How a request with tools is answered."""

    mode: ToolMode
    tools: list[dict[str, Any]]  # OpenAI's tool objects, as the chat template takes them
    name: str | None = None  # the named function
    structured: StructuredOutput | None = None  # the constraint ("required", "named")

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        return None if self.mode == "none" else self.tools


def chat_template_of(engine: object) -> str | None:
    """The text of the engine's chat template (None: none, or no engine yet)."""
    processor = getattr(engine, "processor", None)
    for owner in (getattr(processor, "processor", None), getattr(processor, "tokenizer", None)):
        template = getattr(owner, "chat_template", None)
        if isinstance(template, str):
            return template
    return None


def plan_tools(extra: dict[str, Any], template: str | None) -> ToolPlan | None:
    """The plan for a request's `tools` / `tool_choice` (None without tools); ValueError
    (400) naming a malformed spec. `template`: the model's chat template text."""
    tools, choice = extra.get("tools"), extra.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ValueError("tool_choice needs tools")
        return None
    functions = _check_tools(tools)
    parallel = extra.get("parallel_tool_calls") is not False
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolPlan("none", tools)
    if choice == "auto":
        if not template or TOOL_CALL_TAG not in template:
            raise ValueError(
                'tool_choice "auto" needs a chat template that defines a tool-call format '
                f"({TOOL_CALL_TAG}...</tool_call>); this model's does not: send tool_choice "
                '"required" or {"type": "function", "function": {"name": ...}}'
            )
        return ToolPlan("auto", tools)
    if choice == "required":
        calls = {
            "type": "array",
            "minItems": 1,
            "items": {"anyOf": [_call_schema(name, params) for name, params in functions.items()]},
        }
        if not parallel:
            calls["maxItems"] = 1
        return ToolPlan("required", tools, structured=StructuredOutput.json_schema(calls))
    name = _named(choice)
    if name not in functions:
        raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
    return ToolPlan("named", tools, name, StructuredOutput.json_schema(functions[name]))


def _check_tools(tools: Any) -> dict[str, dict[str, Any]]:
    """Each function's parameters schema by name; ValueError naming a malformed tool."""
    if not isinstance(tools, list):
        raise ValueError("tools must be a list")
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ValueError(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}')
        spec = tool.get("function")
        if not isinstance(spec, dict):
            raise ValueError(f"tools[{i}].function must be an object")
        name = spec.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"tools[{i}].function.name must match [A-Za-z0-9_-]{{1,64}}")
        if name in functions:
            raise ValueError(f"tools[{i}]: function {name!r} is defined twice")
        params = spec.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        functions[name] = params
    return functions


def _named(choice: Any) -> str:
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        if isinstance(name, str):
            return name
    raise ValueError(
        'tool_choice must be "none", "auto", "required" or '
        '{"type": "function", "function": {"name": ...}}'
    )


def _call_schema(name: str, params: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": params},
        "required": ["name", "arguments"],
    }


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments: Any) -> dict[str, Any]:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {
        "id": new_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def parse_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a finished answer. Text that does not parse stays
    content (e.g. an answer cut by max_tokens)."""
    if plan.mode == "named":
        try:
            json.loads(text)
        except json.JSONDecodeError:
            return text, []
        return None, [_call(plan.name, text)]
    if plan.mode == "required":
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            return text, []
        return None, [_call(item["name"], item["arguments"]) for item in items]
    if plan.mode == "auto":
        return _parse_auto(text)
    return text, []


def _parse_auto(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    calls, kept = [], []
    last = 0
    for match in _BLOCK.finditer(text):
        try:
            item = json.loads(match.group(1))
            call = _call(item["name"], item.get("arguments", item.get("parameters", {})))
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # not a call: stays in the content
        calls.append(call)
        kept.append(text[last : match.start()])
        last = match.end()
    kept.append(text[last:])
    content = "".join(kept).strip() if calls else text
    return content or None, calls


def message_of(plan: ToolPlan | None, text: str) -> tuple[dict[str, Any], bool]:
    """The assistant message of a finished answer, and whether it holds tool calls."""
    if plan is None:
        return {"role": "assistant", "content": text}, False
    content, calls = parse_calls(plan, text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return message, bool(calls)


def finish_reason_of(plan: ToolPlan | None, reason: str | None, has_calls: bool) -> str | None:
    """OpenAI's: "tool_calls" when the model chose to call (required, auto); a forced
    named call finishes with "stop"."""
    if has_calls and reason == "stop" and plan is not None and plan.mode != "named":
        return "tool_calls"
    return reason


class ToolStream:
    """The streamed deltas of a request with tools: a named call's arguments as they come
    (its first delta names the call), the others parsed at the end."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.pieces: list[str] = []
        self.call_id: str | None = None
        self.has_calls = plan.mode == "named"

    def delta(self, text: str) -> dict[str, Any] | None:
        """The chunk delta for new text (None: nothing to send yet)."""
        self.pieces.append(text)
        if self.plan.mode == "none":
            return {"content": text} if text else None
        if self.plan.mode != "named" or not text:
            return None
        call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
        if self.call_id is None:
            self.call_id = new_call_id()
            call.update(id=self.call_id, type="function")
            call["function"] = {"name": self.plan.name, "arguments": text}
        return {"tool_calls": [call]}

    def final(self) -> dict[str, Any] | None:
        """The delta sent before the finish chunk: the parsed calls (required, auto)."""
        if self.plan.mode in ("none", "named"):
            return None
        content, calls = parse_calls(self.plan, "".join(self.pieces))
        self.has_calls = bool(calls)
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
        return delta or None
