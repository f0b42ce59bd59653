"""``capd learned list | forget | export``: the corrections the daemon learned (capd/learned.py)."""

from __future__ import annotations

import json
import sqlite3
from collections import Counter
from pathlib import Path
from typing import Any

import click

from capd.cli.common import (
    EXIT_USAGE,
    TEXT,
    Failed,
    build_settings,
    connection_options,
    emit_json,
    store_options,
)
from capd.cli.daemon_cmds import client_for
from capd.errors import ClientError
from capd.learned import FILE_NAME, LearnedStore
from capd.learned_rows import Learned, canonical_tap, skipped_rows
from capd.setting_values import distinct_taps
from capd.settings import Settings


def _store(settings: Settings, write: bool = False) -> LearnedStore:
    """The data directory's store; an empty one in memory when it has none, so that a mistyped
    ``--data-dir`` is said (stderr) and not created with an empty file in it. Unless ``write``
    (``forget``), the file is only read. A file whose contents cannot be read fails the command: an
    empty list would say "nothing learned" (exit 0); rows that are no corrections are skipped, and said."""
    path = settings.data_dir / FILE_NAME
    if not path.exists():
        click.echo(f"capd: no learned corrections in {settings.data_dir} (no {FILE_NAME} there)", err=True)
        return LearnedStore(None)
    if not write:
        try:
            store = LearnedStore.read_only(path)
        except (OSError, sqlite3.Error) as exc:
            raise Failed(f"{path}: what it holds cannot be read ({exc})") from exc
        if store.skipped:
            click.echo(f"capd: {skipped_rows(path, store.skipped)}", err=True)
        return store
    store = LearnedStore(path)
    if store.unreadable:
        store.close()
        raise Failed(f"{path}: what it holds cannot be read (the reason is above)")
    return store


def _tap(tap: Path | None) -> str | None:
    return str(tap.expanduser().absolute()) if tap is not None else None


def _distinct(taps: tuple[Path, ...]) -> list[Path | None]:
    """The taps given, each once (:func:`~capd.setting_values.distinct_taps`); ``[None]`` (every tap) when none is.
    A path that is no tap directory is warned about on stderr, not refused: what was learned for a tap
    that has since moved or gone can still be listed, exported and forgotten under its old path."""
    given = distinct_taps(taps)
    for tap in given:
        if not tap.is_dir():
            click.echo(f"warning: {tap}: no such tap directory; showing what was learned under that path",
                       err=True)
    return [*given] or [None]


@click.group()
def learned() -> None:
    """Corrections capd learned: list them, forget them, export them as suggested triggers.

    A manual enable within 3 routed turns after a miss is recorded as (message -> capability);
    a manual disable right after routing activated a capability, as (message -/-> capability).
    Both live in the data directory; the tap itself is never modified.
    """


@learned.command("list")
@store_options
@click.option("--capability", type=TEXT, default=None, help="Only this capability.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def list_learned(config: Path | None, taps: tuple[Path, ...], data_dir: Path | None, capability: str | None,
                 as_json: bool) -> None:
    """Learned examples, by tap and capability (only those of --tap when given).

    Example: capd learned list --json
    """
    settings = build_settings(config, data_dir=data_dir)
    store = _store(settings)
    entries: list[Learned] = []
    for tap in _distinct(taps):
        entries += store.entries(tap=_tap(tap), capability=capability)
    if as_json:
        emit_json({"learned": [e.as_dict() for e in entries], "count": len(entries)})
        return
    for entry in entries:
        arrow = "->" if entry.kind == "trigger" else "-/->"
        click.echo(f"{arrow:<4} {entry.capability:<24} {entry.message!r}  (routing said {entry.previous or '-'}; "
                   f"tap {entry.tap})")
    refused = sum(e.kind == "abstain" for e in entries)
    click.echo(f"{len(entries) - refused} learned trigger{'s' if len(entries) - refused != 1 else ''}, "
               f"{refused} learned abstain{'s' if refused != 1 else ''} (-/->: not this capability)")


@learned.command()
@click.argument("capability", type=TEXT, required=False)
@store_options
@connection_options
@click.option("--message", type=TEXT, default=None, help="Only this message (case and spacing aside).")
@click.option("--all", "everything", is_flag=True, help="Forget every learned example (of --tap when given).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def forget(capability: str | None, config: Path | None, taps: tuple[Path, ...], data_dir: Path | None,
           host: str | None, port: int | None, uds: Path | None, message: str | None, everything: bool,
           as_json: bool) -> None:
    """Forget learned examples of CAPABILITY (or --all), then ask a running daemon to reload.

    The daemon at the configured address reloads at once; every daemon using this data directory
    (another port or socket too) routes without them within about 2 seconds anyway.

    Example: capd learned forget docker --message "the thing with the boxes is slow"
    """
    if capability is None and not everything:
        raise Failed("name a capability, or pass --all to forget every learned example", EXIT_USAGE)
    if capability is not None and everything:
        raise Failed(f"name a capability or pass --all, not both (--all forgets more than {capability})",
                     EXIT_USAGE)
    settings = build_settings(config, data_dir=data_dir, host=host, port=port, uds=uds)
    store = _store(settings, write=True)
    if store.error is not None:  # forgetting in memory would say "forgot N" and change nothing
        store.close()
        raise Failed(store.error.replace("; keeping them in memory", ""))
    removed = sum(store.forget(tap=_tap(tap), capability=capability, message=message) for tap in _distinct(taps))
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
        if not removed:  # a misspelt name or message matches nothing: say where to look
            click.echo("nothing learned matches; `capd learned list` shows what there is", err=True)


@learned.command()
@store_options
@click.option("--format", "fmt", type=click.Choice(["toml", "json", "examples"]), default="toml", show_default=True,
              help="toml: a commented table per capability to review; json: {suggestions: [...]}; examples: the "
                   "learned triggers of one --tap as examples.jsonl lines, to review and append there.")
def export(config: Path | None, taps: tuple[Path, ...], data_dir: Path | None, fmt: str) -> None:
    """Learned triggers as suggested triggers for tap authors, and learned abstains as messages
    that wrongly activated a capability (stdout; nothing is written).

    Example: capd learned export --tap taps/core > suggestions.toml
    """
    settings = build_settings(config, data_dir=data_dir)
    if fmt == "examples" and len(distinct_taps(taps)) != 1:  # an examples.jsonl holds one tap's capabilities
        raise Failed("--format examples needs exactly one --tap: the tap whose examples.jsonl the lines are for",
                     EXIT_USAGE)
    store = _store(settings)
    grouped: dict[tuple[str, str], dict[str, list[str]]] = {}
    for tap in _distinct(taps):
        for entry in store.entries(tap=_tap(tap)):
            key = "add_triggers" if entry.kind == "trigger" else "refused_messages"
            messages = grouped.setdefault((canonical_tap(entry.tap), entry.capability), {}).setdefault(key, [])
            if entry.message not in messages:  # one tap stored under two spellings by an older capd
                messages.append(entry.message)
    suggestions: list[dict[str, Any]] = [
        {"tap": tap, "capability": name, "file": str(Path(tap) / "capabilities" / name),
         **{key: lists.get(key, []) for key in ("add_triggers", "refused_messages")}}
        for (tap, name), lists in sorted(grouped.items())]
    if fmt == "json":
        emit_json({"suggestions": suggestions})
        return
    if fmt == "examples":  # learned abstains refuse one capability, a tap's vetoes every one: not exported here
        for item in suggestions:
            for message in item["add_triggers"]:
                click.echo(json.dumps({"message": message, "expect": item["capability"], "kind": "learned"},
                                      ensure_ascii=False))
        return
    click.echo("# Suggested triggers learned from corrections (capd learned export).\n"
               "# Review each one; add the good ones to the capability's `triggers`. `refused_messages`\n"
               "# activated the capability and an agent disabled it at once: reword triggers they resemble.")
    names = Counter(item["capability"] for item in suggestions)
    for item in suggestions:
        # a table per capability; a name learned for several taps is qualified by its tap, so no table repeats
        table = item["capability"] if names[item["capability"]] == 1 else f"{item['capability']} @ {item['tap']}"
        lines = [f"\n[{_toml_string(table)}]", f"file = {_toml_string(item['file'])}"]
        lines += [f"{key} = [{', '.join(_toml_string(m) for m in item[key])}]"
                  for key in ("add_triggers", "refused_messages") if item[key]]
        click.echo("\n".join(lines))


def _toml_string(text: str) -> str:
    """A TOML basic string: JSON's escapes (TOML has the same ones) plus DEL, which TOML forbids raw
    and JSON leaves as it is; other characters stay as they are (UTF-8)."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")
