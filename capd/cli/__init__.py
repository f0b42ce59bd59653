"""The ``capd`` command line. Each command family lives in its own module."""

from __future__ import annotations

import click

from capd import __version__
from capd.cli.common import CapdGroup
from capd.cli.daemon_cmds import disable, enable, list_, serve, status
from capd.cli.engine_cmds import index, models
from capd.cli.learned_cmds import learned
from capd.cli.router_cmds import calibrate, discover, eval_, route, test_
from capd.cli.tap_cmds import lint
from capd.cli.tune_cmds import tune


@click.group(cls=CapdGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="capd")
def main() -> None:
    """capd: a local capability router for AI agents.

    Exit codes: 0 ok, 1 error or below a floor, 2 usage, 3 daemon unreachable or failed to start
    (any command that asks it), or `capd serve` could not start (address in use, cannot bind, a data
    directory it must not use).
    """


main.add_command(lint)
for command in (discover, route, eval_, test_, calibrate):
    main.add_command(command)
for command in (serve, status, list_, enable, disable):
    main.add_command(command)
main.add_command(index)
main.add_command(models)
main.add_command(learned)
main.add_command(tune)


def _choices_in_any_case(command: click.Command) -> None:
    """``--log-level DEBUG``, ``--rule FUSED``: a choice flag takes any case, as its ``CAPD_*``
    variable does; click then passes on the canonical (lowercase) choice."""
    for param in command.params:
        if isinstance(param.type, click.Choice):
            param.type.case_sensitive = False
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            _choices_in_any_case(sub)


_choices_in_any_case(main)
