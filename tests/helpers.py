"""The engine and requests as the tests build them: the settings a test does not vary are
written once here, so each test names only what it changes."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from encoders.config import EncoderConfig
from scheduler.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from vlmserve.config import EngineConfig, ModelConfig
from vlmserve.engine.core import Engine
from vlmserve.inputs.processing import Request
from vlmserve.sample.params import SamplingParams


def greedy(max_tokens: int = 32, **params) -> SamplingParams:
    """Greedy, and exactly `max_tokens` long (random checkpoints emit EOS anywhere)."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **params)


GREEDY_32 = greedy(32)


def make_engine(
    path,
    *,
    num_blocks: int = 256,
    block_size: int = 4,
    budget: int = 64,
    max_num_seqs: int = 16,
    scheduler: dict | None = None,
    encoder: dict | None = None,
    speculative: SpeculativeConfig | None = None,
    **model,
) -> Engine:
    """An engine on the checkpoint at `path`: a small KV pool of `num_blocks` blocks,
    `budget` tokens a step; `model` goes to ModelConfig, `scheduler` / `encoder` to theirs."""
    return Engine(
        EngineConfig(
            ModelConfig(str(path), **model),
            CacheConfig(num_blocks=num_blocks, block_size=block_size),
            SchedulerConfig(
                max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, **(scheduler or {})
            ),
            speculative=speculative or SpeculativeConfig(),
            encoder=EncoderConfig(**(encoder or {})),
        )
    )


def chat(
    images: Sequence,
    text: str,
    params: SamplingParams = GREEDY_32,
    *,
    before: str | None = None,
    **request,
) -> Request:
    """One user turn: `before` (text ahead of the images, if any), the images (PIL images,
    bytes or paths), then `text`."""
    content = [{"type": "text", "text": before}] if before is not None else []
    content += [{"type": "image", "image": image} for image in images]
    content.append({"type": "text", "text": text})
    return Request(messages=[{"role": "user", "content": content}], sampling=params, **request)


def run_checked(engine: Engine, requests: list[Request]) -> list:
    """generate(), checking the block manager after every step and on drain."""
    outputs = []
    for request in requests:
        rid = engine.add_request(request)
        outputs.append(engine._states[rid].output)
    while engine.has_unfinished():
        engine.step()
        engine.scheduler.block_manager.check_integrity()
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks, "blocks leaked after the queue drained"
    return outputs


def huge_page_bytes(tensor: torch.Tensor) -> int:
    """AnonHugePages (/proc/self/smaps) of the mappings over `tensor`'s bytes: whole mappings
    (advice splits one; Linux merges neighbours alike, so a change measures better)."""
    begin, end = tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):  # a header: "lo-hi perms"
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                inside = lo < end and hi > begin
            elif inside and fields[0] == "AnonHugePages:":
                total += int(fields[1]) << 10
    return total
