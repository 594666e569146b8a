"""Structured captioning (`caption --json-schema FILE`, `generate --json-schema FILE`): the
schema file read and checked, and each caption checked against it before its line is
written, so the output JSONL holds one validated JSON object per image. The engine's
grammar already makes the output follow the schema; what can still fail is an answer cut
by --max-tokens (finish_reason "length"): that item is written as an error, and
`--retry-errors` with a larger --max-tokens redoes it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from vlmserve.sample.params import SamplingParams
from vlmserve.sample.structured import StructuredOutput


def load_schema(path: str | Path) -> StructuredOutput:
    """The constraint of a JSON schema file; ValueError naming the file and the problem."""
    import jsonschema

    try:
        schema = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--json-schema {path}: {e}") from None
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise ValueError(f"--json-schema {path}: not a valid JSON schema: {e.message}") from None
    return StructuredOutput.json_schema(schema)


def json_checked(records: Iterator[dict], sampling: SamplingParams) -> Iterator[dict]:
    """`records` with each caption parsed and validated against the request's JSON schema
    (as is without one). A caption that is not a valid object becomes an error record."""
    spec = sampling.structured
    if spec is None or spec.kind not in ("json", "json_object"):
        yield from records
        return
    import jsonschema

    schema = json.loads(spec.spec) if spec.kind == "json" else {"type": "object"}
    validator = jsonschema.validators.validator_for(schema)(schema)
    for record in records:
        if record.get("error") is None:
            record = _checked(record, validator)
        yield record


def _checked(record: dict, validator) -> dict:
    try:
        value = json.loads(record["caption"])
        validator.validate(value)
    except Exception as e:  # noqa: BLE001 - not JSON, or jsonschema.s ValidationError
        reason = record.get("finish_reason")
        hint = " (cut by --max-tokens: raise it)" if reason == "length" else ""
        message = getattr(e, "message", str(e))
        return {**record, "caption": None, "error": f"not a valid JSON object{hint}: {message}",
                "error_type": "InvalidJSON", "text": record["caption"]}  # fmt: skip
    return {**record, "caption": value}
