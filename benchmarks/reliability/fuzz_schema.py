"""Fuzzed constraints through the HTTP API: random JSON schemas (valid, contradictory,
dangling `$ref`s, odd types, unicode names), regexes, EBNF grammars, choices,
`response_format` shapes and `tools` / `tool_choice` specs, streamed and not, against a
real `vlmserve serve` of a tiny random LLaVA-OneVision with a byte-level tokenizer.

Pass: 0 server exits, 0 5xx, 0 lost, every refusal a 4xx with a message, every request a
terminal answer; afterwards the KV pool whole and `check_integrity()` clean. A constraint
the server accepts is answered 200 (the grammar closes, or max_tokens cuts it)."""

from __future__ import annotations

import asyncio
import json
import random
import tempfile
from pathlib import Path

from benchmarks.reliability.common import (
    Outcome,
    client,
    count,
    gather_limited,
    print_table,
    send,
)
from benchmarks.reliability.server import ServerProcess

_NAMES = ["a", "b", "naïve", 'q"uote', "back\\slash", "", "x" * 40, "日本", "$ref", "0"]
_TYPES = ["string", "integer", "number", "boolean", "null", "array", "object"]


def random_schema(rng: random.Random, depth: int = 0) -> object:
    """A JSON schema, often valid, sometimes contradictory or malformed."""
    roll = rng.random()
    if roll < 0.04:
        return rng.choice([None, 3, "object", [], True, False, {"type": "objekt"}])
    kind = rng.choice(_TYPES if depth < 3 else _TYPES[:5])
    schema: dict = {"type": kind}
    if kind == "string":
        if rng.random() < 0.5:
            schema["maxLength"] = rng.randint(-1, 12)
        if rng.random() < 0.3:
            schema["minLength"] = rng.randint(0, 15)
        if rng.random() < 0.2:
            schema["pattern"] = random_regex(rng)
        if rng.random() < 0.1:
            schema["format"] = rng.choice(["date", "email", "uuid", "no-such-format"])
    elif kind in ("integer", "number"):
        if rng.random() < 0.6:
            schema["minimum"] = rng.randint(-100, 100)
        if rng.random() < 0.6:
            schema["maximum"] = rng.randint(-100, 100)
    elif kind == "array":
        schema["items"] = random_schema(rng, depth + 1)
        schema["maxItems"] = rng.randint(0, 3)
        if rng.random() < 0.3:
            schema["minItems"] = rng.randint(0, 5)
    elif kind == "object":
        names = rng.sample(_NAMES, rng.randint(0, 4))
        schema["properties"] = {n: random_schema(rng, depth + 1) for n in names}
        schema["required"] = [n for n in names if rng.random() < 0.7]
        if rng.random() < 0.1:
            schema["required"].append("missing")
        if rng.random() < 0.1:
            schema["additionalProperties"] = rng.choice([True, False, {"type": "integer"}])
    extra = rng.random()
    if extra < 0.05:
        schema = {"anyOf": [random_schema(rng, depth + 1) for _ in range(rng.randint(0, 3))]}
    elif extra < 0.08:
        schema = {"$ref": rng.choice(["#/$defs/x", "#/definitions/nope", "http://x/y"])}
    elif extra < 0.10:
        schema = {"enum": [rng.choice([1, "a", None, [1], {"k": 2}]) for _ in range(3)]}
    elif extra < 0.12:
        schema["type"] = rng.choice([["string", "null"], "strin", 7])
    return schema


def random_regex(rng: random.Random) -> str:
    pieces = ["[a-z]{1,3}", r"\d{2}", "(ab|cd)", "x?", "[^\"]{0,2}", "é", ".", "(", "[",
              "{3,1}", "\\", "*", "a{2}", r"\w+", "[z-a]", "|", ")", "ü{1,2}"]  # fmt: skip
    return "".join(rng.choice(pieces) for _ in range(rng.randint(1, 5)))


def random_grammar(rng: random.Random) -> str:
    return rng.choice([
        'root ::= "yes" | "no"', 'root ::= [a-c]+ "!"', "root ::= foo", "root := 'a'",
        'root ::= "a" root | "b"', "", 'root ::= ("x" | "y"){2,3}', "root ::= [z-a]",
    ])  # fmt: skip


def random_constraint(rng: random.Random) -> dict:
    """The extra body fields of one fuzzed request."""
    roll = rng.random()
    schema = random_schema(rng)
    if roll < 0.3:
        return {"response_format": {"type": "json_schema",
                                    "json_schema": {"name": "f", "schema": schema,
                                                    "strict": rng.random() < 0.5}}}  # fmt: skip
    if roll < 0.4:
        return {"guided_json": schema if rng.random() < 0.8 else json.dumps(schema)[:-1]}
    if roll < 0.55:
        return {rng.choice(["guided_regex", "structured_outputs"]): random_regex(rng)}
    if roll < 0.65:
        choices = rng.choice([["a", "b"], [], "a", [1, 2], ["ok", ""], ["日本", 'say "hi"']])
        return {"guided_choice": choices}
    if roll < 0.72:
        return {"structured_outputs": {"grammar": random_grammar(rng)}}
    if roll < 0.8:
        return {"response_format": rng.choice([
            {"type": "json_object"}, {"type": "text"}, {"type": "xml"}, {}, "json",
            {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"name": "x"}},
        ])}  # fmt: skip
    params = schema if rng.random() < 0.8 else rng.choice([3, "x", None])
    name = rng.choice(["f", "get_weather", "bad name!", "", "x" * 70])
    tools = [{"type": "function", "function": {"name": name, "parameters": params}}]
    if rng.random() < 0.1:
        tools = rng.choice([[], "tools", [{"type": "retrieval"}], [tools[0], tools[0]]])
    choice = rng.choice(["required", "none", "auto", None, "sometimes",
                         {"type": "function", "function": {"name": name}},
                         {"type": "function", "function": {"name": "other"}}])  # fmt: skip
    body = {"tools": tools, "parallel_tool_calls": rng.random() < 0.5}
    if choice is not None:
        body["tool_choice"] = choice
    return body


def make_bodies(num: int, seed: int) -> list[tuple[dict, str]]:
    rng = random.Random(seed)
    bodies = []
    for i in range(num):
        extra = random_constraint(rng)
        if isinstance(extra.get("structured_outputs"), str):  # a regex under the new name
            extra["structured_outputs"] = {"regex": extra["structured_outputs"]}
        body = {"messages": [{"role": "user", "content": f"fuzz {i}"}], "max_tokens": 24,
                "temperature": 1.0, "seed": i, "stream": i % 4 == 3, **extra}  # fmt: skip
        bodies.append((body, next(iter(extra))))
    return bodies


async def _send_all(url: str, bodies: list[tuple[dict, str]], concurrency: int) -> list[Outcome]:
    async with client(url, timeout=120) as http:
        coros = [send(http, body, label, "any") for body, label in bodies]
        return await gather_limited(coros, concurrency)


def run_schema_fuzz(num: int = 400, seed: int = 0, root=None, concurrency: int = 4) -> dict:
    from vlmserve.worker.models.random_checkpoint import make_vlm_checkpoint

    bodies = make_bodies(num, seed)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_vlm_checkpoint(
            Path(tmp) / "ov", "llava_onevision", vocab=512, tokenizer="bytes"
        )
        args = ("--model", str(model), "--grammar-compile-timeout", "5")
        kw = {"root": root} if root is not None else {}
        with ServerProcess(*args, **kw) as server:
            start = server.settled_vitals()
            outcomes = asyncio.run(_send_all(server.url, bodies, concurrency))
            alive = server.alive
            end = server.settled_vitals() if alive else None
            integrity = server.integrity() if alive else {"ok": False, "error": "server died"}
            command = server.command.replace(str(model), "<tiny llava-ov, byte BPE>")
            exit_code = server.stop()
            log_tail = server.log_tail(2000)
    c = count(outcomes)
    print_table(f"schema fuzz: {num} constrained requests", outcomes)
    checks = {
        "server_alive": alive, "5xx": c["5xx"], "lost": c["lost"],
        "refused_4xx_with_message": sum(o.verdict == "4xx" and bool(o.message) for o in outcomes),
        "num_4xx": sum(o.verdict == "4xx" for o in outcomes),
        "answered_200": sum(o.verdict == "ok" for o in outcomes),
        "leaked_kv_blocks": None if end is None else int(start.free_blocks - end.free_blocks),
        "check_integrity_ok": bool(integrity.get("ok")),
    }  # fmt: skip
    print("  " + ", ".join(f"{k}={v}" for k, v in checks.items()))
    passed = (alive and c["unexpected"] == 0 and c["lost"] == 0 and c["5xx"] == 0
              and checks["num_4xx"] == checks["refused_4xx_with_message"]
              and checks["leaked_kv_blocks"] == 0 and checks["check_integrity_ok"])  # fmt: skip
    return {
        "passed": bool(passed), "server_command": command, "counts": c, "checks": checks,
        "seed": seed,
        "unexpected": [f"{o.label} -> {o.verdict} {o.status}: {o.message}"
                       for o in outcomes if not o.is_expected or o.verdict == "5xx"][:40],
        "server_exit_code": exit_code, "server_log_tail": None if passed else log_tail,
    }  # fmt: skip
