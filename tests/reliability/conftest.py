"""The reliability suite (issue 7): load, faults, fuzz and security, against real daemons.

Quick size by default (inside ``make test``); ``CAPD_RELIABILITY=full`` switches every test to
its full size (``make reliability``). Helpers live in :mod:`tests.reliability.harness`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from tests.reliability.harness import Daemon, DaemonFactory, free_port


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[DaemonFactory]:
    """``daemon_factory(taps, data_dir=None, uds=False, args=(), env={}, start=True)``; all stopped at teardown."""
    made: list[Daemon] = []

    def make(taps: Sequence[Path], data_dir: Path | None = None, uds: bool = False, args: Sequence[str] = (),
             env: Mapping[str, str] | None = None, start: bool = True, token: str | None = None) -> Daemon:
        index = len(made)
        data = data_dir or tmp_path / f"data-{index}"
        data.mkdir(parents=True, exist_ok=True)
        daemon = Daemon(tuple(taps), data, tmp_path / f"daemon-{index}.log",
                        port=None if uds else free_port(), uds=tmp_path / f"capd-{index}.sock" if uds else None,
                        args=tuple(args), env=dict(env or {}), token=token)
        if token is not None:
            daemon.env["CAPD_TOKEN"] = token
        made.append(daemon)
        return daemon.start() if start else daemon

    yield make
    for daemon in made:
        daemon.stop()


