"""``capd tune``: fine-tune the model on the taps' own examples now (capd/tuning.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from capd.cli.common import EXIT_ERROR, Failed, build_settings, emit_json, settings_options


@click.command()
@settings_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def tune(config: Path | None, taps: tuple[Path, ...], data_dir: Path | None, model: str | None,
         backend: str | None, as_json: bool) -> None:
    """Tune a copy of the model on the taps' examples and cache it in the data directory.

    Routing uses it when `tune = true` (config) or CAPD_TUNE=true. The daemon tunes by itself
    in the background when a tap changes; this command does it now, in the foreground (seconds
    for a few capabilities, a few minutes for a hundred). Nothing in the taps is modified.

    Example: capd tune --tap taps/core
    """
    from capd.service import Service

    settings = dataclasses.replace(build_settings(config, taps=taps, data_dir=data_dir, model=model,
                                                  backend=backend), tune=True)
    service = Service(settings).start()
    try:
        state = service.tuning.as_dict()
    finally:
        service.close()
    if as_json:
        emit_json(state)
    elif state["status"] == "ready":
        trained = f", trained in {state['seconds']} s" if state["seconds"] is not None else " (cached)"
        click.echo(f"tuned model {state['model']}{trained}")
        click.echo("route with it: set `tune = true` in the config file, or CAPD_TUNE=true")
    if state["status"] != "ready":
        raise Failed(f"tuning did not complete: {state['error'] or state['status']}", EXIT_ERROR)
