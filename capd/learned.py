"""Learning from corrections: a manual enable shortly after a miss teaches the router.

When an agent manually enables capability X in a session within :data:`WINDOW` routed
turns after a message that abstained, or activated (or found already active) another
capability, capd records *(that message → X)* for X's tap. Learned examples:

- live in the data directory (``learned.sqlite3``), never in the tap;
- count as extra triggers of X for the ``capd`` and ``fused`` rules (never for ``anchor``,
  which stays the reference), applied shortly after they are recorded;
- are listed, forgotten and exported as suggested triggers by ``capd learned``.

Decisions where the issue is silent: only the most recent qualifying turn is taken (a
manual enable corrects one message); a turn is used once; turns that were ``skipped``
(too short) are passed over; a turn that routed to X itself means there is nothing to
learn; the recent turns are kept in memory, so a restart forgets them (not the learned
examples). A data directory that cannot be written keeps learned examples in memory.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

WINDOW = 3  # routed turns within which a manual enable counts as a correction
MAX_SESSIONS = 10_000  # sessions whose recent turns are remembered (least recently routed forgotten first)
FILE_NAME = "learned.sqlite3"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS learned (
    tap TEXT NOT NULL,
    capability TEXT NOT NULL,
    message TEXT NOT NULL,
    previous TEXT,
    session TEXT,
    created REAL NOT NULL,
    PRIMARY KEY (tap, capability, message)
)
"""


@dataclass(frozen=True)
class Learned:
    """One learned example: ``message`` should route to ``capability`` of ``tap``."""

    tap: str
    capability: str
    message: str
    previous: str | None  # what routing did: "abstain" or the capability it chose
    session: str | None
    created: float

    def as_dict(self) -> dict[str, Any]:
        return {"tap": self.tap, "capability": self.capability, "message": self.message,
                "previous": self.previous, "session": self.session, "created": self.created}


class LearnedStore:
    """Learned examples in SQLite; in memory when ``path`` is None or cannot be written."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.error: str | None = None
        self._lock = threading.Lock()
        self._conn = self._connect(path)

    @classmethod
    def open(cls, data_dir: Path) -> LearnedStore:
        return cls(Path(data_dir) / FILE_NAME)

    def _connect(self, path: Path | None) -> sqlite3.Connection:
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                conn = sqlite3.connect(path, check_same_thread=False, timeout=5.0)
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute(_SCHEMA)
                conn.commit()
                return conn
            except (OSError, sqlite3.Error) as exc:
                self.error = f"cannot store learned examples in {path}: {exc}; keeping them in memory"
                log.error("%s", self.error)
        conn = sqlite3.connect(":memory:", check_same_thread=False)
        conn.execute(_SCHEMA)
        return conn

    @contextmanager
    def _cursor(self) -> Iterator[sqlite3.Connection]:
        with self._lock, self._conn:
            yield self._conn

    def record(self, tap: Path | str, capability: str, message: str, previous: str | None = None,
               session: str | None = None) -> bool:
        """Store one example; False when it was already known."""
        try:
            with self._cursor() as conn:
                cursor = conn.execute(
                    "INSERT OR IGNORE INTO learned (tap, capability, message, previous, session, created) "
                    "VALUES (?, ?, ?, ?, ?, ?)", (str(tap), capability, message, previous, session, time.time()))
                return cursor.rowcount > 0
        except sqlite3.Error as exc:
            log.error("cannot record a learned example for %s: %s", capability, exc)
            return False

    def entries(self, tap: Path | str | None = None, capability: str | None = None) -> list[Learned]:
        where, args = _filters(tap, capability, None)
        with self._cursor() as conn:
            rows = conn.execute(f"SELECT tap, capability, message, previous, session, created FROM learned{where} "
                                "ORDER BY tap, capability, created, message", args).fetchall()
        return [Learned(*row) for row in rows]

    def forget(self, tap: Path | str | None = None, capability: str | None = None,
               message: str | None = None) -> int:
        """Delete matching examples (all of them when nothing is given); returns how many."""
        where, args = _filters(tap, capability, message)
        with self._cursor() as conn:
            return conn.execute(f"DELETE FROM learned{where}", args).rowcount

    def for_tap(self, tap: Path | str) -> dict[str, tuple[str, ...]]:
        """capability → learned messages, for one tap."""
        out: dict[str, list[str]] = {}
        for entry in self.entries(tap=tap):
            out.setdefault(entry.capability, []).append(entry.message)
        return {name: tuple(messages) for name, messages in out.items()}

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def _filters(tap: Path | str | None, capability: str | None, message: str | None) -> tuple[str, tuple[str, ...]]:
    clauses, args = [], []
    for column, value in (("tap", tap), ("capability", capability), ("message", message)):
        if value is not None:
            clauses.append(f"{column} = ?")
            args.append(str(value))
    return (" WHERE " + " AND ".join(clauses) if clauses else ""), tuple(args)


@dataclass(frozen=True)
class Turn:
    """One routed message of a session, as routing decided it."""

    message: str
    decision: str
    capability: str | None


class Corrections:
    """The last :data:`WINDOW` routed turns per session, and which of them a manual enable corrects."""

    def __init__(self, window: int = WINDOW, max_sessions: int = MAX_SESSIONS) -> None:
        self.window = window
        self.max_sessions = max_sessions
        self._turns: OrderedDict[str, deque[Turn]] = OrderedDict()
        self._lock = threading.Lock()

    def routed(self, session: str, message: str, decision: str, capability: str | None) -> None:
        with self._lock:
            turns = self._turns.pop(session, None) or deque(maxlen=self.window)
            turns.append(Turn(message, decision, capability))
            self._turns[session] = turns
            while len(self._turns) > self.max_sessions:
                self._turns.popitem(last=False)

    def enabled(self, session: str, name: str) -> Turn | None:
        """The turn that enabling ``name`` corrects (then used up), or None."""
        with self._lock:
            turns = self._turns.get(session)
            for turn in reversed(turns or ()):
                if turn.decision == "skipped":
                    continue
                if turn.capability == name and turn.decision in ("activate", "already_active"):
                    return None  # routing already chose it: nothing to learn
                assert turns is not None
                turns.remove(turn)
                return turn
            return None

    def forget_session(self, session: str) -> None:
        with self._lock:
            self._turns.pop(session, None)
