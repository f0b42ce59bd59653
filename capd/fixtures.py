"""Routing fixtures: one JSON object per line, ``{"message", "expect", "kind"}``.

``expect`` is a capability name, a list of acceptable names, or ``null`` (must abstain); it
must be there (a row without it, e.g. ``"expects"`` mistyped, would silently count as a null).
``kind`` is free text for per-kind breakdowns and floors; it defaults to ``positive`` or
``null`` from ``expect``. Other keys are refused for the same reason. A file may start with a
UTF-8 byte order mark; lines end in ``\n``, ``\r\n`` or ``\r`` (not at U+2028 / U+2029 / U+0085,
which JSON allows raw inside a string). A message must be Unicode text (no lone surrogate: no
model can embed one).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from capd.errors import FixtureError
from capd.text import DuplicateKey, surrogate_at, unique_keys

KEYS = ("message", "expect", "kind")
_LINE_END = re.compile(r"\r\n|\r|\n")  # str.splitlines would also split at U+2028 inside a JSON string


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
        row = json.loads(line, object_pairs_hook=unique_keys)
    except DuplicateKey as exc:
        raise FixtureError(path, f"key {exc.key!r} given twice", number) from None
    except json.JSONDecodeError as exc:
        raise FixtureError(path, f"invalid JSON: {exc.msg}", number) from None
    except RecursionError:  # json recurses per nested array or object
        raise FixtureError(path, "invalid JSON: arrays or objects nested too deeply to read", number) from None
    if not isinstance(row, dict):
        raise FixtureError(path, "each line must be a JSON object", number)
    unknown = sorted(set(row) - set(KEYS))
    if unknown:
        raise FixtureError(path, f"unknown key {', '.join(map(repr, unknown))} (the keys are {', '.join(KEYS)})",
                           number)
    if "expect" not in row:
        raise FixtureError(path, "missing 'expect': a capability name, a list of names, or null (must abstain)",
                           number)
    message = row.get("message")
    if not isinstance(message, str):
        raise FixtureError(path, "'message' must be a string", number)
    if (at := surrogate_at(message)) is not None:
        raise FixtureError(path, f"'message' has a lone surrogate at character {at} (\\u{ord(message[at]):04x}): "
                                 "not Unicode text", number)
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
    """Read fixture files; blank lines and lines starting with ``#`` are skipped. A file with no
    row is an error, even beside others that have rows: it is a file its author meant to fill,
    and measuring nothing of it would pass any floor. The first error found is raised."""
    rows: list[Fixture] = []
    for path in paths:
        found, errors = read_fixture_file(Path(path))
        if errors:
            raise errors[0]
        rows.extend(found)
    return rows


def read_fixture_file(path: Path, data: bytes | None = None) -> tuple[list[Fixture], list[FixtureError]]:
    """The rows of one fixture file (``data``: its bytes, already read) and every line's error
    (``capd lint`` lists them all)."""
    if data is None:
        try:
            data = path.read_bytes()
        except OSError as exc:
            return [], [FixtureError(path, f"cannot read: {exc.strerror or exc}")]
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        read = data[: exc.start]
        where = read.count(b"\n") + read.count(b"\r") - read.count(b"\r\n") + 1  # \n, \r\n or \r
        return [], [FixtureError(path, f"not UTF-8 text (byte 0x{data[exc.start]:02x})", where)]
    rows: list[Fixture] = []
    errors: list[FixtureError] = []
    for number, line in enumerate(_LINE_END.split(text), start=1):
        if line.strip() and not line.lstrip().startswith("#"):
            try:
                rows.append(_parse_line(path, number, line))
            except FixtureError as exc:
                errors.append(exc)
    if not rows and not errors:
        errors.append(FixtureError(path, "no fixture rows (every line is blank or a # comment)"))
    return rows, errors


def check_names(fixtures: Sequence[Fixture], known: Iterable[str], broken: Iterable[str] = ()) -> None:
    """Every expected name must exist in the catalog; a typo would silently count as a miss.
    ``broken`` names capabilities whose files failed to load: a fixture expecting one says so,
    rather than that no such capability exists. The first error found is raised."""
    for error in name_errors(fixtures, known, broken):
        raise error


def name_errors(fixtures: Iterable[Fixture], known: Iterable[str],
                broken: Iterable[str] = ()) -> Iterable[FixtureError]:
    """One error per fixture row expecting a name the catalog lacks (see :func:`check_names`)."""
    names, failed = set(known), set(broken)
    for fixture in fixtures:
        unknown = [e for e in fixture.expect if e not in names]
        if unknown:
            file, _, line = fixture.source.rpartition(":")
            if not_loaded := [e for e in unknown if e in failed]:
                yield FixtureError(file, f"expects {', '.join(map(repr, not_loaded))}, which failed to load "
                                         "(the tap error above; `capd lint` names it)", int(line))
            else:
                yield FixtureError(file, f"expects unknown capability {', '.join(map(repr, unknown))}", int(line))


def tap_fixture_files(tap: Path) -> list[Path]:
    """The tap's ``fixtures/*.jsonl``, sorted; hidden ones (an editor's ``.#routing.jsonl`` lock, a
    half-written ``.routing.jsonl``) are not fixtures, as hidden files are not tap files."""
    return sorted(path for path in (tap / "fixtures").glob("*.jsonl") if not path.name.startswith("."))
