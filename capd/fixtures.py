"""Routing fixtures: one JSON object per line, ``{"message", "expect", "kind"}``.

``expect`` is a capability name, a list of acceptable names, or ``null`` (must abstain).
``kind`` is free text for per-kind breakdowns and floors; it defaults to ``positive`` or
``null`` from ``expect``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from capd.errors import FixtureError


@dataclass(frozen=True)
class Fixture:
    message: str
    expect: tuple[str, ...]  # empty: the router must abstain
    kind: str
    source: str  # "file:line"

    @property
    def positive(self) -> bool:
        return bool(self.expect)


def _parse_line(path: Path, number: int, line: str) -> Fixture:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise FixtureError(path, f"invalid JSON: {exc.msg}", number) from None
    if not isinstance(row, dict):
        raise FixtureError(path, "each line must be a JSON object", number)
    message = row.get("message")
    if not isinstance(message, str):
        raise FixtureError(path, "'message' must be a string", number)
    expect = row.get("expect")
    if expect is None:
        names: tuple[str, ...] = ()
    elif isinstance(expect, str) and expect:
        names = (expect,)
    elif isinstance(expect, list) and expect and all(isinstance(e, str) and e for e in expect):
        names = tuple(expect)
    else:
        raise FixtureError(path, "'expect' must be a capability name, a non-empty list of names, or null", number)
    kind = row.get("kind", "positive" if names else "null")
    if not isinstance(kind, str) or not kind:
        raise FixtureError(path, "'kind' must be a non-empty string", number)
    return Fixture(message=message, expect=names, kind=kind, source=f"{path}:{number}")


def load_fixtures(paths: Iterable[Path]) -> list[Fixture]:
    """Read fixture files; blank lines and lines starting with ``#`` are skipped."""
    rows: list[Fixture] = []
    for path in paths:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise FixtureError(path, f"cannot read: {exc}") from None
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip() and not line.lstrip().startswith("#"):
                rows.append(_parse_line(Path(path), number, line))
    return rows


def check_names(fixtures: Sequence[Fixture], known: Iterable[str]) -> None:
    """Every expected name must exist in the catalog; a typo would silently count as a miss."""
    names = set(known)
    for fixture in fixtures:
        unknown = [e for e in fixture.expect if e not in names]
        if unknown:
            file, _, line = fixture.source.rpartition(":")
            raise FixtureError(file, f"expects unknown capability {', '.join(map(repr, unknown))}", int(line))


def tap_fixture_files(tap: Path) -> list[Path]:
    return sorted((tap / "fixtures").glob("*.jsonl"))
