"""`vlmserve caption`: the offline captioning batch job.

A folder (recursive) of images or a JSONL of `{"path" | "url", "prompt"?, "id"?}` in,
one JSONL line per item out (caption, token counts, timings, or the item's error).
Throughput comes from keeping the engine's dense batch full: up to `max_in_flight`
requests live in the engine while a thread pool reads the next images (bytes, header
checked) and prepares their requests; the images take the engine's image path
(preprocessing pool, encoder cache), never a decoded image.

What must stay true: the output holds whole lines only and each item at most once, so a
rerun (after Ctrl-C, a crash or `--limit`) skips what is done and appends the rest.
"""

from __future__ import annotations

import asyncio
import functools
import json
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from encoders.image_io import read_header
from encoders.images import read_source
from vlmserve.cli.caption_json import json_checked
from vlmserve.engine.core import Engine, PreparedRequest, RequestOutput
from vlmserve.inputs.processing import Request
from vlmserve.sample.params import SamplingParams

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"}
DEFAULT_PROMPT = "Describe the image."  # the embedded default model's caption prompt


@dataclass(frozen=True)
class CaptionItem:
    item_id: str  # the resume key
    source: str  # a local path or an image URL
    prompt: str


@dataclass
class CaptionSummary:
    num_items: int = 0  # in the input
    num_skipped: int = 0  # already in the output
    num_captioned: int = 0
    num_failed: int = 0
    num_output_tokens: int = 0
    elapsed_s: float = 0.0
    interrupted: bool = False

    @property
    def images_per_s(self) -> float:
        return (self.num_captioned + self.num_failed) / max(self.elapsed_s, 1e-9)

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / max(self.elapsed_s, 1e-9)

    def render(self) -> str:
        state = "interrupted (rerun to resume)" if self.interrupted else "done"
        return (
            f"{state}: {self.num_captioned} captioned, {self.num_failed} failed, "
            f"{self.num_skipped} already done, of {self.num_items}; {self.elapsed_s:.1f} s, "
            f"{self.images_per_s:.2f} images/s, {self.tokens_per_s:.1f} tokens/s"
        )


# --- input and resume -----------------------------------------------------------------


def discover(input_path: Path, prompt: str = DEFAULT_PROMPT) -> list[CaptionItem]:
    """Items of a folder (every image file below it, sorted) or of a JSONL file.
    Ids are unique: a repeated id gets `#2`, `#3`, ... in input order."""
    if input_path.is_dir():
        files = sorted(
            p for p in input_path.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES
        )
        raw = [(p.relative_to(input_path).as_posix(), str(p), prompt) for p in files]
    elif input_path.is_file():
        raw = list(_jsonl_items(input_path, prompt))
    else:
        raise ValueError(f"caption input {str(input_path)!r} is neither a folder nor a file")
    seen: dict[str, int] = {}
    items = []
    for item_id, source, item_prompt in raw:
        seen[item_id] = seen.get(item_id, 0) + 1
        suffix = f"#{seen[item_id]}" if seen[item_id] > 1 else ""
        items.append(CaptionItem(item_id + suffix, source, item_prompt))
    return items


def _jsonl_items(path: Path, prompt: str) -> Iterator[tuple[str, str, str]]:
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{line_no}: not JSON: {e}") from e
        source = (record.get("path") or record.get("url")) if isinstance(record, dict) else None
        if not isinstance(source, str):
            raise ValueError(f"{path}:{line_no}: needs a 'path' or 'url' string")
        if "path" in record and not Path(source).is_absolute():
            source = str(path.parent / source)  # relative to the JSONL file
        item_id = str(record.get("id") or record.get("path") or record.get("url"))
        yield item_id, source, str(record.get("prompt") or prompt)


def read_done(output: Path, retry_errors: bool = False) -> set[str]:
    """Ids already in `output`. Cuts a partial last line (a killed run) and, with
    `retry_errors`, drops the error lines so those items run again."""
    if not output.exists():
        return set()
    data = output.read_bytes()
    whole = data[: data.rfind(b"\n") + 1]
    lines = [line for line in whole.decode().splitlines() if line.strip()]
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a damaged line: its item runs again
    if retry_errors:
        records = [r for r in records if not r.get("error")]
    if len(whole) != len(data) or retry_errors or len(records) != len(lines):
        output.write_text("".join(json.dumps(r) + "\n" for r in records))
    return {str(r["id"]) for r in records if "id" in r}


# --- the job --------------------------------------------------------------------------


def load_image_bytes(item: CaptionItem, max_pixels: int) -> bytes:
    """Read one image's bytes (in a worker thread) and check its header, so a file that is
    not a supported image fails alone and early. The bytes, never a decoded image, go to
    the engine: its image path (header token count, preprocessing pool, encoder cache
    keyed by the bytes) is the one every front door takes."""
    source = item.source
    if "://" in source or source.startswith("data:"):
        if source.startswith("file://"):
            from urllib.parse import unquote, urlsplit

            source = unquote(urlsplit(source).path)
        else:
            from vlmserve.server.media import MediaPolicy, load_media

            source = asyncio.run(load_media(source, MediaPolicy()))
    data = read_source(source)
    read_header(data, max_pixels)
    return data


def error_record(item: CaptionItem, message: str, error_type: str) -> dict:
    """An item's output line when it failed (read, header, prepare or generation)."""
    return {"id": item.item_id, "path": item.source, "caption": None, "error": message,
            "error_type": error_type}  # fmt: skip


def caption_record(item: CaptionItem, out: RequestOutput, load_s: float, gen_s: float) -> dict:
    """An item's output line when it was captioned."""
    return {
        "id": item.item_id, "path": item.source, "caption": out.text,
        "finish_reason": out.finish_reason, "num_prompt_tokens": out.num_prompt_tokens,
        "num_image_tokens": out.num_image_tokens, "num_cached_tokens": out.num_cached_tokens,
        "num_output_tokens": len(out.token_ids), "load_s": round(load_s, 4),
        "generate_s": round(gen_s, 4), "error": None,
    }  # fmt: skip


class JsonlSink:
    """Appends records to the output JSONL. An item is done only when its whole line is
    on disk: one write per line, flushed, so a kill leaves at most a partial last line
    (`read_done` cuts it). A record whose id is already written is dropped, so a retried
    task (Ray) never writes an item twice."""

    def __init__(self, file: IO[str], summary: CaptionSummary, done: set[str]) -> None:
        self.file, self.summary, self.done = file, summary, set(done)

    def write(self, record: dict) -> bool:
        if record["id"] in self.done:
            return False
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        self.done.add(record["id"])
        if record["error"]:
            self.summary.num_failed += 1
        else:
            self.summary.num_captioned += 1
            self.summary.num_output_tokens += record["num_output_tokens"]
        return True


def todo_items(
    items: list[CaptionItem], output: Path, limit: int | None, retry_errors: bool
) -> tuple[list[CaptionItem], CaptionSummary, set[str]]:
    """The items not yet in `output` (at most `limit`), the run's summary so far and the
    ids already done."""
    done = read_done(output, retry_errors)
    todo = [item for item in items if item.item_id not in done]
    summary = CaptionSummary(num_items=len(items), num_skipped=len(items) - len(todo))
    output.parent.mkdir(parents=True, exist_ok=True)
    return (todo[:limit] if limit is not None else todo), summary, done


def write_records(
    records: Iterator[dict], output: Path, summary: CaptionSummary, done: set[str],
    num_todo: int, progress: bool,
) -> None:  # fmt: skip
    """Drain `records` into `output` (appending) with a progress bar."""
    from tqdm import tqdm

    start = time.perf_counter()
    with (
        output.open("a") as file,
        tqdm(total=num_todo, unit="img", disable=not progress, file=sys.stderr) as bar,
    ):
        sink = JsonlSink(file, summary, done)
        for record in records:
            sink.write(record)
            bar.update(1)
            elapsed = time.perf_counter() - start
            bar.set_postfix(tok_s=f"{summary.num_output_tokens / elapsed:.1f}")


def run_caption(
    engine: Engine,
    items: list[CaptionItem],
    output: Path,
    sampling: SamplingParams,
    *,
    max_in_flight: int = 32,
    num_workers: int = 4,
    limit: int | None = None,
    retry_errors: bool = False,
    progress: bool = True,
) -> CaptionSummary:
    """Caption `items` not yet in `output`, appending a line per item."""
    start = time.perf_counter()
    todo, summary, done = todo_items(items, output, limit, retry_errors)
    prepare = functools.partial(timed_prepare, engine, sampling=sampling)
    in_flight: dict[str, tuple[CaptionItem, float, float]] = {}
    with ThreadPoolExecutor(num_workers, thread_name_prefix="caption-load") as pool:
        try:
            records = caption_stream(engine, todo, prepare, pool, in_flight, max_in_flight)
            records = json_checked(records, sampling)
            write_records(records, output, summary, done, len(todo), progress)
        except KeyboardInterrupt:
            summary.interrupted = True
            pool.shutdown(wait=False, cancel_futures=True)
            for request_id in in_flight:  # their lines were never written: a rerun does them
                engine.abort(request_id)
    summary.elapsed_s = time.perf_counter() - start
    return summary


Prepare = Callable[[CaptionItem], tuple[PreparedRequest, float]]


def caption_stream(
    engine: Engine,
    todo: list[CaptionItem],
    prepare: Prepare,
    pool: ThreadPoolExecutor,
    in_flight: dict[str, tuple[CaptionItem, float, float]],
    max_in_flight: int,
) -> Iterator[dict]:
    """The job's loop on one engine: yields each item's record as it finishes. `prepare`
    runs on `pool`; `in_flight` maps request id -> (item, load_s, time added), so a caller
    that stops early can abort what is left."""
    queue = iter(todo)
    loading: deque[tuple[CaptionItem, Future]] = deque()

    def refill() -> None:
        while len(loading) < 2 * max_in_flight:
            item = next(queue, None)
            if item is None:
                return
            loading.append((item, pool.submit(prepare, item)))

    refill()
    while loading or in_flight:
        # Admit loaded images while there is room; wait for one only when the engine idles.
        while loading and len(in_flight) < max_in_flight:
            item, future = loading[0]
            if not future.done() and engine.has_unfinished():
                break
            loading.popleft()
            try:
                prepared, load_s = future.result()
                in_flight[engine.add_request(prepared)] = (item, load_s, time.perf_counter())
            except (ValueError, OSError) as e:  # RequestError is a ValueError
                yield error_record(item, str(e), type(e).__name__)
            refill()
        if not engine.has_unfinished():
            continue
        for out in engine.step():
            if out.finished:
                item, load_s, t_add = in_flight.pop(out.request_id)
                if out.finish_reason == "error":  # e.g. an image that failed in the pool
                    error_type = out.error_type or "RequestError"
                    yield error_record(item, out.error or "failed", error_type)
                else:
                    yield caption_record(item, out, load_s, time.perf_counter() - t_add)


def timed_prepare(
    engine: Engine, item: CaptionItem, sampling: SamplingParams, data: bytes | None = None
) -> tuple[PreparedRequest, float]:
    """On a loader thread: read the image (unless its bytes are given: Ray's read map has
    them) and prepare its request (template, tokens, tiles), so the engine's thread only
    steps."""
    start = time.perf_counter()
    if data is None:
        data = load_image_bytes(item, engine.config.encoder.max_pixels)
    content = [{"type": "image", "image": data}, {"type": "text", "text": item.prompt}]
    request = Request([{"role": "user", "content": content}], sampling=sampling)
    return engine.prepare(request), time.perf_counter() - start
