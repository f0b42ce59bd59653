"""The learned store's rows: the table, one correction (:class:`Learned`), and reading them safely.

:mod:`capd.learned` keeps corrections in ``learned.sqlite3``; this module is what that file holds and
how its rows are read: the schema, a row as a :class:`Learned`, reading a file without writing to it
(:func:`read_only_rows`: ``capd learned list | export``, and a data directory that cannot be
written), telling corrections from rows a damaged or edited file holds (:func:`usable_rows`), and the
keys and filters a query and an entry held in memory are matched by (:func:`canonical_tap`,
:func:`where_clause`, :func:`matches`).
"""

from __future__ import annotations

import math
import os
import sqlite3
import urllib.parse
from collections.abc import Iterable, Sequence
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capd.state import stored_text, tolerant_text
from capd.text import printable, recall_key

SCHEMA = """
CREATE TABLE IF NOT EXISTS learned (
    tap TEXT NOT NULL,
    capability TEXT NOT NULL,
    message TEXT NOT NULL,
    previous TEXT,
    session TEXT,
    created REAL NOT NULL,
    kind TEXT NOT NULL DEFAULT 'trigger',
    PRIMARY KEY (tap, capability, message)
)
"""
KINDS = ("trigger", "abstain")  # message -> capability, and message -/-> capability


@dataclass(frozen=True)
class Learned:
    """One correction: ``message`` should (``kind`` trigger) or should not (abstain) route to
    ``capability`` of ``tap``."""

    tap: str
    capability: str
    message: str
    previous: str | None  # what routing did: "abstain" or the capability it chose
    session: str | None
    created: float
    kind: str = "trigger"

    def as_dict(self) -> dict[str, Any]:
        return {"tap": self.tap, "capability": self.capability, "message": self.message, "kind": self.kind,
                "previous": self.previous, "session": self.session, "created": self.created}



def read_only_rows(path: Path) -> list[tuple[Any, ...]]:
    """Every row of a learned file, read without writing to it. Any reader of a WAL file makes a
    ``-wal`` and ``-shm`` beside it; a connection that may write (``mode=rw``, which never creates
    the file) removes them as the last one to close, where a read-only one left them behind. Where
    it cannot write, ``mode=ro``; and where SQLite cannot even create the ``-shm`` (a read-only
    directory: "unable to open database file", the corrections were hidden), ``immutable=1`` reads
    the file as it is. The path is quoted: ``#``, ``?`` or ``%`` in a data directory's name would
    otherwise cut the URI."""
    uri = f"file:{urllib.parse.quote(str(path.absolute()))}"
    for mode in ("?mode=rw", "?mode=ro"):
        try:
            return _rows(uri + mode)
        except sqlite3.OperationalError:
            pass
    return _rows(uri + "?mode=ro&immutable=1")


def _rows(uri: str) -> list[tuple[Any, ...]]:
    with closing(sqlite3.connect(uri, uri=True)) as stored:
        stored.text_factory = tolerant_text
        columns = {row[1] for row in stored.execute("PRAGMA table_info(learned)")}
        if not columns and not stored.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]:
            return []  # an empty database (a zero-length file): nothing learned yet
        kind = "kind" if "kind" in columns else "'trigger'"
        return stored.execute(f"SELECT tap, capability, message, previous, session, created, {kind} "
                              "FROM learned").fetchall()


def usable_rows(rows: Iterable[Sequence[Any]]) -> tuple[list[Learned], list[int]]:
    """The rows (as :class:`Learned`'s fields) that are corrections, and the indices of those that are
    not: a damaged or edited file can hold a BLOB or undecodable text where text belongs, a ``created``
    that is no number, an unknown kind. Routing used to fail on them, and the daemon with it."""
    found: list[Learned] = []
    skipped: list[int] = []
    for index, (tap, capability, message, previous, session, created, kind) in enumerate(rows):
        texts = all(map(stored_text, (tap, capability, message))) and all(
            v is None or stored_text(v) for v in (previous, session))
        if texts and kind in KINDS and isinstance(created, int | float) and math.isfinite(created):
            found.append(Learned(tap, capability, message, previous, session, float(created), kind))
        else:
            skipped.append(index)
    return found, skipped


def skipped_rows(path: Path, count: int) -> str:
    """What to say about ``count`` rows of ``path`` that are no corrections."""
    return (f"{path}: skipped {count} row(s) that cannot be read as learned corrections (damaged or edited); "
            "capd leaves them in the file")


def damaged(exc: sqlite3.Error) -> bool:
    """Whether SQLite says the file itself is damaged (not a database, malformed), not in the way."""
    return getattr(exc, "sqlite_errorcode", 0) & 0xFF in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)


def canonical_tap(tap: Path | str) -> str:
    """The key a tap's corrections are stored under: its real path, so that ``taps/x``,
    ``config/../taps/x`` and a link to it are one tap. A byte of the path that is not UTF-8 is
    written ``\\xNN`` (:func:`~capd.text.printable`): SQLite takes text only."""
    return printable(os.path.realpath(os.path.expanduser(str(tap))))


def where_clause(taps: Sequence[str] | None, capability: str | None,
             kind: str | None = None) -> tuple[str, tuple[str, ...]]:
    """A WHERE clause: ``taps`` are the spellings of one tap (:meth:`capd.learned.LearnedStore._spellings`)."""
    clauses: list[str] = []
    args: list[str] = []
    if taps is not None:
        clauses.append(f"tap IN ({', '.join('?' * len(taps))})")
        args += taps
    for column, value in (("capability", capability), ("kind", kind)):
        if value is not None:
            clauses.append(f"{column} = ?")
            args.append(value)
    return (f" WHERE {' AND '.join(clauses)}" if clauses else ""), tuple(args)


def matches(entry: Learned, tap: Path | str | None = None, capability: str | None = None,
             message: str | None = None, kind: str | None = None) -> bool:
    """:func:`where_clause` for an entry held in memory, and ``message`` as
    :meth:`capd.learned.LearnedStore.forget` matches it."""
    if tap is not None and canonical_tap(entry.tap) != canonical_tap(tap):
        return False
    if message is not None and recall_key(entry.message) != recall_key(message):
        return False
    wanted = {"capability": capability, "kind": kind}
    return all(getattr(entry, column) == value for column, value in wanted.items() if value is not None)
