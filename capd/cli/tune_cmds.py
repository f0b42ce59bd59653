"""``capd tune``: fine-tune the model on the taps' own examples now (capd/tuning.py)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from capd.cli.common import EXIT_ERROR, Failed, build_settings, emit_json, settings_options

if TYPE_CHECKING:
    from capd.settings import Settings


@click.command()
@settings_options
@click.option("--list", "listing", is_flag=True,
              help="List the tuned models in the data directory instead (the taps' own is marked *).")
@click.option("--remove", "remove", multiple=True, metavar="KEY",
              help="Remove this tuned model (a key from --list, or its unique start), or a leftover "
              "of an interrupted tuning run named as --list shows it, instead; repeatable.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def tune(config: Path | None, taps: tuple[Path, ...], data_dir: Path | None, model: str | None,
         backend: str | None, listing: bool, remove: tuple[str, ...], as_json: bool) -> None:
    """Tune a copy of the model on the taps' examples and cache it in the data directory.

    Routing uses it when `tune = true` (config) or CAPD_TUNE=true. The daemon tunes by itself
    in the background when a tap changes; this command does it now, in the foreground (seconds
    for a few capabilities, a few minutes for a hundred). Nothing in the taps is modified.

    With --list nothing is tuned: each tuned model in the data directory with its last use, size,
    whether a running capd routes with it, and training summary; then what tuning runs left
    behind (.KEY.PID.tmp). capd keeps the 3 most recently used, and never removes one in use.
    --remove KEY removes one now (with its ONNX export), or a leftover named as listed; a model
    in use, or a leftover whose run is still going, is refused.

    Example: capd tune --tap taps/core
    """
    from capd.service import Service

    if listing and remove:
        raise click.UsageError("--list and --remove go separately")
    settings = dataclasses.replace(build_settings(config, taps=taps, data_dir=data_dir, model=model,
                                                  backend=backend), tune=True)
    if listing:
        _list(settings, as_json)
        return
    if remove:
        _remove(settings.data_dir, remove, as_json)
        return
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


def _list(settings: Settings, as_json: bool) -> None:
    from capd.models import HASH_MODEL
    from capd.taps import load_catalog
    from capd.tuned_models import leftovers, listing
    from capd.tuner import TOO_FEW, target_for

    wanted, too_few = None, False  # the hash model is never tuned: no tuned model is the taps' own
    if settings.taps and settings.model != HASH_MODEL:
        # a listing creates nothing: with no data directory there is no check to record, nor a tuned model
        target = target_for(settings, load_catalog(settings.taps), stamp=settings.data_dir.is_dir())
        too_few = len(target.groups) < 2  # `capd tune` would refuse: never advise it
        wanted = None if too_few else target.key
    rows = [{**row, "current": row["key"] == wanted} for row in listing(settings.data_dir)]
    scratch = leftovers(settings.data_dir)
    if as_json:
        emit_json({"data_dir": str(settings.data_dir), "wanted": wanted, "tuned": rows, "leftovers": scratch})
        return
    for row in rows:
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(row["last_used"]))
        counts = (row["capabilities"], row["examples"], row["steps"])
        trained = ("{} capabilities, {} examples, {} steps".format(*counts) if None not in counts else
                   "no training summary in its marker")  # an older or hand-edited marker
        click.echo(f"{'*' if row['current'] else ' '} {row['key']}  {'in use' if row['in_use'] else 'used  '} {used}  "
                   f"{row['bytes'] / 1e6:6.1f} MB  {trained}  {row['path']}")
    for left in scratch:
        what = (f"a tuning run in progress (pid {left['pid']})" if left["running"] else
                f"left by an interrupted tuning run (pid {left['pid']}, gone): capd tune --remove {left['name']}")
        click.echo(f"  {left['name']}  {left['bytes'] / 1e6:6.1f} MB  {what}")
    if too_few:
        click.echo(f"no tuned model for these taps: {TOO_FEW}")
    elif not any(row["current"] for row in rows):
        click.echo(f"no tuned model for these taps yet ({wanted}): capd tune" if wanted else
                   f"{len(rows)} tuned model{'s' if len(rows) != 1 else ''}")


def _remove(data_dir: Path, names: tuple[str, ...], as_json: bool) -> None:
    from capd.errors import CapdError
    from capd.tuned_models import remove

    removed, errors = [], []
    for name in names:
        try:
            removed.append(str(remove(data_dir, name)))
        except CapdError as exc:
            errors.append(str(exc))
    if as_json:
        emit_json({"data_dir": str(data_dir), "removed": removed, "errors": errors})
    else:
        for path in removed:
            click.echo(f"removed {path}")
    if errors:
        raise Failed("; ".join(errors), EXIT_ERROR)
