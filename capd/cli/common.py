"""What every CLI command shares: settings options, output, and the exit-code policy.

Exit codes (decided here only): 0 ok, 1 error or below a floor, 2 usage,
3 daemon unreachable or failed to start.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from capd.errors import CapdError, DaemonUnreachable
from capd.settings import Settings, load_settings

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3

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


def settings_options(func: F) -> F:
    """--config, --tap, --data-dir, --model, --backend: the settings most commands need."""
    options = [
        click.option("--config", "config", type=click.Path(path_type=Path), default=None,
                     help="Config file (default: $CAPD_CONFIG, else ~/.config/capd/config.toml)."),
        click.option("--tap", "taps", multiple=True, type=click.Path(path_type=Path),
                     help="Tap directory; repeat for several (order is precedence). Env: CAPD_TAPS."),
        click.option("--data-dir", type=click.Path(path_type=Path), default=None,
                     help="Where the vector cache, session state and ONNX export live. Env: CAPD_DATA_DIR."),
        click.option("--model", default=None, help="Model manifest name (see `capd models`). Env: CAPD_MODEL."),
        click.option("--backend", type=click.Choice(["auto", "onnx", "torch"]), default=None,
                     help="Encoder backend (default auto = the faster one measured here)."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def build_settings(config: Path | None = None, **flags: Any) -> Settings:
    """Flags that were given override environment, config file and defaults."""
    return load_settings(flags={k: v for k, v in flags.items() if v is not None and v != ()}, config=config)


def emit_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, ensure_ascii=False, default=str))


def fail(message: str, code: int = EXIT_ERROR) -> Failed:
    return Failed(message, code)


def stderr(message: str) -> None:
    click.echo(message, err=True)


def is_tty() -> bool:
    return sys.stdout.isatty()
