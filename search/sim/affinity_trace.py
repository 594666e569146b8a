"""A trace where images and system prompts recur and chats continue (issue 40).

Each new conversation draws one of `num_system_prompts` system prompts and, with
probability `image_share`, one of `num_images` images by a Zipf law (a few are hot, most
come back a handful of times); a share `followup_share` of requests are the next turn of
a recent conversation: the same system prompt and image, and the earlier turns' text
(its prompt grows by the last answer and a new question). Seeded.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from search.sim.traces import TraceImage, TraceRequest, poisson_arrivals

__all__ = ["AffinityShape", "affinity_trace"]


@dataclass(frozen=True)
class AffinityShape:
    num_images: int = 300
    image_share: float = 0.8  # of new conversations, those about an image
    zipf_s: float = 0.9  # image popularity: weight of the k-th image ~ 1 / k^s
    tiles: tuple[int, int] = (1, 6)  # tiles per image, drawn once per image
    num_system_prompts: int = 8
    system_tokens: tuple[int, int] = (200, 600)  # per system prompt, drawn once
    followup_share: float = 0.35  # requests that continue a recent conversation
    max_turns: int = 4
    question_tokens: tuple[int, int] = (16, 64)
    max_tokens: tuple[int, int] = (32, 128)

    def __post_init__(self) -> None:
        for name in ("image_share", "followup_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}={getattr(self, name)} must be in [0, 1]")
        if min(self.num_images, self.num_system_prompts, self.max_turns) < 1:
            raise ValueError("num_images, num_system_prompts and max_turns must be >= 1")


@dataclass
class _Conversation:
    session_id: str
    system_prompt_id: int
    images: tuple[TraceImage, ...]
    num_text_tokens: int  # the prompt's text so far: questions and answers
    num_turns: int


def affinity_trace(
    num_requests: int, rate: float, shape: AffinityShape = AffinityShape(), seed: int = 0
) -> list[TraceRequest]:
    """`num_requests` Poisson arrivals at `rate`/s of `shape`'s recurring mix."""
    if num_requests < 1:
        raise ValueError(f"num_requests={num_requests} must be >= 1")
    rng = random.Random(seed)
    images = [TraceImage(f"img{k}", rng.randint(*shape.tiles)) for k in range(shape.num_images)]
    weights = [1.0 / (k + 1) ** shape.zipf_s for k in range(shape.num_images)]
    system = [rng.randint(*shape.system_tokens) for _ in range(shape.num_system_prompts)]
    open_chats: list[_Conversation] = []
    out = []
    for i, t in enumerate(poisson_arrivals(rate, num_requests, rng)):
        question = rng.randint(*shape.question_tokens)
        if open_chats and rng.random() < shape.followup_share:
            chat = rng.choice(open_chats[-64:])  # a recent conversation
            chat.num_text_tokens += question
            chat.num_turns += 1
            if chat.num_turns >= shape.max_turns:
                open_chats.remove(chat)
        else:
            with_image = rng.random() < shape.image_share
            picked = (rng.choices(images, weights)[0],) if with_image else ()
            sid = rng.randrange(shape.num_system_prompts) + 1
            chat = _Conversation(f"s{i}", sid, picked, question, 1)
            open_chats.append(chat)
        answer = rng.randint(*shape.max_tokens)
        out.append(
            TraceRequest(
                request_id=f"r{i}",
                arrival_s=t,
                request_class="image" if chat.images else "text",
                num_text_tokens=chat.num_text_tokens,
                max_tokens=answer,
                images=chat.images,
                num_system_tokens=system[chat.system_prompt_id - 1],
                system_prompt_id=chat.system_prompt_id,
                session_id=chat.session_id,
            )
        )
        chat.num_text_tokens += answer  # the next turn's prompt holds this answer
    return out
