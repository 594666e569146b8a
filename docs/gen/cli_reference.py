"""The command-line reference: every flag of every `vlmserve` subcommand, its default and its
help, read from the argparse parsers (`vlmserve.cli.main.build_parser`).

The engine flags (`add_engine_args`, argument groups titled "engine: ...") are shared by
every door that runs the engine; they are listed once, with a default per door where the
doors differ (`--warmup` is on for `serve` only).
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from docs.gen.markdown import REPO_ROOT, cell, code, header, table

ENGINE_GROUP = "engine: "
PAGE = "reference/cli.md"


@contextmanager
def _clean_environment() -> Iterator[None]:
    """Build the parsers without the VLMSERVE_* variables: a default read from the
    environment (`--api-key`) is this machine's, not the product's (its help says so)."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("VLMSERVE_")}
    try:
        yield
    finally:
        os.environ.update(saved)


def build_parser() -> argparse.ArgumentParser:
    from vlmserve.cli.main import build_parser as vlmserve_parser

    with _clean_environment():
        return vlmserve_parser()


def commands(parser: argparse.ArgumentParser, prefix: str = "vlmserve") -> Iterator[tuple]:
    """(command line, parser, one-line help) for every leaf subcommand, in parser order."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                if any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
                    yield f"{prefix} {name}", sub, helps.get(name)
                    yield from commands(sub, f"{prefix} {name}")
                else:
                    yield f"{prefix} {name}", sub, helps.get(name)


def show_default(action: argparse.Action) -> str:
    """The default as a reader should see it: paths relative to the repository or `~`."""
    if isinstance(action, argparse.BooleanOptionalAction):
        return "on" if action.default else "off"
    if isinstance(action, argparse._StoreTrueAction):
        return "off" if not action.default else "on"
    if isinstance(action, argparse._StoreFalseAction):
        return "on" if action.default else "off"
    default = action.default
    if action.required or default is None or default == argparse.SUPPRESS:
        return "required" if action.required else "none"
    if isinstance(default, (list, tuple)) and not default:
        return "none"
    text, home = str(default), str(Path.home())
    for root in _roots():
        if text.startswith(root + os.sep):
            return code(text[len(root) + 1 :])
    if text.startswith(home + os.sep):
        text = "~" + text[len(home) :]
    return code(text)


def _roots() -> list[str]:
    """Where the project's files are: this checkout, and wherever `vlmserve` was imported
    from (an installed copy), so a default path reads the same from either."""
    import vlmserve

    return [str(REPO_ROOT), str(Path(vlmserve.__file__).resolve().parents[1])]


def _invocation(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """`--flag METAVAR, --alias METAVAR` as argparse up to Python 3.12 writes it (3.13
    changed the format: built here so the page does not depend on the Python version)."""
    if not action.option_strings:
        return code(action.metavar or action.dest)
    if action.nargs == 0:
        return ", ".join(code(s) for s in action.option_strings)
    args = parser._get_formatter()._format_args(action, action.dest.upper())
    return ", ".join(code(f"{s} {args}") for s in action.option_strings)


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.help or action.help == argparse.SUPPRESS:
        return ""
    help_text = parser._get_formatter()._expand_help(action)
    help_text = re.sub(r"\x1b\[[0-9;]*m", "", help_text)  # Python 3.14's colours
    for root in _roots():
        help_text = help_text.replace(root + os.sep, "")
    return help_text.replace(str(Path.home()), "~")


def _rows(parser: argparse.ArgumentParser, actions: list[argparse.Action]) -> list[tuple]:
    return [(_invocation(parser, a), show_default(a), _help(parser, a)) for a in actions]


def _visible(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        a
        for a in parser._actions
        if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
        and a.help != argparse.SUPPRESS
    ]


def _engine_actions(parser: argparse.ArgumentParser) -> dict[str, list[argparse.Action]]:
    """The parser's engine flags by group title ("model", "KV cache and scheduling", ...)."""
    return {
        group.title.removeprefix(ENGINE_GROUP): list(group._group_actions)
        for group in parser._action_groups
        if group.title and group.title.startswith(ENGINE_GROUP)
    }


def _engine_section(doors: dict[str, argparse.ArgumentParser]) -> str:
    """Each engine group once; a default that differs by door shows each door's."""
    first = next(iter(doors.values()))
    out = [
        "## Engine flags\n",
        f"Shared by {', '.join(code(d) for d in doors)} (`--help` on any of them lists "
        "them); the defaults are the config dataclasses' own.\n",
    ]
    per_door = {door: _engine_actions(p) for door, p in doors.items()}
    for title, actions in _engine_actions(first).items():
        rows = []
        for i, action in enumerate(actions):
            defaults: dict[str, list[str]] = {}
            for door, groups in per_door.items():
                assert [a.dest for a in groups[title]] == [a.dest for a in actions], (
                    f"{door}'s engine flags in {title!r} differ from the other doors'"
                )
                defaults.setdefault(show_default(groups[title][i]), []).append(door)
            default = next(iter(defaults))
            if len(defaults) > 1:
                default = "; ".join(f"{d} ({', '.join(ds)})" for d, ds in defaults.items())
            rows.append((_invocation(first, action), default, _help(first, action)))
        out += [f"### {title[0].upper()}{title[1:]}\n", table(("flag", "default", "help"), rows)]
    return "\n".join(out)


def render() -> str:
    parser = build_parser()
    out = [header("Command-line reference", "the argparse parsers in `vlmserve/cli/`")]
    doors: dict[str, argparse.ArgumentParser] = {}
    toc = []
    sections = []
    for line, sub, help_text in commands(parser):
        engine = {a for group in _engine_actions(sub).values() for a in group}
        if engine:
            doors[line.split()[-1]] = sub
        own = [a for a in _visible(sub) if a not in engine]
        anchor = line.replace(" ", "-")
        toc.append(f"- [`{line}`](#{anchor}): {cell(help_text or '')}")
        body = [f"## `{line}`\n"]  # anchor: the slug of its text, as GitHub's
        if help_text:
            body.append(f"{help_text[0].upper()}{help_text[1:]}.\n")
        if own:
            body.append(table(("flag", "default", "help"), _rows(sub, own)))
        if engine:
            body.append("Also every one of the [engine flags](#engine-flags).\n")
        sections.append("\n".join(body))
    out.append("\n".join(toc) + "\n")
    out += sections
    out.append(_engine_section(doors))
    return "\n".join(out)
