"""The sampler's step with the logit controls on: the incremental penalty state
(`penalty_table.py`, today) against the per-step rebuild it replaced (kept below, as it
was at d16bbd4, as the baseline) and against the same step with no controls, in one run.

64 requests (one row each, no drafts), vocab 32,000, 2,000-token prompts, each already
`--history` tokens into its output; temperature 0.8, top-p 0.95 over "peaked" logits
(`benchmarks.ops.sampling`). Modes: "penalties" (repetition 1.1, frequency 0.5, presence
0.3), "all_controls" (those + 3 logit_bias ids, 2 bad words, min_tokens). Each variant
keeps its own requests, whose outputs grow by the token each step samples; per step the
variants run in rotating order; medians of `--steps` steps after 3 warm-up ones.

    .venv/bin/python -m benchmarks.ops.penalties            # ~1 min on 1 CPU thread
    .venv/bin/python -m benchmarks.ops.penalties --quick    # a short run
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

import vlmserve.sample.sampler as sampler_module
from benchmarks.lib.common import environment, table, write_result
from benchmarks.ops.sampling import make_logits
from scheduler.step_plan import ScheduledSeq
from vlmserve.sample.controls import apply_controls
from vlmserve.sample.params import SamplerState, SamplingParams
from vlmserve.sample.verify import sample_plan
from vlmserve.worker.runner import keep_activations_in_heap

MODES = {
    "penalties": dict(repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.3),
    "all_controls": dict(
        repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.3,
        logit_bias={5: 2.0, 77: -1.0, 901: 0.5}, min_tokens=1,
    ),
}  # fmt: skip
BAD_WORDS_IDS = ((31000,), (120, 121))

# -- the baseline: the controls before this change (vlmserve @ d16bbd4) --------------------

_PROMPT_UNIQUE: dict[int, torch.Tensor] = {}


@dataclass
class _LegacyRows:
    """Host lists for the controlled rows, flattened (one tensor each)."""

    rows: list[int] = field(default_factory=list)  # logits row per controlled row
    rep: list[float] = field(default_factory=list)
    freq: list[float] = field(default_factory=list)
    pres: list[float] = field(default_factory=list)
    banned: tuple[list[int], list[int]] = field(default_factory=lambda: ([], []))
    bias: tuple[list[int], list[int], list[float]] = field(default_factory=lambda: ([], [], []))
    # Per penalised row: its output tokens, and (repetition) the prompt's distinct ids as
    # a host tensor made once per request: no per-step Python over a long prompt.
    output: list[tuple[int, list[int]]] = field(default_factory=list)
    prompt: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    def add(self, state: SamplerState, row: int, history: list[int], vocab: int) -> None:
        params, index = state.params, len(self.rows)
        self.rows.append(row)
        self.rep.append(params.repetition_penalty)
        self.freq.append(params.frequency_penalty)
        self.pres.append(params.presence_penalty)
        banned = set(legacy_banned_words(state.bad_words_ids, history))
        if len(history) < params.min_tokens:
            banned.update(state.stop_token_ids)
        for token in sorted(t for t in banned if 0 <= t < vocab):
            self.banned[0].append(index)
            self.banned[1].append(token)
        for token, value in params.logit_bias:
            if token < vocab:  # checked against the vocabulary at admission
                self.bias[0].append(index)
                self.bias[1].append(token)
                self.bias[2].append(value)
        if params.frequency_penalty or params.presence_penalty or params.repetition_penalty != 1:
            self.output.append((index, [t for t in history if 0 <= t < vocab]))
        if params.repetition_penalty != 1.0:
            unique = _PROMPT_UNIQUE.get(id(state))  # was a SamplerState field
            if unique is None:  # once per request, not per step
                ids = sorted(t for t in set(state.prompt_token_ids) if 0 <= t < vocab)
                unique = _PROMPT_UNIQUE[id(state)] = torch.tensor(ids, dtype=torch.long)
            self.prompt.append((index, unique))


def legacy_banned_words(
    bad_words_ids: Sequence[Sequence[int]], history: Sequence[int]
) -> list[int]:
    """The last token of each bad word whose other tokens end `history`."""
    out = []
    for word in bad_words_ids:
        prefix = list(word[:-1])
        if not prefix or list(history[len(history) - len(prefix) :]) == prefix:
            out.append(word[-1])
    return out


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


def _float(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True)


def _pairs(parts: list, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) tensors from per-row id lists or host tensors."""
    ids = [
        p if isinstance(p, torch.Tensor) else torch.tensor(p, dtype=torch.long) for _, p in parts
    ]
    rows = [
        torch.full((len(t),), i, dtype=torch.long) for (i, _), t in zip(parts, ids, strict=True)
    ]
    return torch.cat(rows).to(device, non_blocking=True), torch.cat(ids).to(
        device, non_blocking=True
    )


def _penalise(x: torch.Tensor, host: _LegacyRows) -> None:
    """The three penalties in place on x [rows, vocab] float32. Repetition touches only
    the (row, token) pairs seen (a pair listed twice gets the same value twice)."""
    device = x.device
    out_rows, out_ids = _pairs(host.output, device)
    if any(r != 1.0 for r in host.rep):
        rows, ids = out_rows, out_ids
        if host.prompt:
            prompt_rows, prompt_ids = _pairs(host.prompt, device)
            rows, ids = torch.cat([rows, prompt_rows]), torch.cat([ids, prompt_ids])
        rep = _float(host.rep, device)[rows]
        flat = rows * x.shape[1] + ids  # x is contiguous: 1-D indexing is the cheap kind
        values = x.view(-1)[flat]
        x.view(-1)[flat] = torch.where(values > 0, values / rep, values * rep)
    if any(host.freq) or any(host.pres):
        counts = torch.zeros_like(x)
        counts.index_put_((out_rows, out_ids), torch.ones_like(out_ids, dtype=x.dtype),
                          accumulate=True)  # fmt: skip
        if any(host.freq):
            x.sub_(_float(host.freq, device)[:, None] * counts)
        if any(host.pres):
            x.sub_(_float(host.pres, device)[:, None] * (counts > 0))


def legacy_apply_controls(logits: torch.Tensor, groups: Sequence) -> torch.Tensor:
    """`logits` ([rows, vocab]) with every group's controls applied to its rows: the
    same tensor when no group has any, else a new float32 one. groups: `RowGroup`s
    (state, first_row, draft_token_ids)."""
    vocab = logits.shape[-1]
    host = _LegacyRows()
    for group in groups:
        state = group.state
        if not state.params.has_logit_controls:
            continue
        history = list(state.output_token_ids)
        for j in range(1 + len(group.draft_token_ids)):
            host.add(state, group.first_row + j, history + list(group.draft_token_ids[:j]), vocab)
    if not host.rows:
        return logits
    device = logits.device
    out = logits.float().clone()
    rows = _long(host.rows, device)
    x = out.index_select(0, rows)  # [controlled rows, vocab]
    if host.banned[0]:
        x[_long(host.banned[0], device), _long(host.banned[1], device)] = float("-inf")
    if host.bias[0]:
        index = (_long(host.bias[0], device), _long(host.bias[1], device))
        x.index_put_(index, _float(host.bias[2], device), accumulate=True)
    if host.output or host.prompt:
        _penalise(x, host)
    out.index_copy_(0, rows, x)
    return out


# -- the cases ---------------------------------------------------------------------------


def make_states(args: argparse.Namespace, mode: str | None, seed: int) -> list[SamplerState]:
    gen = torch.Generator().manual_seed(seed)
    controls = MODES[mode] if mode else {}
    states = []
    for i in range(args.rows):
        params = SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=10**6,
                                **controls)  # fmt: skip
        state = SamplerState(params)
        state.prompt_token_ids = tuple(
            torch.randint(args.vocab, (args.prompt,), generator=gen).tolist()
        )
        state.output_token_ids = torch.randint(args.vocab, (args.history,), generator=gen).tolist()
        state.stop_token_ids = (2,)
        if mode == "all_controls":
            state.bad_words_ids = BAD_WORDS_IDS
        states.append(state)
    return states


def step(states: list[SamplerState], logits: torch.Tensor, controls: Callable) -> tuple:
    """One sampler step of `states` (their outputs grow by its tokens): (wall, this
    thread's CPU, the controls' own CPU) seconds. CPU time is what a loaded machine
    distorts least; the controls' share leaves out the sampling that follows them (whose
    cost depends on the distribution the penalties leave, the same for old and new)."""
    scheduled = [ScheduledSeq(f"r{i}", 2, 1, True, (3,)) for i in range(len(states))]
    spent = []

    def timed(logits: torch.Tensor, groups: Sequence) -> torch.Tensor:
        start = time.thread_time()
        out = controls(logits, groups)
        spent.append(time.thread_time() - start)
        return out

    sampler_module.apply_controls = timed  # the path under test
    try:
        start, cpu = time.perf_counter(), time.thread_time()
        sample_plan(scheduled, logits, states)
        return time.perf_counter() - start, time.thread_time() - cpu, sum(spent)
    finally:
        sampler_module.apply_controls = apply_controls


def _row(mode: str, path: str, times: list[tuple[float, float, float]], plain: dict | None):
    def median_ms(i: int) -> float:
        return statistics.median(t[i] for t in times) * 1e3

    wall, cpu = median_ms(0), median_ms(1)
    return {
        "mode": mode, "path": path, "ms": wall, "cpu_ms": cpu, "controls_cpu_ms": median_ms(2),
        "cpu_vs_plain": cpu / plain["cpu_ms"] if plain else 1.0,
        "wall_ms_each": [round(t[0] * 1e3, 3) for t in times],
        "cpu_ms_each": [round(t[1] * 1e3, 3) for t in times],
    }  # fmt: skip


def run(args: argparse.Namespace) -> list[dict]:
    logits = make_logits(args.rows, args.vocab, "peaked", torch.device("cpu"))
    variants: dict[str, tuple[list[SamplerState], Callable]] = {
        "plain": (make_states(args, None, 0), apply_controls)
    }
    for mode in MODES:
        variants[f"{mode}/old"] = (make_states(args, mode, 1), legacy_apply_controls)
        variants[f"{mode}/new"] = (make_states(args, mode, 1), apply_controls)
    names = list(variants)
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in names}
    for s in range(3 + args.steps):  # the first 3 warm up and are not kept
        order = names[s % len(names) :] + names[: s % len(names)]
        for name in order:
            states, controls = variants[name]
            seconds = step(states, logits, controls)
            if s >= 3:
                times[name].append(seconds)
    plain = _row("plain", "-", times["plain"], None)
    out = [plain]
    for mode in MODES:
        old = _row(mode, "old", times[f"{mode}/old"], plain)
        new = _row(mode, "new", times[f"{mode}/new"], plain)
        new["cpu_old_over_new"] = old["cpu_ms"] / new["cpu_ms"]
        new["controls_old_over_new"] = old["controls_cpu_ms"] / new["controls_cpu_ms"]
        new["wall_old_over_new"] = old["ms"] / new["ms"]
        out += [old, new]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompt", type=int, default=2000, help="prompt tokens per request")
    parser.add_argument("--history", type=int, default=200, help="output tokens so far")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--quick", action="store_true", help="8 steps (a short run)")
    parser.add_argument("--out", default="penalties", help="results/<out>.json")
    args = parser.parse_args()
    if args.quick:
        args.steps = 8
    torch.set_num_threads(args.threads)
    keep_activations_in_heap()  # the engine's process keeps large buffers in the heap too
    load_start = os.getloadavg()
    rows = run(args)
    load_end = os.getloadavg()
    columns = ["mode", "path", "ms", "cpu_ms", "cpu_vs_plain", "controls_cpu_ms"]
    print(table(rows, [*columns, "controls_old_over_new", "cpu_old_over_new"]))
    print(f"load average: start {load_start}, end {load_end}")
    path = write_result(args.out, {
        "what": "sampler step (sample_plan) ms, median wall and thread CPU: no controls "
                "(plain), the controls rebuilt per step (old, d16bbd4), kept incrementally "
                "(new); interleaved",
        "settings": vars(args),
        "environment": environment(torch.device("cpu")),
        "load_average": {"start": load_start, "end": load_end},
        "rows": rows,
    })  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
