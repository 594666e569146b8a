"""The structured-output doors: `caption --json-schema` writes one validated object per
image (resumable), `generate --json-schema` prints one; a bad schema file is refused."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("jsonschema")  # the tests' validator: skip where missing
pytest.importorskip("xgrammar")  # the structured outputs themselves

import jsonschema

from vlmserve.cli.main import main
from vlmserve.worker.models.random_checkpoint import make_vlm_checkpoint

SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"type": "string", "maxLength": 8},
        "colour": {"enum": ["red", "green", "blue"]},
        "objects": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    "maxItems": 3},
    },
    "required": ["label", "colour", "objects"],
}  # fmt: skip


@pytest.fixture(scope="module")
def byte_ov(tmp_path_factory):
    return make_vlm_checkpoint(
        tmp_path_factory.mktemp("ov_bytes"), "llava_onevision", vocab=512, tokenizer="bytes"
    )


@pytest.fixture
def schema_file(tmp_path):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    return path


def engine_flags(model) -> list[str]:
    return ["--model", str(model), "--num-kv-blocks", "512", "--block-size", "8"]


def test_caption_writes_one_validated_object_per_image(byte_ov, schema_file, tmp_path,
                                                       random_image):  # fmt: skip
    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(5):
        random_image(i, 40 + 8 * i, 36).save(folder / f"{i}.png")
    out = tmp_path / "captions.jsonl"
    args = ["caption", str(folder), "-o", str(out), "--json-schema", str(schema_file),
            "--temperature", "1", "--seed", "3", "--max-tokens", "200", "--no-progress",
            *engine_flags(byte_ov)]  # fmt: skip
    assert main([*args, "--limit", "3"]) == 0
    assert main(args) == 0  # resumes: the other two
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len({r["id"] for r in records}) == 5
    for record in records:
        assert record["error"] is None and record["finish_reason"] == "stop"
        jsonschema.validate(record["caption"], SCHEMA)  # an object, not a string
    assert main(args) == 0 and len(out.read_text().splitlines()) == 5  # nothing redone


def test_caption_cut_by_max_tokens_is_an_error_line(byte_ov, schema_file, tmp_path, random_image):
    folder = tmp_path / "one"
    folder.mkdir()
    random_image(0, 40, 36).save(folder / "a.png")
    out = tmp_path / "cut.jsonl"
    args = ["caption", str(folder), "-o", str(out), "--json-schema", str(schema_file),
            "--max-tokens", "3", "--no-progress", *engine_flags(byte_ov)]  # fmt: skip
    assert main(args) == 0
    [record] = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["caption"] is None and record["error_type"] == "InvalidJSON"
    assert "max-tokens" in record["error"] and record["text"].startswith("{")


def test_generate_prints_json_following_the_schema(byte_ov, schema_file, capsys):
    args = ["generate", "--prompt", "describe", "--json-schema", str(schema_file),
            "--max-tokens", "200", *engine_flags(byte_ov)]  # fmt: skip
    assert main(args) == 0
    jsonschema.validate(json.loads(capsys.readouterr().out), SCHEMA)


def test_a_bad_schema_file_is_refused_naming_it(byte_ov, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": 3}')
    args = ["generate", "--prompt", "x", "--json-schema", str(bad), *engine_flags(byte_ov)]
    assert main(args) == 2
    assert "bad.json" in capsys.readouterr().err


def test_grammar_flags_reach_the_engine_config():
    import argparse

    from vlmserve.cli.engine_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(
        parser.parse_args(["--grammar-compile-timeout", "2.5", "--grammar-any-whitespace"])
    )
    assert config.structured.compile_timeout_s == 2.5 and config.structured.any_whitespace
    with pytest.raises(ValueError, match="--grammar-compile-timeout"):
        engine_config_from_args(parser.parse_args(["--grammar-compile-timeout", "0"]))
