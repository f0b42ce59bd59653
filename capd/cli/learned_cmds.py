"""``capd learned list | forget | export``: the corrections the daemon learned (capd/learned.py)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from capd.cli.common import EXIT_USAGE, Failed, build_settings, emit_json, settings_options
from capd.cli.daemon_cmds import client_for
from capd.errors import ClientError
from capd.learned import Learned, LearnedStore
from capd.settings import Settings


def _store(settings: Settings) -> LearnedStore:
    return LearnedStore.open(settings.data_dir)


def _tap(tap: Path | None) -> str | None:
    return str(tap.expanduser().absolute()) if tap is not None else None


@click.group()
def learned() -> None:
    """Corrections capd learned: list them, forget them, export them as suggested triggers.

    A manual enable within 3 routed turns after a miss is recorded as (message -> capability)
    in the data directory; the tap itself is never modified.
    """


@learned.command("list")
@settings_options
@click.option("--capability", default=None, help="Only this capability.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def list_learned(config: Path | None, taps: tuple[Path, ...], data_dir: Path | None, model: str | None,
                 backend: str | None, capability: str | None, as_json: bool) -> None:
    """Learned examples, by tap and capability (only those of --tap when given).

    Example: capd learned list --json
    """
    settings = build_settings(config, data_dir=data_dir)
    store = _store(settings)
    entries: list[Learned] = []
    for tap in taps or (None,):
        entries += store.entries(tap=_tap(tap), capability=capability)
    if as_json:
        emit_json({"learned": [e.as_dict() for e in entries], "count": len(entries)})
        return
    for entry in entries:
        click.echo(f"{entry.capability:<24} {entry.message!r}  (routing said {entry.previous or '-'}; "
                   f"tap {entry.tap})")
    click.echo(f"{len(entries)} learned example{'s' if len(entries) != 1 else ''}")


@learned.command()
@click.argument("capability", required=False)
@settings_options
@click.option("--message", default=None, help="Only this exact message.")
@click.option("--all", "everything", is_flag=True, help="Forget every learned example (of --tap when given).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def forget(capability: str | None, config: Path | None, taps: tuple[Path, ...], data_dir: Path | None,
           model: str | None, backend: str | None, message: str | None, everything: bool, as_json: bool) -> None:
    """Forget learned examples of CAPABILITY (or --all), then ask a running daemon to reload.

    Example: capd learned forget docker --message "the thing with the boxes is slow"
    """
    if capability is None and not everything:
        raise Failed("name a capability, or pass --all to forget every learned example", EXIT_USAGE)
    settings = build_settings(config, data_dir=data_dir)
    store = _store(settings)
    removed = sum(store.forget(tap=_tap(tap), capability=capability, message=message) for tap in taps or (None,))
    store.close()
    reloaded = False
    if removed:
        try:
            with client_for(settings) as client:
                client.reload()
            reloaded = True
        except ClientError:
            pass  # no daemon running: it reads the learned examples when it starts
    if as_json:
        emit_json({"forgotten": removed, "daemon_reloaded": reloaded})
    else:
        note = "; the running daemon reloaded" if reloaded else ""
        click.echo(f"forgot {removed} learned example{'s' if removed != 1 else ''}{note}")


@learned.command()
@settings_options
@click.option("--format", "fmt", type=click.Choice(["toml", "json"]), default="toml", show_default=True)
def export(config: Path | None, taps: tuple[Path, ...], data_dir: Path | None, model: str | None,
           backend: str | None, fmt: str) -> None:
    """Learned examples as suggested triggers for tap authors (stdout; nothing is written).

    Example: capd learned export --tap taps/core > suggestions.toml
    """
    settings = build_settings(config, data_dir=data_dir)
    store = _store(settings)
    grouped: dict[tuple[str, str], list[str]] = {}
    for tap in taps or (None,):
        for entry in store.entries(tap=_tap(tap)):
            grouped.setdefault((entry.tap, entry.capability), []).append(entry.message)
    suggestions = [{"tap": tap, "capability": name, "file": str(Path(tap) / "capabilities" / name),
                    "add_triggers": messages} for (tap, name), messages in sorted(grouped.items())]
    if fmt == "json":
        emit_json({"suggestions": suggestions})
        return
    click.echo("# Suggested triggers learned from corrections (capd learned export).\n"
               "# Review each one; add the good ones to the capability's `triggers`.")
    for item in suggestions:
        click.echo(f"\n[{json.dumps(str(item['capability']))}]\nfile = {json.dumps(item['file'])}\n"
                   f"add_triggers = {json.dumps(item['add_triggers'], ensure_ascii=False)}")
