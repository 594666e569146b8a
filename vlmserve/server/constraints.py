"""The request fields that constrain an answer, as one `StructuredOutput`: OpenAI's
`response_format` (`json_schema`, strict or not, and `json_object`), vLLM's
`structured_outputs` (`json`, `regex`, `choice`, `grammar`, `json_object`) and its older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`. At most one may be
set; anything malformed is a ValueError (400) naming the field. Whether a schema, regex
or grammar compiles is found on the engine's grammar pool (also a 400)."""

from __future__ import annotations

import json
from typing import Any

from vlmserve.sample.structured import StructuredOutput

_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def structured_of(extra: dict[str, Any]) -> StructuredOutput | None:
    """The constraint a request's extra fields ask for (None: none)."""
    found: list[tuple[str, StructuredOutput]] = []
    if extra.get("response_format") is not None:
        spec = _response_format(extra["response_format"])
        if spec is not None:
            found.append(("response_format", spec))
    if extra.get("structured_outputs") is not None:
        found.append(("structured_outputs", _structured_outputs(extra["structured_outputs"])))
    for field, kind in _GUIDED.items():
        if extra.get(field) is not None:
            found.append((field, _build(kind, extra[field], field)))
    if len(found) > 1:
        raise ValueError(
            f"only one constraint per request: got {', '.join(name for name, _ in found)}"
        )
    return found[0][1] if found else None


def _response_format(value: Any) -> StructuredOutput | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ValueError('response_format must be an object with a "type"')
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput.json_object()
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError('response_format json_schema needs a "json_schema" object')
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:
            raise ValueError("response_format.json_schema.schema is missing")
        return _build("json", schema, "response_format.json_schema.schema")
    raise ValueError(
        f"response_format type {kind!r} is not supported (text, json_object, json_schema)"
    )


def _structured_outputs(value: Any) -> StructuredOutput:
    if not isinstance(value, dict):
        raise ValueError("structured_outputs must be an object")
    set_keys = [key for key in _STRUCTURED_KEYS if value.get(key) not in (None, False)]
    # vLLM's knobs for how it constrains (not what) are accepted and ignored.
    unknown = set(value) - set(_STRUCTURED_KEYS) - {"backend", "whitespace_pattern"}
    unknown -= {"disable_any_whitespace", "disable_additional_properties"}
    if unknown:
        raise ValueError(f"structured_outputs: unknown fields {sorted(unknown)}")
    if len(set_keys) != 1:
        raise ValueError(
            f"structured_outputs takes exactly one of {', '.join(_STRUCTURED_KEYS)}; "
            f"got {set_keys or 'none'}"
        )
    key = set_keys[0]
    if key == "json_object":
        return StructuredOutput.json_object()
    return _build(key, value[key], f"structured_outputs.{key}")


def _build(kind: str, value: Any, field: str) -> StructuredOutput:
    """A StructuredOutput of `kind` from a field's value; ValueError naming `field`."""
    try:
        if kind == "json":
            if isinstance(value, str):
                value = json.loads(value)
            if not isinstance(value, (dict, bool)):
                raise ValueError("a JSON schema must be an object")
            return StructuredOutput.json_schema(value)
        if kind == "choice":
            if not isinstance(value, list):
                raise ValueError("choice must be a list of strings")
            return StructuredOutput.choice(value)
        if not isinstance(value, str):
            raise ValueError(f"{kind} must be a string")
        return StructuredOutput(kind, value)  # type: ignore[arg-type]
    except (ValueError, TypeError) as e:
        raise ValueError(f"{field}: {e}") from None
