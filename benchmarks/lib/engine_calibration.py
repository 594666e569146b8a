"""Timed steps of the real engine, for fitting the simulator's step cost on this machine.

Two settings. `calibrate_bare`: an `Engine` driven directly through a designed set of
step shapes (lone prompts of 8-250 words, decode batches of 1-32, staggered arrivals, 1-,
5- and 13-tile images alone and beside decodes), each `step()` timed on its own.
`calibrate_in_server`: the same engine behind the HTTP app in this process (uvicorn and
the engine loop on their threads, as `vlmserve serve` runs them) under a load sent by
another process; a step then costs from its start to the start of the next one while the
loop has work, so the loop's own work between steps (publishing stats, handing tokens to
the HTTP thread) and the HTTP and preprocessing threads' competition for the interpreter
and the two cores are in it.

Each sample is the step's `search.sim.step_time.StepWork` (counted as `search.sim.trace_sim`
prices a plan), its seconds and the vision tower's seconds within them; `fit_step_cost`
turns them into a `MeasuredStepCost`.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from search.sim.step_time import StepWork, count_work


def engine_config(flags: list[str]):
    """The EngineConfig `vlmserve serve FLAGS` runs."""
    from vlmserve.cli.engine_args import engine_config_from_args
    from vlmserve.cli.main import build_parser

    return engine_config_from_args(build_parser().parse_args(["serve", *flags]))


def step_work(items: list[tuple[int, int, int]], tiles: int, window: int | None = None) -> StepWork:
    """A step's work from (computed before, new tokens, prompt length) per scheduled
    sequence, counted as search.sim.trace_sim prices a plan (`window`: the model's
    sliding window, None without sliding layers)."""
    chunks = [(start, n, n == 1 and start >= num_prompt) for start, n, num_prompt in items]
    return count_work(chunks, tiles, window)


class StepRecorder:
    """Wraps one engine's `step` (and its scheduler and vision tower, to see the plan and
    count the tiles encoded): per step, when it started and ended, its work (None for a
    step with nothing to run) and whether work was left after it."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.steps: list[tuple[float, float, StepWork | None, bool]] = []
        self.recording = True
        self._items: list[tuple[int, int, int]] = []
        self._tiles, self._tower_s = 0, 0.0
        # The sliding layers' window (Gemma 3), for the windowed counts; None: none.
        self._window = next((w for w in engine.runner.kv_windows if w is not None), None)
        schedule, step = engine.scheduler.schedule, engine.step
        vision = engine.runner.encoder_stage.vision
        encode = vision.encode

        def recording_schedule():
            plan = schedule()
            seqs = engine.scheduler.seqs
            self._items = [(i.num_computed_tokens, i.num_new_tokens,
                            seqs[i.request_id].num_prompt_tokens)
                           for i in plan.scheduled]  # fmt: skip
            return plan

        def counting_encode(inputs):
            self._tiles += sum(int(x.pixel_values.shape[0]) for x in inputs)
            start = time.perf_counter()
            try:
                return encode(inputs)
            finally:
                self._tower_s += time.perf_counter() - start

        def timed_step():
            self._items, self._tiles, self._tower_s = [], 0, 0.0
            start = time.perf_counter()
            outputs = step()
            end = time.perf_counter()
            if self.recording:
                work = step_work(self._items, self._tiles, self._window) if self._items else None
                self.steps.append((start, end, work, engine.has_unfinished(), self._tower_s))
            return outputs

        engine.scheduler.schedule = recording_schedule
        vision.encode = counting_encode
        engine.step = timed_step

    def samples(self, cycle: bool) -> list[tuple[StepWork, float, float]]:
        """(work, seconds, tower seconds) of every step that ran something: its own time,
        or with `cycle` the time to the next step's start when the loop had work left (it
        went straight on; otherwise it waited for requests and only the step itself
        counts); and the vision tower's own time within it (timed around its call)."""
        out = []
        for i, (start, end, work, busy, tower_s) in enumerate(self.steps):
            if work is None:
                continue
            if cycle and busy and i + 1 < len(self.steps):
                end = self.steps[i + 1][0]
            out.append((work, end - start, tower_s))
        return out

    def pool_totals(self) -> dict[str, float]:
        return {k.removeprefix("preprocess_"): v for k, v in self.engine.stats().items()
                if k.startswith("preprocess_")}  # fmt: skip


def _png(size: tuple[int, int], seed: int) -> bytes:
    from benchmarks.lib.lumpy_load import png

    return png(*size, seed)


def calibration_waves(rng: random.Random, words: list[str], big_image: tuple[int, int]):
    """(step to add them at, requests): the designed step shapes; every image is new."""
    from vlmserve.inputs.processing import Request
    from vlmserve.sample.params import SamplingParams

    def req(num_words: int, images: list[bytes] = ()) -> Request:
        text = " ".join(rng.choice(words) for _ in range(num_words))
        content = [
            *({"type": "image", "image": im} for im in images),
            {"type": "text", "text": text},
        ]
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        return Request(messages=[{"role": "user", "content": content}], sampling=params)

    def img(size: tuple[int, int]) -> bytes:
        return _png(size, rng.randrange(1 << 30))

    waves, at = [], 0
    for num_words in (8, 30, 60, 120, 250, 8, 60):
        waves.append((at, [req(num_words)]))
        at += 20
    for batch in (4, 16, 32):
        waves.append((at, [req(rng.randint(8, 40)) for _ in range(batch)]))
        at += 20
    for k in range(12):  # two new every other step: decodes of every batch size + prefills
        waves.append((at + 2 * k, [req(rng.randint(8, 60)) for _ in range(2)]))
    at += 40
    for size in ((48, 48), (96, 96), big_image, big_image):
        waves.append((at, [req(6, [img(size)])]))
        at += 20
    waves.append((at, [req(6, [img(big_image) for _ in range(3)])]))
    waves.append((at + 1, [req(rng.randint(8, 40)) for _ in range(8)]))
    at += 30
    for k in range(4):  # 3-image requests arriving while text decodes
        waves.append((at + 3 * k, [req(6, [img(big_image) for _ in range(3)]), req(20)]))
    return waves


def calibrate_bare(
    flags: list[str], words: list[str], big_image: tuple[int, int], seed: int, rounds: int = 2
) -> tuple[list[tuple[StepWork, float, float]], dict[str, float]]:
    """The engine alone: each step's own time over `rounds` of the designed waves, after
    one warm-up round (first-call costs) that is not counted; the pool's totals likewise."""
    from vlmserve.engine.core import Engine

    recorder = StepRecorder(Engine(engine_config(flags)))
    engine, rng, before = recorder.engine, random.Random(seed), {}
    for round_ in range(rounds + 1):
        recorder.recording = round_ > 0
        if round_ == 1:
            before = recorder.pool_totals()
        waves, step = calibration_waves(rng, words, big_image), 0
        while waves or engine.has_unfinished():
            while waves and waves[0][0] <= step:
                for request in waves.pop(0)[1]:
                    engine.add_request(request)
            engine.step()
            step += 1
    after = recorder.pool_totals()
    return recorder.samples(cycle=False), {k: v - before.get(k, 0.0) for k, v in after.items()}


def calibrate_in_server(
    flags: list[str], run_load: Callable[[str], None], warm_up: Callable[[str], None]
) -> tuple[list[tuple[StepWork, float, float]], dict[str, float]]:
    """The engine behind the HTTP app here, under `run_load(url)` (sent from another
    process): each step's cycle (see the module docstring) and the pool's totals over the
    load, after `warm_up(url)`."""
    from benchmarks.reliability.server import in_process_server
    from vlmserve.engine.core import Engine
    from vlmserve.server.app import ServerConfig, create_app

    recorders: list[StepRecorder] = []

    def factory() -> Engine:
        recorders.append(StepRecorder(Engine(engine_config(flags))))
        return recorders[0].engine

    app = create_app(factory, ServerConfig(model_name="calibration"))
    with in_process_server(app) as url:
        warm_up(url)
        recorder = recorders[0]
        recorder.steps.clear()
        before = recorder.pool_totals()
        run_load(url)
        after = recorder.pool_totals()
    return recorder.samples(cycle=True), {k: v - before.get(k, 0.0) for k, v in after.items()}


def preprocess_s_per_tile(pool: dict[str, float], num_tiles: int) -> float:
    """Pool worker seconds per tile: decode, resize/tile and hand-off (not the queueing,
    which the simulator's worker queue produces itself)."""
    busy = sum(pool.get(f"{stage}_s_total", 0.0) for stage in ("decode", "resize", "handoff"))
    return busy / max(1, num_tiles)
