"""The README stays short and true: every example in it runs.

The Python examples run as written against the embedded default model (the chat one
against a real server on a free port); every `vlmserve ...` line parses with the real
parser and its subcommand's `--help` runs; the estimator's formula commands run for real.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from vlmserve.cli.main import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
MAX_LINES = 150
CHAT_URL = "http://localhost:8000/v1"  # where the README's client looks for `vlmserve serve`


def code_blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README, re.DOTALL | re.MULTILINE)


def cli_lines() -> list[str]:
    """Every `vlmserve ...` command in a bash block or an inline code span."""
    lines = [line for block in code_blocks("bash") for line in block.splitlines()]
    lines += re.findall(r"`((?:\.venv/bin/)?vlmserve [^`]+)`", README)
    out = []
    for line in lines:
        words = shlex.split(line, comments=True)
        if words and words[0].removeprefix(".venv/bin/") == "vlmserve":
            out.append(" ".join(words[1:]))
    return out


def python_example(marker: str) -> str:
    [block] = [b for b in code_blocks("python") if marker in b]
    return block


def test_the_readme_is_short():
    assert len(README.splitlines()) <= MAX_LINES


def test_every_relative_link_in_the_readme_exists():
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README)
    assert links
    for link in links:
        assert (ROOT / link).exists(), link


def test_the_two_setup_commands_are_the_dev_scripts():
    setup = code_blocks("bash")[0].splitlines()
    assert [line.split("#")[0].strip() for line in setup] == ["./dev demo", "./dev test"]
    dev = (ROOT / "dev").read_text()
    assert "\n    demo)\n" in dev and "\n    test)\n" in dev


def test_every_python_block_is_one_that_runs_here():
    blocks = code_blocks("python")
    assert len(blocks) == 2, "a new README Python example needs a test in this file"
    assert python_example("OpenAI(") != python_example("Engine(")


def test_the_readme_has_an_example_for_each_door():
    commands = {line.split()[0] for line in cli_lines()}
    assert {"serve", "caption", "estimate"} <= commands


def _subcommand(argv: list[str]) -> list[str]:
    """The leading words of `argv` that name (nested) subcommands."""
    parser, path = build_parser(), []
    for word in argv:
        sub = next((a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"),
                   None)  # fmt: skip
        if sub is None or word not in sub.choices:
            break
        parser = sub.choices[word]
        path.append(word)
    return path


@pytest.mark.parametrize("line", cli_lines())
def test_each_cli_line_parses_and_its_help_runs(line, capsys):
    argv = shlex.split(line)
    try:
        build_parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"`vlmserve {line}` does not parse: {capsys.readouterr().err} ({e})")
    command = _subcommand(argv)
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([*command, "--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: vlmserve {' '.join(command)}")


FORMULA_LABS = ("estimate image", "estimate kv", "estimate plan", "estimate batching")


@pytest.mark.parametrize("line", [x for x in cli_lines() if x.startswith(FORMULA_LABS)])
def test_the_estimator_lines_run(line, capsys):
    if "--help" in line:
        pytest.skip("a --help line")
    assert main(shlex.split(line)) == 0
    assert capsys.readouterr().out.strip()


@pytest.fixture
def scene_png(tmp_path, monkeypatch) -> Path:
    """`scene.png` in the working directory, as the examples read it: a held-out scene."""
    from vlmserve.embedded.scenes import HELDOUT_SEED_BASE, generate_scene, render_scene

    scene = generate_scene(HELDOUT_SEED_BASE + 7, width=48, height=48)
    render_scene(scene).save(tmp_path / "scene.png")
    monkeypatch.chdir(tmp_path)
    return tmp_path / "scene.png"


def _run(code: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {"__name__": "readme_example"})
    return out.getvalue()


@pytest.mark.slow
def test_the_offline_python_example_runs(scene_png):
    printed = _run(python_example("Engine("))
    assert printed.strip(), "the example printed no answer"


@pytest.mark.slow
def test_the_chat_example_runs_against_vlmserve_serve(scene_png):
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from benchmarks.reliability.server import in_process_server
    from encoders.config import EncoderConfig
    from vlmserve.config import EngineConfig, ModelConfig
    from vlmserve.embedded import DEFAULT_MODEL_DIR
    from vlmserve.engine.core import Engine
    from vlmserve.server.app import ServerConfig, create_app

    code = python_example("OpenAI(")
    assert CHAT_URL in code
    # `vlmserve serve`'s model name for the default model: its folder's name.
    config = ServerConfig(model_name=Path(DEFAULT_MODEL_DIR).resolve().name)
    engine = EngineConfig(ModelConfig(str(DEFAULT_MODEL_DIR)), encoder=EncoderConfig(num_workers=0))
    app = create_app(lambda: Engine(engine), config)
    with in_process_server(app) as url:
        printed = _run(code.replace(CHAT_URL, url + "/v1"))
    assert printed.strip(), "the example printed no answer"
