"""Mixed text / image traces drawn from a shape and a seed: traffic a policy was not tuned
to. A shape fixes the arrival rate, the share of requests that carry images, how many
images and tiles, how often an image repeats, the output-length distribution (Pareto or
log-normal: heavy tails, as real chat is), optional bursts of image requests and a few
requests no KV pool can hold. Classes are ``text`` and ``image`` (whether it carries
images), as the server's per-class metrics count them.

`INDEPENDENT` is the trace issue 32 was found on, rebuilt from its description: about
2,500 requests over 300 s, Poisson arrivals at about 8/s, 30% with 4 images of 1–13 tiles
(some repeating), Pareto outputs, a burst of 15 image requests every 20 s, 2 never-fits.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal

from search.sim.traces import SYSTEM_TOKENS, TraceImage, TraceRequest, poisson_arrivals

OutputDist = Literal["pareto", "lognormal"]
MAX_OUTPUT_TOKENS = 1024  # the tail's cap: a chat answer, not a document


@dataclass(frozen=True)
class TraceShape:
    name: str
    rate: float  # Poisson arrivals per second, all classes
    duration_s: float
    image_share: float  # of the Poisson arrivals, those carrying images
    images_per_request: tuple[int, int]  # inclusive range
    max_tiles: int = 13  # tiles per image: uniform in [1, max_tiles]
    repeat_share: float = 0.2  # of images, a repeat of a recent one (cache hits)
    output: OutputDist = "pareto"
    output_scale: float = 48.0  # Pareto x_m, or the log-normal's median
    output_shape: float = 1.6  # Pareto alpha, or the log-normal's sigma
    burst_size: int = 0  # image requests per burst (0: no bursts)
    burst_period_s: float = 20.0
    burst_window_s: float = 2.0
    num_never_fits: int = 2

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.duration_s <= 0 or not 0 <= self.image_share <= 1:
            raise ValueError(f"{self.name}: need rate > 0, duration > 0, image share in [0, 1]")
        lo, hi = self.images_per_request
        if not 1 <= lo <= hi or self.max_tiles < 1 or self.output_shape <= 0:
            raise ValueError(f"{self.name}: bad images per request, tiles or output shape")


INDEPENDENT = TraceShape(
    "independent", rate=8.0, duration_s=300.0, image_share=0.3, images_per_request=(4, 4),
    output="pareto", burst_size=15, burst_period_s=20.0,
)  # fmt: skip


def output_tokens(shape: TraceShape, rng: random.Random) -> int:
    if shape.output == "pareto":
        n = shape.output_scale * rng.paretovariate(shape.output_shape)
    else:
        n = rng.lognormvariate(math.log(shape.output_scale), shape.output_shape)
    return max(1, min(MAX_OUTPUT_TOKENS, int(n)))


class _Images:
    """New images, and repeats drawn from the last 50 seen."""

    def __init__(self, shape: TraceShape, rng: random.Random) -> None:
        self.shape, self.rng, self.seen = shape, rng, []

    def draw(self, rid: str, count: int) -> tuple[TraceImage, ...]:
        out = []
        for k in range(count):
            if self.seen and self.rng.random() < self.shape.repeat_share:
                out.append(self.rng.choice(self.seen[-50:]))
                continue
            image = TraceImage(f"{rid}-{k}", self.rng.randint(1, self.shape.max_tiles))
            self.seen.append(image)
            out.append(image)
        return tuple(out)


def shaped_trace(shape: TraceShape, seed: int) -> list[TraceRequest]:
    """The trace of `shape` drawn with `seed`, sorted by arrival."""
    rng = random.Random(seed)
    images = _Images(shape, rng)
    out: list[TraceRequest] = []
    times = poisson_arrivals(shape.rate, int(shape.rate * shape.duration_s * 2) + 1, rng)
    for i, t in enumerate(x for x in times if x < shape.duration_s):
        rid = f"r{i}"
        if rng.random() < shape.image_share:
            out.append(_image(rid, t, images.draw(rid, rng.randint(*shape.images_per_request)),
                              shape, rng))  # fmt: skip
        else:
            text = rng.randint(20, 400)
            out.append(TraceRequest(rid, t, "text", text, output_tokens(shape, rng), (),
                                    SYSTEM_TOKENS))  # fmt: skip
    if shape.burst_size:
        num_bursts = int(shape.duration_s // shape.burst_period_s)
        for b in range(num_bursts):
            start = (b + 0.5) * shape.burst_period_s
            for i in range(shape.burst_size):
                rid = f"b{b}.{i}"
                t = start + rng.random() * shape.burst_window_s
                count = shape.images_per_request[1]
                out.append(_image(rid, t, images.draw(rid, count), shape, rng))
    for i in range(shape.num_never_fits):
        t = rng.random() * shape.duration_s
        image = (TraceImage(f"n{i}", shape.max_tiles),)
        out.append(TraceRequest(f"n{i}", t, "image", 30, 1 << 20, image, SYSTEM_TOKENS))
    return sorted(out, key=lambda r: r.arrival_s)


def _image(
    rid: str, t: float, images: tuple[TraceImage, ...], shape: TraceShape, rng: random.Random
) -> TraceRequest:
    return TraceRequest(
        rid, t, "image", rng.randint(10, 60), output_tokens(shape, rng), images, SYSTEM_TOKENS
    )
