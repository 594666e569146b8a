"""Sampling time per step: the batched sampler (`sample_plan` today) against the row-by-row
sampler it replaced (kept below, as it was, as the baseline), in one run, interleaved.

One step's logits ([rows, vocab] float32 on the device) and one sampling request per row
(one per 4 rows with drafts), each with its own seed. Modes: temperature 0.8 alone;
top-k 50; top-p 0.9; temperature + top-k + top-p; 3 n-gram drafts per request with
temperature 0.8 and top-p 0.95 (verification). Logit shapes: "peaked" (a few tokens hold
most of the mass, as for a trained LM's next token: at vocab 32000 the 0.9-nucleus has a
median of 3 tokens, 5 at the 90th percentile, hundreds in the widest 1%) and "flat"
(2·N(0,1): a nucleus of ~7600, the worst case for the CPU's top-p, which then sorts).
Per repeat every case runs old then new or new then old, alternating; medians reported.

    .venv/bin/python -m benchmarks.ops.sampling --repeat 7   # ~2 min on 1 CPU thread
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch

from benchmarks.lib.common import environment, table, write_result
from scheduler.step_plan import ScheduledSeq
from vlmserve.sample.params import SamplerState, SamplingParams, filtered_probs
from vlmserve.sample.verify import sample_plan, verify_greedy

MODES = {
    "temperature": (SamplingParams(temperature=0.8), 0),
    "top_k": (SamplingParams(temperature=1.0, top_k=50), 0),
    "top_p": (SamplingParams(temperature=1.0, top_p=0.9), 0),
    "all_three": (SamplingParams(temperature=0.7, top_k=200, top_p=0.9), 0),
    "drafts": (SamplingParams(temperature=0.8, top_p=0.95), 3),
}


# -- the baseline: the row-by-row sampler before this change (vlmserve @ 95255f2) ----------


class LegacyState:
    """The old SamplerState: a CPU torch.Generator per request."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = torch.Generator()
        self.generator.manual_seed(params.seed if params.seed is not None else 0)


def legacy_sample(logits: torch.Tensor, states: list[LegacyState]) -> list[int]:
    logits = logits.float().cpu()
    tokens = []
    for row, state in zip(logits, states, strict=True):
        if state.params.greedy:
            tokens.append(int(row.argmax()))
        else:
            probs = filtered_probs(row, state.params)
            tokens.append(int(torch.multinomial(probs, 1, generator=state.generator)))
    return tokens


def legacy_verify(logits: torch.Tensor, drafts: tuple[int, ...], state: LegacyState) -> list[int]:
    tokens: list[int] = []
    for row, draft in zip(logits, drafts, strict=False):
        probs = filtered_probs(row, state.params)
        if float(torch.rand((), generator=state.generator)) < float(probs[draft]):
            tokens.append(draft)
            continue
        probs[draft] = 0.0
        tokens.append(int(torch.multinomial(probs / probs.sum(), 1, generator=state.generator)))
        return tokens
    return [*tokens, *legacy_sample(logits[-1:], [state])]


def legacy_sample_plan(
    scheduled: list[ScheduledSeq], logits: torch.Tensor, samplers: list[LegacyState]
) -> list[list[int]]:
    spans, row, states = [], 0, iter(samplers)
    for item in scheduled:
        if item.sample:
            spans.append((next(states), item.draft_token_ids, row))
            row += 1 + len(item.draft_token_ids)
    targets = logits.argmax(-1).tolist() if any(s.params.greedy for s, _, _ in spans) else []
    moved = [
        r for s, d, first in spans if not s.params.greedy for r in range(first, first + 1 + len(d))
    ]
    host = {r: i for i, r in enumerate(moved)}
    on_host = logits[moved].float().cpu() if moved else logits.new_empty(0)
    sampled = []
    for state, drafts, first in spans:
        if state.params.greedy:
            sampled.append(verify_greedy(targets[first : first + 1 + len(drafts)], drafts))
            continue
        rows = on_host[host[first] : host[first] + 1 + len(drafts)]
        sampled.append(
            legacy_verify(rows, drafts, state) if drafts else legacy_sample(rows, [state])
        )
    return sampled


# -- the cases ---------------------------------------------------------------------------


def make_logits(rows: int, vocab: int, shape: str, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rows * 7 + vocab)
    logits = torch.randn(rows, vocab, generator=gen) * 2
    if shape == "peaked":  # 8 tokens per row lifted by 10-16: most of the mass on a few
        lifted = torch.randint(vocab, (rows, 8), generator=gen)
        logits.scatter_add_(1, lifted, 10 + 6 * torch.rand(rows, 8, generator=gen))
    return logits.to(device)


def make_case(
    rows: int, vocab: int, mode: str, shape: str, device: torch.device
) -> tuple[list[ScheduledSeq], torch.Tensor, list[SamplingParams]]:
    """The scheduled items, logits and per-request params of one step. A draft is its row's
    most likely token, as an n-gram draft that tends to be right: accepted with p(argmax)."""
    params, num_drafts = MODES[mode]
    num_requests = rows // (1 + num_drafts)
    logits = make_logits(num_requests * (1 + num_drafts), vocab, shape, device)
    likely = logits.argmax(-1).view(num_requests, 1 + num_drafts)[:, :num_drafts].tolist()
    scheduled = [
        ScheduledSeq(f"r{i}", 2, 1 + num_drafts, True, (3,), tuple(likely[i]))
        for i in range(num_requests)
    ]
    seeded = [replace(params, seed=i) for i in range(num_requests)]
    return scheduled, logits, seeded


def time_call(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def run(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """Median ms per case, old and new."""
    cases = []
    for vocab in args.vocab:
        for rows in args.rows:
            for mode in MODES:
                wide = vocab > 1000 and MODES[mode][0].top_p < 1.0  # the shape matters
                for shape in ("peaked", "flat") if wide else ("peaked",):
                    cases.append((vocab, rows, mode, shape))
    times = {case: {"old": [], "new": []} for case in cases}
    for repeat in range(args.repeat + 1):  # repeat 0 warms up and is not kept
        for n, case in enumerate(cases):
            vocab, rows, mode, shape = case
            scheduled, logits, params = make_case(rows, vocab, mode, shape, device)
            old_states = [LegacyState(p) for p in params]
            new_states = [SamplerState(p) for p in params]
            calls = {
                "old": partial(legacy_sample_plan, scheduled, logits, old_states),
                "new": partial(sample_plan, scheduled, logits, new_states),
            }
            order = ("old", "new") if (repeat + n) % 2 == 0 else ("new", "old")
            for name in order:
                seconds = time_call(calls[name], device)
                if repeat:
                    times[case][name].append(seconds)
    out = []
    for (vocab, rows, mode, shape), t in times.items():
        old, new = statistics.median(t["old"]) * 1e3, statistics.median(t["new"]) * 1e3
        out.append({"vocab": vocab, "rows": rows, "mode": mode, "logits": shape,
                    "old_ms": old, "new_ms": new, "speedup": old / new,
                    "old_ms_each": [round(x * 1e3, 3) for x in t["old"]],
                    "new_ms_each": [round(x * 1e3, 3) for x in t["new"]]})  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--vocab", type=int, nargs="+", default=[68, 32000])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="sampling", help="results/<out>.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    load_start = os.getloadavg()
    rows = run(args, device)
    load_end = os.getloadavg()
    columns = ["vocab", "rows", "mode", "logits", "old_ms", "new_ms", "speedup"]
    print(table(rows, columns))
    print(f"load average: start {load_start}, end {load_end}")
    path = write_result(args.out, {
        "what": "sampling time per step (ms, median): row-by-row host sampler (old) vs "
                "batched sampler where the logits are (new), interleaved",
        "command": "python -m benchmarks.ops.sampling " + " ".join(
            f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(args).items()),
        "environment": environment(device),
        "load_average": {"start": load_start, "end": load_end},
        "rows": rows,
    })  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
