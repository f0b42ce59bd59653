"""What every CLI command shares: settings options, output, and the exit-code policy.

Exit codes (decided here only): 0 ok, 1 error or below a floor, 2 usage,
3 daemon unreachable or failed to start; 141 (as a command killed by SIGPIPE) when whoever
reads the output stops reading (``capd list | head -1``); 130 (as one killed by SIGINT) for a
command stopped by Ctrl-C.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import click

from capd.client import check_host
from capd.errors import CapdError, DaemonUnreachable
from capd.setting_values import check_setting
from capd.settings import Settings, load_settings
from capd.text import finite, surrogate_at

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_BROKEN_PIPE = 128 + 13  # what a shell reports for a command killed by SIGPIPE
EXIT_INTERRUPTED = 128 + 2  # stopped by Ctrl-C: what a shell reports for a command killed by SIGINT

F = TypeVar("F", bound=Callable[..., Any])


class Failed(Exception):
    """A failure the CLI reports on stderr (``capd: …``) before exiting with ``code``."""

    def __init__(self, message: str, code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.code = code


class CapdGroup(click.Group):
    """Turns capd's typed errors into messages on stderr and documented exit codes."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except Failed as exc:
            click.echo(f"capd: {exc}", err=True)
            ctx.exit(exc.code)
        except DaemonUnreachable as exc:
            click.echo(f"capd: {exc}", err=True)
            ctx.exit(EXIT_UNREACHABLE)
        except CapdError as exc:
            click.echo(f"capd: {exc}", err=True)
            ctx.exit(EXIT_ERROR)
        except KeyboardInterrupt:
            # Ctrl-C (for `capd serve`, after uvicorn's graceful stop, which raises SIGINT again): click
            # would print "Aborted!" and exit 1, an error; a stop asked for is not one.
            ctx.exit(EXIT_INTERRUPTED)
        except BrokenPipeError:
            # The reader went away (``capd list | head -1``): nothing more to say. Output still
            # buffered would fail again when Python flushes stdout at exit, so it goes to devnull.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            ctx.exit(EXIT_BROKEN_PIPE)


class PathParam(click.Path):
    """``click.Path`` giving a :class:`Path`, refusing an empty value: ``Path("")`` is the working
    directory, so ``--data-dir ""`` (an unset shell variable) would write capd's files there."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(path_type=Path, **kwargs)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and not value.strip():
            self.fail("empty; give a path", param, ctx)
        return super().convert(value, param, ctx)


# one wording per flag, for `capd serve` as for the other commands
HELP_CONFIG = "Config file (default: $CAPD_CONFIG, else ~/.config/capd/config.toml)."
HELP_TAPS = "Tap directory; repeat for several (order is precedence). Env: CAPD_TAPS."
HELP_DATA_DIR = "Where the vector cache, session state and ONNX export live. Env: CAPD_DATA_DIR."
HELP_MODEL = "Model manifest name (see `capd models`) or directory. Env: CAPD_MODEL."
HELP_BACKEND = "Encoder backend (default auto = the faster one measured here)."


def store_options(func: F) -> F:
    """--config, --tap, --data-dir: where capd's files are."""
    options = [
        click.option("--config", "config", type=PathParam(), default=None, help=HELP_CONFIG),
        click.option("--tap", "taps", multiple=True, type=PathParam(), help=HELP_TAPS),
        click.option("--data-dir", type=PathParam(), default=None, help=HELP_DATA_DIR),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def settings_options(func: F) -> F:
    """:func:`store_options` and --model, --backend: the settings most commands need."""
    func = click.option("--backend", type=click.Choice(["auto", "onnx", "torch"]), default=None,
                        help=HELP_BACKEND)(func)
    func = click.option("--model", default=None, callback=setting_rule("model"), help=HELP_MODEL)(func)
    return store_options(func)


def connection_options(func: F) -> F:
    """--host, --port, --uds: where the running daemon listens."""
    options = [
        click.option("--host", default=None, callback=setting_rule("host", check_host),
                     help="Daemon host (default 127.0.0.1). Env: CAPD_HOST."),
        click.option("--port", type=int, default=None, callback=setting_rule("port"),
                     help="Daemon port (default 7171). Env: CAPD_PORT."),
        click.option("--uds", type=PathParam(), default=None, help="Unix socket path. Env: CAPD_UDS."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


class _Text(click.ParamType[str]):
    """A message, intent, session id or capability name. A byte that the locale's encoding cannot
    decode reaches Python as a lone surrogate (PEP 383), which neither the model nor JSON accepts."""

    name = "text"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        text = str(value)
        if (at := surrogate_at(text)) is not None:
            self.fail(f"not text in the terminal's encoding (an undecodable byte at character {at})", param, ctx)
        return text


TEXT = _Text()


def share(ctx: click.Context, param: click.Parameter, value: float) -> float:
    """A click callback for a rate limit (``--max-null-fpr``): between 0 and 1 (NaN is not)."""
    if not 0.0 <= value <= 1.0:
        raise click.BadParameter(f"must be between 0 and 1 (got {value})", ctx, param)
    return value


def setting_rule(key: str, then: Callable[[Any], Any] | None = None,
                 ) -> Callable[[click.Context, click.Parameter, Any], Any]:
    """A click callback that checks a flag overriding setting ``key`` by that setting's rule (and
    ``then``, which raises ValueError too)."""

    def check(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if value is None:
            return None
        try:
            value = check_setting(key, value)
            return value if then is None else then(value)
        except ValueError as exc:
            raise click.BadParameter(str(exc), ctx, param) from None

    return check


def _given(flags: dict[str, Any]) -> list[str]:
    return [f"--{k.replace('_', '-')}" for k, v in flags.items() if v is not None and v != () and v is not False]


def _refuse(flags: dict[str, Any], where: str, hint: str = "") -> None:
    """Flags given in the mode they do not apply to: a usage error, not silently ignored."""
    names = _given(flags)
    if names:
        one = len(names) == 1
        raise Failed(f"{', '.join(names)} appl{'ies' if one else 'y'} {where}"
                     + hint.format(it="it" if one else "them"), EXIT_USAGE)


def tap_only(**flags: Any) -> None:
    """Flags of the in-process mode, given without --tap."""
    _refuse(flags, "with --tap; a running daemon uses its own", " (set {it} when starting `capd serve`)")


def daemon_only(**flags: Any) -> None:
    """Flags that talk to the running daemon, given with --tap."""
    _refuse(flags, "to a running daemon, not with --tap (which runs in-process)")


def write_file(path: Path, text: str) -> None:
    """Write a report the user asked for; a path that cannot be written is an error, not a traceback."""
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise Failed(f"cannot write {path}: {exc.strerror or exc}") from None


def build_settings(config: Path | None = None, **flags: Any) -> Settings:
    """Flags that were given override environment, config file and defaults.

    The daemon's address is one setting made of two kinds: a socket (``uds``) or TCP (``host``,
    ``port``). A ``--host`` or ``--port`` flag therefore beats a ``uds`` from the environment or a
    config file, as any flag beats them; ``--uds`` with ``--host``/``--port`` names two addresses
    and is a usage error."""
    given = {k: v for k, v in flags.items() if v is not None and v != ()}
    tcp = [f"--{key}" for key in ("host", "port") if key in given]
    if tcp and "uds" in given:
        raise Failed(f"--uds and {' '.join(tcp)} name two addresses (a Unix socket and TCP); give one",
                     EXIT_USAGE)
    settings = load_settings(flags=given, config=config)
    if tcp and settings.uds is not None:
        settings = dataclasses.replace(settings, uds=None)
    return settings


def named_by(rule_from: str) -> str:
    """`` (named by <capd.toml>)`` for a rule a tap asked for; nothing for a setting or the default."""
    return "" if rule_from in ("settings", "default") else f" (named by {rule_from})"


def emit_json(value: Any) -> None:
    """Print ``value`` as JSON; a float that is NaN or inf (a damaged model) prints as null, never
    as the ``NaN`` that JSON parsers reject."""
    click.echo(json.dumps(finite(value), indent=2, ensure_ascii=False, allow_nan=False, default=str))



def check_taps(taps: Iterable[Path]) -> None:
    """A one-shot command's taps must be taps: a daemon keeps waiting for a missing one, but a
    command would list, route or score against nothing and look like an empty tap or an abstain."""
    for tap in taps:
        if not (Path(tap) / "capabilities").is_dir():
            what = "no such directory" if not Path(tap).exists() else "no capabilities/ folder in it"
            raise Failed(f"{tap}: not a tap ({what})")


def tuning_not_done(reason: str) -> Failed:
    """A one-shot command asked to tune (``tune = true``) whose tuning did not happen: it fails
    rather than route, score or calibrate with the untuned model."""
    return Failed(f"tuning was asked for (tune = true / CAPD_TUNE) and did not happen: {reason}")


def fail(message: str, code: int = EXIT_ERROR) -> Failed:
    return Failed(message, code)


def stderr(message: str) -> None:
    click.echo(message, err=True)


def plan_lines(plan: dict[str, Any]) -> list[str]:
    """A session plan as ``capd enable`` / ``disable`` / ``route --session`` print it: the servers
    to start (with the tools to expose), to kill or to strip tools from, and what is active then."""
    lines = [f"start {i['server']['name']} for {i['capability']} ({', '.join(i['tools'])})" for i in plan["start"]]
    lines += [f"{'kill' if i['kill'] else 'strip'} {i['server']} for {i['capability']}" for i in plan["teardown"]]
    lines.append(f"active: {', '.join(plan['active']) or '-'}")
    return lines
