"""What the structured-output server tests share: a real `vlmserve serve` subprocess on a
random LLaVA-OneVision with a byte-level tokenizer and a chat template that renders tools,
the openai client on it, image messages and the tools they call."""

from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from typing import Literal

from openai import OpenAI
from pydantic import BaseModel, Field

from benchmarks.reliability.server import ServerProcess
from vlmserve.worker.models.random_checkpoint import make_vlm_checkpoint

MAX_TOKENS = 700
NUM_PARSE = 56  # >= 50 pydantic parses at temperature 1
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|> system You may call: {% for t in tools %}"
    "{{ t['function']['name'] }} {{ t['function']['parameters'] | tojson }} {% endfor %}"
    'Answer with <tool_call> {"name": ..., "arguments": ...} </tool_call><|im_end|> '
    "{% endif %}{% for m in messages %}<|im_start|> {{ m['role'] }} "
    "{% if m['content'] is string %}{{ m['content'] }} {% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<image> "
    "{% else %}{{ p['text'] }} {% endif %}{% endfor %}{% endif %}"
    "{% for c in m['tool_calls'] or [] %}<tool_call> {{ c['function'] | tojson }} </tool_call> "
    "{% endfor %}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"enum": ["c", "f"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit", "days"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "maxLength": 12},
                "top": {"type": "boolean"},
            },
            "required": ["query", "top"],
        },
    },
}


class Colour(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Shape(BaseModel):
    kind: Literal["circle", "square", "star"]
    colour: Colour
    size: int = Field(ge=0, le=99)


class Scene(BaseModel):
    title: str = Field(max_length=12)
    shapes: list[Shape] = Field(max_length=3)
    tags: list[str] = Field(max_length=2)
    note: str | None = Field(default=None, max_length=8)
    count: int | None = Field(default=None, ge=-5, le=500)


def start_server(tmp_path_factory):
    path = make_vlm_checkpoint(
        tmp_path_factory.mktemp("ov_bytes"), "llava_onevision", vocab=512, tokenizer="bytes"
    )
    (path / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    args = ("--model", str(path), "--async-scheduling", "--max-num-seqs", "32")
    with ServerProcess(*args, "--block-size", "16", "--num-kv-blocks", "2048") as proc:
        yield proc


def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def png_url(seed: int) -> str:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(1, 255, (40, 60, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def messages(seed: int, image: bool = True) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": png_url(seed)}}] if image else []
    return [{"role": "user", "content": [*parts, {"type": "text", "text": f"describe {seed}"}]}]


def run_all(fn, seeds) -> list:
    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(fn, seeds))
