"""The request-field reference: every field of each endpoint's request, with its type,
default and bounds (the pydantic models in `vlmserve/server/`), the extra fields the
server reads (`extra.get("...")` in `constraints.py` and `tools.py`), the chat refusal
table (`UNSUPPORTED_FIELDS`), and why (`docs/gen/api_notes.py`)."""

from __future__ import annotations

import json
import re
import types
import typing
from pathlib import Path

import annotated_types
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from docs.gen import api_notes
from docs.gen.markdown import REGENERATE, REPO_ROOT, code, header, table

PAGE = "reference/api-fields.md"
STATUSES = {"supported": "supported", "ignored": "ignored", "refused": "**refused** (400)"}


def _models() -> dict[str, type[BaseModel]]:
    from vlmserve.server.completions import CompletionRequest
    from vlmserve.server.protocol import ChatCompletionRequest
    from vlmserve.server.utility_routes import DetokenizeRequest, TokenizeRequest

    return {
        "POST /v1/chat/completions": ChatCompletionRequest,
        "POST /v1/completions": CompletionRequest,
        "POST /tokenize": TokenizeRequest,
        "POST /detokenize": DetokenizeRequest,
    }


def extra_fields_read(*modules: str) -> list[str]:
    """The keys a module reads from a request's extra fields: `extra.get("k")`,
    `extra["k"]`, the names on a line testing `... in extra`, and the keys of its `_GUIDED`
    table (constraints.py)."""
    keys: list[str] = []
    for module in modules:
        path = REPO_ROOT / Path(*module.split(".")).with_suffix(".py")
        source = path.read_text()
        found = re.findall(r"""extra(?:\.get\(|\[)["'](\w+)["']""", source)
        for line in source.splitlines():  # `for key in ("a", "b") if key in extra`
            if re.search(r"\bin extra\b", line):
                found += re.findall(r"""["'](\w+)["']""", line)
        guided = re.search(r"_GUIDED = \{(.*?)\}", source, re.DOTALL)
        if guided:
            found += re.findall(r'"(\w+)":', guided.group(1))
        for key in found:
            if key not in keys:
                keys.append(key)
    return keys


def note(model: type[BaseModel], field: str) -> str:
    for key in (f"{model.__name__}.{field}", field):
        if key in api_notes.NOTES:
            return api_notes.NOTES[key]
    raise KeyError(
        f"request field {field!r} of {model.__name__} has no note: add one to "
        f"docs/gen/api_notes.py NOTES, then run `{REGENERATE}`"
    )


def status(model: type[BaseModel], field: str) -> str:
    keys = {f"{model.__name__}.{field}", field}
    if keys & api_notes.REFUSED:
        return "refused"
    return "ignored" if keys & api_notes.IGNORED else "supported"


def type_name(annotation: object) -> str:
    """A readable type: `str | list[str] | None`, `list[TextPart | ImagePart]`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is typing.Literal:
        return " | ".join(repr(a).replace("'", '"') for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


_BOUNDS = (
    (annotated_types.Ge, "ge", ">= {}"),
    (annotated_types.Gt, "gt", "> {}"),
    (annotated_types.Le, "le", "<= {}"),
    (annotated_types.Lt, "lt", "< {}"),
    (annotated_types.MinLen, "min_length", "length >= {}"),
    (annotated_types.MaxLen, "max_length", "length <= {}"),
)


def bounds(info) -> str:
    """The field's pydantic constraints, as a 422 would enforce them."""
    out = []
    for item in info.metadata:
        for kind, attr, text in _BOUNDS:
            if isinstance(item, kind):
                out.append(text.format(getattr(item, attr)))
        if getattr(item, "strict", None):
            out.append("strict type")
    return ", ".join(out)


def _default(info) -> str:
    if info.is_required():
        return "required"
    if info.default_factory is not None:
        return code(repr(info.default_factory()))
    return "none" if info.default in (None, PydanticUndefined) else code(repr(info.default))


def _declared_rows(model: type[BaseModel]) -> list[tuple]:
    """The model's fields, its own first, then those it shares (SamplingFields)."""
    own = model.__dict__.get("__annotations__", {})
    fields = sorted(model.model_fields.items(), key=lambda item: item[0] not in own)
    rows = []
    for name, info in fields:
        what = type_name(info.annotation)
        limits = bounds(info)
        rows.append((
            code(name), code(what) + (f" ({limits})" if limits else ""), _default(info),
            STATUSES[status(model, name)], note(model, name),
        ))  # fmt: skip
    return rows


def _extra_rows(model: type[BaseModel], names: list[str], refused: dict) -> list[tuple]:
    rows = []
    for name in names:
        if name in model.model_fields:
            continue
        if name in refused:
            allowed = ", ".join(code(json.dumps(v)) for v in refused[name])
            rows.append((code(name), "JSON", "none", f"{STATUSES['refused']} unless {allowed}",
                         note(model, name)))  # fmt: skip
        else:
            rows.append((code(name), "JSON", "none", STATUSES[status(model, name)],
                         note(model, name)))  # fmt: skip
    return rows


def _nested(model: type[BaseModel]) -> list[type[BaseModel]]:
    """The request models inside `model`'s fields, depth first, each once."""
    seen: list[type[BaseModel]] = []

    def visit(annotation: object) -> None:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            if annotation not in seen:
                seen.append(annotation)
                for info in annotation.model_fields.values():
                    visit(info.annotation)
            return
        for arg in typing.get_args(annotation):
            visit(arg)

    for info in model.model_fields.values():
        visit(info.annotation)
    return seen


HEAD = ("field", "type", "default", "status", "why")


def render() -> str:
    from vlmserve.server.protocol import UNSUPPORTED_FIELDS

    constraint_keys = extra_fields_read("vlmserve.server.constraints")
    tool_keys = extra_fields_read("vlmserve.server.tools")
    extras = {
        "POST /v1/chat/completions": constraint_keys + tool_keys + list(UNSUPPORTED_FIELDS),
        "POST /v1/completions": constraint_keys,
    }
    message_extras = extra_fields_read("vlmserve.server.chat")
    out = [
        header("HTTP request fields", "the pydantic request models in `vlmserve/server/`"),
        "Every field each endpoint takes. **supported**: the server honours it; "
        "**ignored**: accepted, no effect; **refused**: a 400 naming the field whenever it "
        "asks for something the engine does not do (silently ignoring it would hand back an "
        "answer the client did not ask for). A wrong type or an out-of-bounds value is a 422 "
        "naming the field; a value the sampler cannot use is a 400 naming it. Any field not "
        "listed here is accepted and ignored, so newer clients keep working.\n",
    ]
    chat = _models()["POST /v1/chat/completions"]
    refused_rows = [
        (code("POST /v1/chat/completions"), code(name),
         ", ".join(code(json.dumps(v)) for v in allowed), note(chat, name))
        for name, allowed in UNSUPPORTED_FIELDS.items()
    ]  # fmt: skip
    for endpoint, model in _models().items():
        refused_rows += [
            (code(endpoint), code(name), "unset or empty", note(model, name))
            for name in model.model_fields
            if status(model, name) == "refused"
        ]
    head = ("endpoint", "field", "accepted only as", "why")
    out += ["## Refused fields\n", table(head, refused_rows)]
    nested_done: list[type[BaseModel]] = []
    for endpoint, model in _models().items():
        out.append(f"## `{endpoint}`\n")
        out.append(f"Request model: `{model.__name__}`.\n")
        rows = _declared_rows(model) + _extra_rows(model, extras.get(endpoint, []),
                                                   UNSUPPORTED_FIELDS)  # fmt: skip
        out.append(table(HEAD, rows))
        for inner in _nested(model):
            if inner in nested_done:
                continue
            nested_done.append(inner)
            inner_rows = _declared_rows(inner)
            if inner.__name__ == "ChatMessage":
                inner_rows += _extra_rows(inner, message_extras, {})
            out += [f"### `{inner.__name__}`\n", table(HEAD, inner_rows)]
    return "\n".join(out)
