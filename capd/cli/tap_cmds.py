"""Commands that read taps without a model: ``capd lint``."""

from __future__ import annotations

from pathlib import Path

import click

from capd.cli.common import EXIT_ERROR, PathParam, build_settings, emit_json, settings_options
from capd.lint import lint_catalog, lint_fixtures, ordered, summarise
from capd.taps import load_catalog


@click.command()
@click.argument("tap_args", metavar="[TAP]...", nargs=-1, type=PathParam())
@settings_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--embeddings/--no-embeddings", default=False,
              help="Also check near-duplicate triggers across capabilities with the model.")
def lint(tap_args: tuple[Path, ...], config: Path | None, taps: tuple[Path, ...], data_dir: Path | None,
         model: str | None, backend: str | None, as_json: bool, embeddings: bool) -> None:
    """Check taps and their fixtures for errors and doubtful triggers; exit 1 on errors.

    Example: capd lint taps/core
    """
    settings = build_settings(config, taps=(*tap_args, *taps), data_dir=data_dir, model=model, backend=backend)
    catalog = load_catalog(settings.taps)
    problems = lint_catalog(catalog)
    problems.extend(lint_fixtures(catalog, settings.min_chars))
    if embeddings:
        from capd.lint_embed import near_duplicates

        problems.extend(near_duplicates(catalog, settings))
    problems = ordered(problems)
    report = summarise(problems, catalog.taps)
    examples = sum(len(catalog.examples_of(capability)) for capability in catalog)  # examples.jsonl lines in use
    if as_json:
        emit_json({**report, "capabilities": len(catalog), "triggers": catalog.trigger_count, "examples": examples})
    else:
        for problem in problems:
            click.echo(str(problem), err=problem.severity == "error")
        counts = report["counts"]
        assert isinstance(counts, dict)
        click.echo(f"{len(catalog)} capabilities, {catalog.trigger_count} triggers"
                   + (f" (and {examples} examples)" if examples else "") + ": "
                   f"{counts['error']} errors, {counts['warning']} warnings, {counts['info']} notes")
    if any(p.severity == "error" for p in problems):
        raise SystemExit(EXIT_ERROR)
