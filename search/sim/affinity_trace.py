"""A trace where images and system prompts recur and chats continue (issue 40).

The issue's words, "a share of requests reuse one of a few hundred images, chats
continue earlier turns", fixed as follows (before any routing was measured on it):

  * the pool: `num_images` = 300 images, the middle of "a few hundred" (200-500);
  * each new conversation opens on one of the pool's images with probability
    `pool_share` = 0.5 ("a share": half, neither most nor few), on an image of its own
    that no other conversation sends (a user's upload) with `unique_share` = 0.3, and on
    text alone otherwise (0.2);
  * the pool's popularity is Zipf-like, the k-th image drawn with weight 1 / k^s,
    `zipf_s` = 0.8: Breslau et al. (INFOCOM 1999) measured web objects' popularity as
    Zipf-like with s from 0.64 to 0.83; a few images are hot, most come back a few times;
  * one of `num_system_prompts` = 8 system prompts a conversation, drawn uniformly;
  * a share `followup_share` = 0.35 of requests are the next turn of a recent
    conversation (up to `max_turns` = 4): the same system prompt and image (the OpenAI
    API resends the history, images included) and the earlier turns' text (its prompt
    grows by the last answer and a new question).

Images are drawn once with their tile counts; seeded.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from search.sim.traces import TraceImage, TraceRequest, poisson_arrivals

__all__ = ["AffinityShape", "affinity_trace", "describe"]


@dataclass(frozen=True)
class AffinityShape:
    num_images: int = 300  # the pool that recurs
    pool_share: float = 0.5  # of new conversations, those about one of the pool's images
    unique_share: float = 0.3  # of new conversations, those about an image of their own
    zipf_s: float = 0.8  # the pool's popularity: weight of the k-th image ~ 1 / k^s
    tiles: tuple[int, int] = (1, 6)  # tiles per image, drawn once per image
    num_system_prompts: int = 8
    system_tokens: tuple[int, int] = (200, 600)  # per system prompt, drawn once
    followup_share: float = 0.35  # requests that continue a recent conversation
    max_turns: int = 4
    question_tokens: tuple[int, int] = (16, 64)
    max_tokens: tuple[int, int] = (32, 128)

    def __post_init__(self) -> None:
        for name in ("pool_share", "unique_share", "followup_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}={getattr(self, name)} must be in [0, 1]")
        if self.pool_share + self.unique_share > 1.0:
            raise ValueError(
                f"pool_share={self.pool_share} + unique_share={self.unique_share} exceeds 1"
            )
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
    """`num_requests` Poisson arrivals at `rate`/s of `shape`'s recurring mix. Pool images
    are named `img<k>` (k: popularity rank), an image of one conversation `own<i>`."""
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
            draw = rng.random()
            if draw < shape.pool_share:
                picked: tuple[TraceImage, ...] = (rng.choices(images, weights)[0],)
            elif draw < shape.pool_share + shape.unique_share:
                picked = (TraceImage(f"own{i}", rng.randint(*shape.tiles)),)
            else:
                picked = ()
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


def describe(trace: list[TraceRequest]) -> dict[str, float]:
    """What a trace holds, by the shape's names: conversations, the share of them about
    a pool image (`img*`) and about an image of their own (`own*`), the distinct pool
    images drawn, image requests (turns included) and distinct images among them."""
    first = {}
    for req in trace:
        first.setdefault(req.session_id, req)  # a conversation's opening turn
    opening = [r.images[0].content_hash for r in first.values() if r.images]
    image_requests = [r for r in trace if r.images]
    distinct = {im.content_hash for r in image_requests for im in r.images}
    num = max(1, len(first))
    return {
        "num_requests": len(trace),
        "num_conversations": len(first),
        "pool_share": sum(k.startswith("img") for k in opening) / num,
        "unique_share": sum(k.startswith("own") for k in opening) / num,
        "followup_share": (len(trace) - len(first)) / max(1, len(trace)),
        "num_pool_images_drawn": len({k for k in opening if k.startswith("img")}),
        "num_image_requests": len(image_requests),
        "num_distinct_images": len(distinct),
    }
