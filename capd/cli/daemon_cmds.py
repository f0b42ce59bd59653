"""Commands that run or talk to the daemon: serve, status, list, enable, disable.

``route``, ``discover`` and ``list`` run in-process instead when given ``--tap``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from capd.catalog import RULES
from capd.cli.common import (
    EXIT_UNREACHABLE,
    HELP_BACKEND,
    HELP_CONFIG,
    HELP_DATA_DIR,
    HELP_MODEL,
    HELP_TAPS,
    TEXT,
    Failed,
    PathParam,
    build_settings,
    check_taps,
    connection_options,
    daemon_only,
    emit_json,
    named_by,
    plan_lines,
    setting_rule,
    stderr,
)
from capd.client import CapdClient, base_url, check_host
from capd.setting_values import WATCH_MODES
from capd.settings import Settings


def client_for(settings: Settings) -> CapdClient:
    if settings.uds is None:
        try:  # a flag is checked as it is parsed; this is CAPD_HOST or a config file's host
            check_host(settings.host)
        except ValueError as exc:
            raise Failed(f"host (CAPD_HOST or the config file): {exc}") from None
    return CapdClient(base_url(settings.host, settings.port), token=settings.token,
                      uds=str(settings.uds) if settings.uds else None)


def daemon_options(func: Any) -> Any:
    """--config, then where the daemon listens (--host, --port, --uds)."""
    func = connection_options(func)
    return click.option("--config", "config", type=PathParam(), default=None, help=HELP_CONFIG)(func)


@click.command()
@click.option("--tap", "taps", multiple=True, type=PathParam(), help=HELP_TAPS)
@daemon_options
@click.option("--data-dir", type=PathParam(), default=None, help=HELP_DATA_DIR)
@click.option("--model", default=None, callback=setting_rule("model"), help=HELP_MODEL)
@click.option("--backend", type=click.Choice(["auto", "onnx", "torch"]), default=None, help=HELP_BACKEND)
@click.option("--rule", type=click.Choice(RULES), default=None,
              help="Routing rule (default: CAPD_RULE, the config file, else the first tap naming one in its "
                   "capd.toml, else capd).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default=None,
              help="How much the daemon logs (default info; `log_level` in the config file).")
@click.option("--watch", type=click.Choice(WATCH_MODES), default=None,
              help="Live reload: auto (notifications), poll (scan: taps on network file systems) or off. "
                   "Env: CAPD_WATCH.")
def serve(taps: tuple[Path, ...], config: Path | None, host: str | None, port: int | None, uds: Path | None,
          data_dir: Path | None, model: str | None, backend: str | None, rule: str | None,
          log_level: str | None, watch: str | None) -> None:
    """Run the daemon (HTTP on 127.0.0.1:7171 by default; token from CAPD_TOKEN).

    Example: capd serve --tap taps/core
    """
    from capd.daemon import StartError
    from capd.daemon import serve as run

    settings = build_settings(config, taps=taps, host=host, port=port, uds=uds, data_dir=data_dir, model=model,
                              backend=backend, rule=rule, log_level=log_level, watch=watch)
    try:
        run(settings)
    except StartError as exc:  # cannot listen, or a data directory it must not use
        raise Failed(str(exc), EXIT_UNREACHABLE) from None


@click.command()
@daemon_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def status(config: Path | None, host: str | None, port: int | None, uds: Path | None, as_json: bool) -> None:
    """Is the daemon up and ready? Exit 3 if it failed to start or does not answer.

    Example: capd status --json
    """
    settings = build_settings(config, host=host, port=port, uds=uds)
    with client_for(settings) as client:
        health = client.health()
    if as_json:
        emit_json(health)
    else:
        click.echo(f"{health['status']}  ready={health['ready']}  model={health['model']}  "
                   # .get: a daemon older than this client says no rule
                   f"rule={health.get('rule', '?')}{named_by(health.get('rule_from', 'default'))}  "
                   f"capabilities={health['capabilities']}  triggers={health['triggers']}  "
                   f"embedded={health['embedded']}  cached={health['cached']}")
        tuning = health.get("tuning") or {}
        if tuning.get("enabled"):
            click.echo(f"  tuning: {tuning['status']}" + (f" ({tuning['error']})" if tuning.get("error") else ""))
        for error in health["errors"]:
            line = f": line {error['line']}" if error["line"] is not None else ""
            stderr(f"  {error['file']}{line}: {error['reason']}")
    # "starting" (still loading) is not a failure; "error" is a daemon that answers but will never route.
    if health["status"] == "error":  # DESIGN: exit 3 for a daemon unreachable or failed to start
        raise Failed(f"the daemon failed to start: {health.get('startup_error') or 'see its log'}", EXIT_UNREACHABLE)


@click.command("list")
@click.option("--tap", "taps", multiple=True, type=PathParam(),
              help="List these taps in-process instead of asking the daemon.")
@daemon_options
@click.option("--session", type=TEXT, default=None, help="Mark this session's active capabilities (daemon only).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def list_(taps: tuple[Path, ...], config: Path | None, host: str | None, port: int | None, uds: Path | None,
          session: str | None, as_json: bool) -> None:
    """List capabilities (active ones marked with *).

    Example: capd list --session my-agent
    """
    if taps:
        from capd.taps import load_catalog

        daemon_only(session=session, host=host, port=port, uds=uds)
        check_taps(taps)
        catalog = load_catalog(taps)
        for problem in catalog.errors:
            stderr(str(problem))
        rows = [{**c.summary(), "active": False} for c in catalog]
    else:
        with client_for(build_settings(config, host=host, port=port, uds=uds)) as client:
            rows = client.capabilities(session)
    if as_json:
        emit_json({"capabilities": rows})
        return
    for row in rows:
        mark = "*" if row["active"] else " "
        click.echo(f"{mark} {row['name']:<28} {row['kind']:<12} {row['description'] or ''}")


def _plan_command(name: str, summary: str, call: Callable[[CapdClient, str, str], dict[str, Any]]) -> click.Command:
    """``capd enable`` / ``capd disable``: one session change through the daemon, printing the plan."""

    @click.command(name, help=f"{summary}; prints the plan.\n\nExample: capd {name} my-agent postgres")
    @click.argument("session", type=TEXT)
    @click.argument("name", type=TEXT)
    @daemon_options
    @click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
    def command(session: str, name: str, config: Path | None, host: str | None, port: int | None,
                uds: Path | None, as_json: bool) -> None:
        with client_for(build_settings(config, host=host, port=port, uds=uds)) as client:
            plan = call(client, session, name)
        if as_json:
            emit_json(plan)
        else:
            click.echo("\n".join(plan_lines(plan)))

    return command


enable = _plan_command("enable", "Activate a capability in a session by name", CapdClient.enable)
disable = _plan_command("disable", "Deactivate a capability in a session", CapdClient.disable)
