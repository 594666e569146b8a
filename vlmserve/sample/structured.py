"""What a constrained request asks for (structured outputs): a JSON schema, any JSON
object, a regex, a choice of strings or an EBNF grammar; and how grammars are compiled.

A record, not a live object: it travels in `SamplingParams.structured` through every door
(the offline Engine, `generate --json-schema`, `caption --json-schema`, the HTTP server's
`response_format` / `structured_outputs` / `guided_*`). `vlmserve.sample.grammar` compiles
it with xgrammar (imported only once a constrained request arrives: it costs seconds).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

StructuredKind = Literal["json", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """The constraint on a request's output. `spec` is the JSON schema's text (kind
    "json"), the regex, the EBNF grammar, or the choices as a JSON list of strings;
    "json_object" (any JSON object) has none. Equal specs share one compiled grammar."""

    kind: StructuredKind
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind {self.kind!r} is not one of {KINDS}")
        if self.kind == "json_object":
            return
        if not isinstance(self.spec, str) or not self.spec.strip():
            raise ValueError(f"a {self.kind} constraint needs a non-empty spec")
        if self.kind == "json":
            try:
                schema = json.loads(self.spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema must be an object (or true/false)")
        if self.kind == "choice":
            choices = json.loads(self.spec)
            if not (isinstance(choices, list) and choices):
                raise ValueError("choice needs a non-empty list of strings")
            if not all(isinstance(c, str) and c for c in choices):
                raise ValueError("every choice must be a non-empty string")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str | bool | type) -> StructuredOutput:
        """From a schema as a dict, JSON text, or a pydantic model class."""
        if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
            schema = schema.model_json_schema()
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return cls("json", text)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> StructuredOutput:
        if isinstance(choices, str):
            raise ValueError("choice needs a list of strings, not one string")
        return cls("choice", json.dumps(list(choices)))

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        return cls("regex", pattern)

    @classmethod
    def grammar(cls, ebnf: str) -> StructuredOutput:
        return cls("grammar", ebnf)

    @classmethod
    def json_object(cls) -> StructuredOutput:
        return cls("json_object")

    @property
    def choices(self) -> list[str]:
        assert self.kind == "choice", "only a choice constraint has choices"
        return json.loads(self.spec)


@dataclass(frozen=True)
class StructuredConfig:
    """How grammars are compiled: on `num_compile_threads` threads beside the engine, at
    most `compile_timeout_s` per request (then it fails with a 400, never hangs), the last
    `cache_size` distinct specs kept. `any_whitespace`: JSON may hold any whitespace
    between tokens (xgrammar's default); off (ours), it is compact (`", "`, `": "`), so a
    weak model cannot spend its tokens on whitespace."""

    compile_timeout_s: float = 10.0
    num_compile_threads: int = 2
    cache_size: int = 256
    any_whitespace: bool = False

    def __post_init__(self) -> None:
        if not self.compile_timeout_s > 0:
            raise ValueError(f"compile_timeout_s={self.compile_timeout_s} must be > 0")
        if self.num_compile_threads < 1:
            raise ValueError(f"num_compile_threads={self.num_compile_threads} must be >= 1")
        if self.cache_size < 1:
            raise ValueError(f"cache_size={self.cache_size} must be >= 1")
