"""The captioning batch job: folder and JSONL input, per-item errors, resume after an
interruption (each item exactly once), and the CLI."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil

import pytest

from encoders import image_io
from tests.helpers import chat, make_engine
from vlmserve.cli.caption import CaptionItem, discover, read_done, run_caption
from vlmserve.cli.caption_cli import register
from vlmserve.embedded import DEFAULT_MODEL_DIR
from vlmserve.engine.core import Engine
from vlmserve.sample.params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(llava_ov_path) -> Engine:
    return make_engine(llava_ov_path, num_blocks=512, budget=256)


@pytest.fixture
def folder(tmp_path, random_image):
    """5 images in nested folders, a corrupt .jpg, and a text file that is not an input."""
    root = tmp_path / "images"
    (root / "b" / "deep").mkdir(parents=True)
    names = ["a1.png", "a2.jpg", "b/b1.png", "b/deep/c1.png", "b/deep/c2.webp"]
    for i, name in enumerate(names):
        random_image(i, 40 + 8 * i, 36).save(root / name)
    (root / "b" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 truncated")
    (root / "notes.txt").write_text("not an image")
    return root


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def reference_caption(engine: Engine, path, prompt: str = "Describe the image.") -> str:
    [out] = engine.generate([chat([str(path)], prompt, GREEDY)])
    return out.text


def test_discover_walks_the_folder_recursively(folder):
    ids = [item.item_id for item in discover(folder)]
    assert ids == ["a1.png", "a2.jpg", "b/b1.png", "b/broken.jpg", "b/deep/c1.png",
                   "b/deep/c2.webp"]  # fmt: skip
    with pytest.raises(ValueError, match="neither a folder nor a file"):
        discover(folder / "missing")


@pytest.mark.slow
def test_folder_with_a_corrupt_file(engine, folder, tmp_path):
    out = tmp_path / "captions.jsonl"
    summary = run_caption(engine, discover(folder), out, GREEDY, max_in_flight=3, progress=False)
    records = {r["id"]: r for r in lines(out)}
    assert sorted(records) == sorted(item.item_id for item in discover(folder))
    broken = records.pop("b/broken.jpg")
    assert broken["caption"] is None
    # A decode error (image_io names the kind: corrupt, truncated, unsupported).
    assert issubclass(getattr(image_io, broken["error_type"]), image_io.ImageDecodeError)
    for record in records.values():
        assert record["error"] is None and record["num_output_tokens"] == 6
        assert record["num_image_tokens"] > 0
        assert record["num_prompt_tokens"] > record["num_image_tokens"]
        assert record["finish_reason"] == "length" and record["generate_s"] >= 0
    # The batched job gives each image the caption it gets alone.
    assert records["b/b1.png"]["caption"] == reference_caption(engine, folder / "b" / "b1.png")
    assert (summary.num_captioned, summary.num_failed, summary.num_skipped) == (5, 1, 0)
    assert summary.num_output_tokens == 30 and summary.images_per_s > 0
    assert "5 captioned, 1 failed" in summary.render()
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_resume_after_limit_and_interrupt_writes_each_item_once(engine, folder, tmp_path):
    out = tmp_path / "captions.jsonl"
    items = discover(folder)
    first = run_caption(engine, items, out, GREEDY, limit=2, progress=False)
    assert first.num_captioned + first.num_failed == 2

    # Ctrl-C in the middle of the next run: only whole lines, in-flight work dropped.
    calls = {"n": 0}
    real_step = engine.step

    def interrupted_step():
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return real_step()

    engine.step = interrupted_step
    try:
        second = run_caption(engine, items, out, GREEDY, max_in_flight=2, progress=False)
    finally:
        del engine.step
    assert second.interrupted and second.num_skipped == 2
    assert not engine.has_unfinished(), "in-flight requests must be aborted"
    partial = lines(out)  # parses: every line whole
    assert len(partial) < len(items)

    # A crash mid-write leaves half a line: the rerun cuts it and redoes that item.
    with out.open("a") as f:
        f.write('{"id": "b/deep/c1.png", "capt')
    third = run_caption(engine, items, out, GREEDY, progress=False)
    assert not third.interrupted
    ids = [r["id"] for r in lines(out)]
    assert sorted(ids) == sorted(item.item_id for item in items)  # each exactly once
    assert third.num_skipped == len(partial)
    again = run_caption(engine, items, out, GREEDY, progress=False)
    assert (again.num_skipped, again.num_captioned, again.num_failed) == (len(items), 0, 0)


def test_retry_errors_reruns_only_failed_items(engine, folder, tmp_path):
    out = tmp_path / "captions.jsonl"
    items = discover(folder)
    run_caption(engine, items, out, GREEDY, progress=False)
    (folder / "b" / "broken.jpg").unlink()
    shutil.copy(folder / "a1.png", folder / "b" / "broken.jpg")  # now a readable image
    summary = run_caption(engine, items, out, GREEDY, retry_errors=True, progress=False)
    assert (summary.num_captioned, summary.num_failed) == (1, 0)
    records = lines(out)
    assert len(records) == len(items) and all(r["error"] is None for r in records)
    assert read_done(out) == {item.item_id for item in items}


def test_jsonl_input_with_prompts_urls_and_repeats(engine, folder, tmp_path, random_image):
    buf = io.BytesIO()
    random_image(42, 50, 40).save(buf, "PNG")
    data_url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    spec = tmp_path / "items.jsonl"
    spec.write_text(
        "\n".join(json.dumps(r) for r in [
            {"path": str(folder / "a1.png"), "prompt": "where is the star"},
            {"path": str(folder / "a1.png"), "prompt": "how many circles"},  # same image
            {"url": data_url, "id": "inline"},
            {"path": "missing.png"},
            {"url": "ftp://example.com/x.png"},
        ]) + "\n"
    )  # fmt: skip
    items = discover(spec, prompt="Describe.")
    assert [i.item_id for i in items] == [
        f"{folder}/a1.png", f"{folder}/a1.png#2", "inline", "missing.png",
        "ftp://example.com/x.png",
    ]  # fmt: skip
    assert items[1] == CaptionItem(f"{folder}/a1.png#2", str(folder / "a1.png"), "how many circles")
    assert items[3].source == str(tmp_path / "missing.png")  # relative to the JSONL
    out = tmp_path / "out.jsonl"
    summary = run_caption(engine, items, out, GREEDY, max_in_flight=1, progress=False)
    records = {r["id"]: r for r in lines(out)}
    assert (summary.num_captioned, summary.num_failed) == (3, 2)
    assert "cannot read image file" in records["missing.png"]["error"]
    assert "scheme" in records["ftp://example.com/x.png"]["error"]
    assert records["inline"]["caption"] is not None
    # The second question about the same image reuses the image's KV blocks.
    repeat, first = records[f"{folder}/a1.png#2"], records[f"{folder}/a1.png"]
    assert repeat["num_cached_tokens"] >= first["num_image_tokens"]
    assert records[f"{folder}/a1.png"]["caption"] == reference_caption(
        engine, folder / "a1.png", "where is the star"
    )


def test_bad_jsonl_names_the_line(tmp_path):
    spec = tmp_path / "items.jsonl"
    spec.write_text('{"path": "a.png"}\n{"prompt": "no image"}\n')
    with pytest.raises(ValueError, match="items.jsonl:2: needs a 'path' or 'url'"):
        discover(spec)


@pytest.mark.slow
def test_cli_captions_a_folder(llava_ov_path, folder, tmp_path, capsys):
    import argparse

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    out = tmp_path / "cli.jsonl"
    args = parser.parse_args([
        "caption", str(folder), "--output", str(out), "--model", str(llava_ov_path),
        "--max-tokens", "3", "--num-kv-blocks", "256", "--block-size", "4", "--no-progress",
    ])  # fmt: skip
    assert args.func(args) == 0
    assert len(lines(out)) == 6
    assert "5 captioned, 1 failed" in capsys.readouterr().err


@pytest.mark.slow
def test_embedded_model_captions_match_the_scenes(tmp_path):
    from vlmserve.embedded.evaluate import heldout_scenes
    from vlmserve.embedded.scenes import caption, render_scene

    root = tmp_path / "scenes"
    root.mkdir()
    scenes = heldout_scenes(6) + heldout_scenes(2, multi_tile=True)
    for i, scene in enumerate(scenes):
        render_scene(scene).save(root / f"s{i}.{'png' if i % 2 else 'jpg'}", quality=95)
    # The default model of every front door.
    engine = make_engine(DEFAULT_MODEL_DIR, num_blocks=512, block_size=16, budget=512)
    shutil.copy(root / "s0.jpg", root / "s0_again.jpg")  # the same bytes twice
    sources = []  # what the job hands the engine: bytes, never a decoded image
    prepare = engine.prepare
    engine.prepare = lambda request: (
        sources.append(request.messages[0]["content"][0]["image"]) or prepare(request)
    )
    out = tmp_path / "captions.jsonl"
    params = SamplingParams(max_tokens=40, temperature=0.0)
    run_caption(engine, discover(root), out, params, max_in_flight=4, num_workers=1, progress=False)
    assert len(sources) == 9 and all(isinstance(s, bytes) for s in sources)
    stats = engine.stats()
    assert stats["preprocess_images"] >= 8 and stats["encoder_cache_misses"] >= 8
    got = {row["id"]: row["caption"].strip() for row in lines(out)}
    assert got["s0_again.jpg"] == got["s0.jpg"]
    right = sum(
        got[f"s{i}.{'png' if i % 2 else 'jpg'}"] == caption(s) for i, s in enumerate(scenes)
    )
    assert right >= 7, (got, [caption(s) for s in scenes])


@pytest.mark.slow
def test_cli_speculates_and_captions_as_without(tmp_path, capsys):
    from vlmserve.cli.main import main
    from vlmserve.embedded.evaluate import heldout_scenes
    from vlmserve.embedded.scenes import render_scene

    root = tmp_path / "scenes"
    root.mkdir()
    for i, scene in enumerate(heldout_scenes(4)):
        render_scene(scene).save(root / f"s{i}.png")
    args = ["caption", str(root), "--max-tokens", "40", "--no-progress"]
    assert (
        main([*args, "--output", str(tmp_path / "plain.jsonl"), "--speculative-tokens", "0"]) == 0
    )
    plain = capsys.readouterr().err
    spec_args = ["--speculative-tokens", "4", "--no-adaptive-speculation",
                 "--speculative-ngram-min", "1"]  # fmt: skip
    assert main([*args, "--output", str(tmp_path / "spec.jsonl"), *spec_args]) == 0
    spec = capsys.readouterr().err
    captions = {name: [(r["id"], r["caption"]) for r in lines(tmp_path / name)]
                for name in ("plain.jsonl", "spec.jsonl")}  # fmt: skip
    assert len(captions["plain.jsonl"]) == 4
    assert sorted(captions["spec.jsonl"]) == sorted(captions["plain.jsonl"])  # lossless
    assert "speculation off" in plain
    match = re.search(r"speculation (\d+) drafted", spec)
    assert match and int(match.group(1)) > 0, spec


def test_an_image_that_fails_in_the_pool_is_an_error_line(engine, tmp_path, random_image):
    """A valid header over corrupt pixel data: the request is queued on its header and the
    decode fails later, in the pool; the job still writes that item's error line."""
    root = tmp_path / "late"
    root.mkdir()
    random_image(1, 48, 40).save(root / "good.png")
    buf = io.BytesIO()
    random_image(2, 64, 64).save(buf, "PNG")
    data = bytearray(buf.getvalue())
    idat = data.index(b"IDAT") + 8
    data[idat + 2 : idat + 60] = bytes(58)  # the compressed pixel stream, garbled
    (root / "late.png").write_bytes(bytes(data))
    assert image_io.read_header(bytes(data)).width == 64  # the header alone is fine
    out = tmp_path / "captions.jsonl"
    summary = run_caption(engine, discover(root), out, GREEDY, progress=False)
    records = {r["id"]: r for r in lines(out)}
    assert records["good.png"]["error"] is None and records["good.png"]["num_output_tokens"] == 6
    assert records["late.png"]["caption"] is None
    assert issubclass(
        getattr(image_io, records["late.png"]["error_type"]), image_io.ImageDecodeError
    )
    assert (summary.num_captioned, summary.num_failed) == (1, 1)
