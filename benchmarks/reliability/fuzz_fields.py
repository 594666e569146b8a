"""Fuzzed sampling fields through the HTTP API: n, best_of, logprobs / top_logprobs,
prompt_logprobs, the penalties, logit_bias, min_p, min_tokens, bad_words, stop_token_ids,
echo, suffix and prompt shapes, on /v1/chat/completions and /v1/completions, streamed and
not.

Three kinds of body: `bad` (one field out of range or of the wrong type: must be a 4xx
with a message), `good` (valid values: must be answered 200), `mixed` (several random
fields, valid or not: any answer but a 5xx or a lost request). Against a real
`vlmserve serve` on loopback (a tiny random LLaVA-OneVision, which has a chat template).
Pass: 0 5xx, 0 lost, every bad body a 4xx with a message, every good one answered; after,
the KV pool whole and `check_integrity()` clean.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import httpx

from benchmarks.reliability.common import Outcome, client, count, gather_limited, print_table
from benchmarks.reliability.server import ServerProcess

WORDS = "where is the blue circle and how many are there on the left red star".split()

# (field, bad values): each alone makes a body a 4xx.
BAD = {
    "n": [0, -1, 10**6, "two", 1.5],
    "logprobs_chat": [21, -1],  # top_logprobs on chat
    "logprobs": [21, -1, "x"],
    "prompt_logprobs": [21, -1, "x", 1.5, True],  # both endpoints (vLLM's field)
    "presence_penalty": [2.5, -3, float("inf"), "high"],
    "frequency_penalty": [-2.01, 1e9],
    "repetition_penalty": [0, -1, 101, "x"],
    "logit_bias": [{"x": 1}, {"5": 101}, {"-3": 1}, {"999999999": 1}, [1, 2], {"5": "up"}],
    "min_p": [-0.1, 1.5, "x"],
    "min_tokens": [-1, 10**6, 1.5],
    "bad_words": [[""], "word", [1, 2]],
    "stop_token_ids": [[-1], [10**9], ["x"]],
    "best_of": [0, 10**6],
    "suffix": ["end"],
    "prompt": [[], [-5], [10**9], [[1, 2], []], 5, None, [""]],
}
GOOD = {
    "n": [1, 2, 3],
    "presence_penalty": [-2, 0, 1.5],
    "frequency_penalty": [2, -0.5],
    "repetition_penalty": [0.5, 1, 1.3, 100],
    "logit_bias": [{}, {"5": 100}, {"5": -100, "7": 3.5}],
    "min_p": [0, 0.2, 1],
    "min_tokens": [0, 2],
    "bad_words": [["blue"], ["how many", "red"]],
    "logprobs": [0, 5, 20],
    "prompt_logprobs": [0, 1, 5],
    "stop_token_ids": [[], [5]],
}


@dataclass(frozen=True)
class Case:
    path: str
    body: dict
    label: str
    expect: str  # "ok", "4xx", "any"


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))


def _base(rng: random.Random, chat: bool) -> dict:
    body: dict = {"max_tokens": rng.randint(1, 4), "stream": rng.random() < 0.3}
    if chat:
        body["messages"] = [{"role": "user", "content": _prompt(rng)}]
    else:
        body["prompt"] = _prompt(rng)
    return body


def _set(body: dict, field: str, value, chat: bool) -> None:
    if field == "logprobs_chat":
        body["logprobs"], body["top_logprobs"] = True, value
    elif field == "logprobs" and chat:
        body["logprobs"], body["top_logprobs"] = True, value
    else:
        body[field] = value


def make_cases(num: int, seed: int = 0) -> list[Case]:
    rng = random.Random(seed)
    cases = []
    for i in range(num):
        kind = ("bad", "good", "mixed")[i % 3]
        field = rng.choice(list(BAD))
        # suffix and prompt are completions' fields (chat ignores unknown fields).
        chat = rng.random() < 0.5 and not (kind == "bad" and field in ("suffix", "prompt"))
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body = _base(rng, chat)
        if kind == "bad":
            if chat and field == "logprobs":
                field = "logprobs_chat"
            elif not chat and field == "logprobs_chat":
                field = "logprobs"
            _set(body, field, rng.choice(BAD[field]), chat)
            if body.get("best_of") is not None:
                body["stream"] = False
            cases.append(Case(path, body, f"bad/{field}", "4xx"))
            continue
        pool = GOOD if kind == "good" else {**GOOD, **BAD}
        for field in rng.sample(list(pool), rng.randint(1, 4)):
            table = pool[field] if kind == "good" else (GOOD.get(field, []) + BAD.get(field, []))
            _set(body, field, rng.choice(table), chat)
        if kind == "good" and "min_tokens" in body:  # min_tokens <= max_tokens
            body["max_tokens"] = max(body["max_tokens"], body["min_tokens"])
        cases.append(Case(path, body, kind, "ok" if kind == "good" else "any"))
    return cases


def _verdict(status: int) -> str:
    return "ok" if status < 300 else ("4xx" if status < 500 else "5xx")


async def send_case(http: httpx.AsyncClient, case: Case) -> Outcome:
    """POST one body (JSON with NaN / inf written as the bare words, as a careless client
    would) and classify its answer; a stream is read to its end."""
    start = time.perf_counter()
    done = lambda **kw: Outcome(case.label, seconds=time.perf_counter() - start,
                                expect=case.expect, **kw)  # fmt: skip
    raw = json.dumps(case.body)  # inf -> Infinity: pydantic refuses it (422)
    headers = {"Content-Type": "application/json"}
    try:
        response = await http.post(case.path, content=raw, headers=headers)
    except httpx.HTTPError as e:
        return done(verdict="lost", message=repr(e))
    status = response.status_code
    if status != 200:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = None
        return done(verdict=_verdict(status), status=status, message=message)
    if case.body.get("stream") is True:
        text = response.text
        if "data: [DONE]" not in text:
            return done(verdict="lost", status=200, message="stream ended without [DONE]")
        for line in text.splitlines():
            if line.startswith("data: {") and '"error"' in line[:20]:
                error = json.loads(line[6:])["error"]
                code = int(error.get("code") or 500)
                return done(verdict=_verdict(code), status=code, message=error.get("message"))
    return done(verdict="ok", status=200)


async def send_all(url: str, cases: list[Case], concurrency: int) -> list[Outcome]:
    async with client(url, timeout=120) as http:
        return await gather_limited([send_case(http, c) for c in cases], concurrency)


def run_fields(num: int = 600, seed: int = 0, root=None, concurrency: int = 8) -> dict:
    import tempfile
    from pathlib import Path

    from vlmserve.worker.models.random_checkpoint import make_vlm_checkpoint

    cases = make_cases(num, seed)
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_vlm_checkpoint(Path(tmp) / "llava_ov", "llava_onevision"))
        kw = {"root": root} if root is not None else {}
        with ServerProcess("--model", model, "--default-max-tokens", "4", **kw) as server:
            start = server.settled_vitals()
            outcomes = asyncio.run(send_all(server.url, cases, concurrency))
            alive = server.alive
            end = server.settled_vitals() if alive else None
            integrity = server.integrity() if alive else {"ok": False}
            command = server.command.replace(model, "<tiny llava-onevision>")
            server.stop()
    c = count(outcomes)
    print_table(f"fields: {num} bodies", outcomes)
    checks = {
        "server_alive": alive,
        "5xx": c["5xx"],
        "lost": c["lost"],
        "leaked_kv_blocks": None if end is None else int(start.free_blocks - end.free_blocks),
        "check_integrity_ok": bool(integrity.get("ok")),
    }
    print("  " + ", ".join(f"{k}={v}" for k, v in checks.items()))
    passed = (alive and c["unexpected"] == 0 and c["lost"] == 0 and c["5xx"] == 0
              and checks["leaked_kv_blocks"] == 0 and checks["check_integrity_ok"])  # fmt: skip
    return {
        "passed": bool(passed), "server_command": command, "seed": seed, "counts": c,
        "checks": checks,
        "unexpected": [f"{o.label} -> {o.verdict} {o.status}: {o.message}"
                       for o in outcomes if not o.is_expected][:40],
    }  # fmt: skip
