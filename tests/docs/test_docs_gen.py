"""The generated reference pages match the code (`python -m docs.gen` remakes them), and
the generator sees what is added to the code: a flag, a request field, a series."""

from __future__ import annotations

import argparse

import pytest

# The generators read the server's pydantic models and the CLI's parsers: where the
# server's libraries are missing (the GPU machine's environment) there is nothing to check.
pytest.importorskip("pydantic")
pytest.importorskip("fastapi")

from docs.gen import (  # noqa: E402
    REGENERATE,
    api_fields,
    cli_reference,
    metrics_reference,
    models_reference,
    render_all,
    stale_pages,
)


def test_the_generated_pages_are_up_to_date():
    stale = stale_pages()
    assert not stale, (
        f"stale generated docs: {', '.join(p.name for p in stale)}; regenerate them with "
        f"`{REGENERATE}` (from the repository root) and commit the result"
    )


def test_a_new_flag_makes_the_cli_page_stale(monkeypatch):
    real = cli_reference.build_parser

    def with_new_flag() -> argparse.ArgumentParser:
        parser = real()
        for line, sub, _ in cli_reference.commands(parser):
            if line == "vlmserve serve":
                sub.add_argument("--brand-new-flag", type=int, default=7, help="a new knob")
        return parser

    monkeypatch.setattr(cli_reference, "build_parser", with_new_flag)
    page = cli_reference.render()
    assert "| `--brand-new-flag BRAND_NEW_FLAG` | `7` | a new knob |" in page
    pages = render_all()
    assert [p.name for p in stale_pages(pages)] == ["cli.md"]


def test_a_new_engine_flag_is_listed_once_for_every_door(monkeypatch):
    from vlmserve.cli import engine_args

    real = engine_args._add_structured_args

    def plus_one(group) -> None:
        real(group)
        group.add_argument("--brand-new-engine-flag", action="store_true", help="new")

    monkeypatch.setattr(engine_args, "_add_structured_args", plus_one)
    page = cli_reference.render()
    assert page.count("`--brand-new-engine-flag`") == 1
    engine_section = page.split("## Engine flags", 1)[1]
    assert "| `--brand-new-engine-flag` | off | new |" in engine_section


def test_a_new_request_field_needs_a_note(monkeypatch):
    from pydantic import create_model

    from vlmserve.server.protocol import ChatCompletionRequest

    grown = create_model("ChatCompletionRequest", __base__=ChatCompletionRequest,
                         brand_new_field=(int, 3))  # fmt: skip
    models = dict(api_fields._models())
    models["POST /v1/chat/completions"] = grown
    monkeypatch.setattr(api_fields, "_models", lambda: models)
    with pytest.raises(KeyError, match="brand_new_field.*docs/gen/api_notes.py"):
        api_fields.render()
    monkeypatch.setitem(api_fields.api_notes.NOTES, "brand_new_field", "Does new things.")
    assert "| `brand_new_field` | `int` | `3` | supported | Does new things. |" in (
        api_fields.render()
    )


def test_the_refusal_table_is_read_from_the_code(monkeypatch):
    from vlmserve.server import protocol

    monkeypatch.setitem(protocol.UNSUPPORTED_FIELDS, "web_search_options", (None,))
    monkeypatch.setitem(api_fields.api_notes.NOTES, "web_search_options", "No search.")
    page = api_fields.render()
    assert "| `web_search_options` | JSON | none | **refused** (400) unless `null` |" in page


def test_every_metrics_series_is_listed():
    from vlmserve.server.metrics import ENGINE_SERIES, LABELLED_SERIES

    page = metrics_reference.render()
    for series in ENGINE_SERIES.values():
        assert f"| `{series.name}` | {series.kind} |" in page, series.name
    for name, label, _ in LABELLED_SERIES.values():
        assert f"| `{name}` | gauge | `{label}` |" in page
    assert "| `vlmserve_requests_total` | counter | `outcome` |" in page
    assert "| `vlmserve_spec_proposed_total` | counter | none |" in page


def test_a_new_stats_key_is_listed(monkeypatch):
    from vlmserve.engine import stats as engine_stats_module

    real = engine_stats_module.engine_stats
    monkeypatch.setattr(
        engine_stats_module, "engine_stats", lambda *a: real(*a) | {"brand_new_level": 1.0}
    )
    assert "| `vlmserve_brand_new_level` | gauge | none |" in metrics_reference.render()


def test_a_new_model_family_needs_notes(monkeypatch):
    from vlmserve.worker.models import loader

    spec = loader.FamilySpec("llama", ("model.",), ("lm_head.weight",), False)
    monkeypatch.setitem(loader._SPECS, "mistral", spec)
    with pytest.raises(KeyError, match="mistral.*FAMILY_NOTES"):
        models_reference.render()
