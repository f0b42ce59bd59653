"""Durable session state: one SQLite database (WAL) with an in-memory write-through cache.

The store knows records, not rules: :mod:`capd.sessions` decides what a session holds and
hands the store immutable :class:`SessionRecord` values to keep.

- Lives at ``<data_dir>/sessions.sqlite3`` (:data:`FILENAME`); the caller passes the path.
- Every :meth:`SessionStore.put` / :meth:`SessionStore.delete` is one transaction, committed
  before the call returns. WAL with ``synchronous=NORMAL`` survives a restart and a
  ``kill -9`` of the daemon (committed pages are in the OS cache); only a power cut can
  lose the last commits, and state costs only time to rebuild.
- Reads are served from the cache loaded at open; SQLite is never read on the hot path.
- Schema versioned in ``meta(schema_version)``; :data:`_MIGRATIONS` takes an older file
  forward, a newer file is refused with :class:`~capd.errors.StateError`.
- Opening an unusable file or directory raises :class:`~capd.errors.StateError`. A write
  that fails later (read-only directory, full disk, locked file) updates the cache anyway,
  keeps the change pending and raises :class:`~capd.errors.StateError`; the next write
  retries every pending change, so a running daemon keeps serving from memory. A write waits
  at most :data:`WRITE_WAIT` for another process's lock on the file (opening waits up to
  :data:`OPEN_WAIT`), and while writes keep failing they do not wait at all: with the file
  held by another process, every session call used to wait out SQLite's 5 s busy timeout,
  one after another.
- ``SessionStore(path, memory=True)`` keeps everything in an in-memory database: the
  service falls back to it (with a warning and an error in ``/v1/health``) when the file
  cannot be opened at start, so a read-only data directory still gives a working daemon.
  :meth:`SessionStore.attach` (the daemon tries every minute) opens the file once it can
  be used, and writes the sessions held in memory to it (the sessions removed meanwhile are
  removed from it), so a lock or a full disk at start costs no sessions after it clears.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import sqlite3
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO, Literal, cast

from capd.atomic import flocked
from capd.errors import StateError

log = logging.getLogger(__name__)

FILENAME = "sessions.sqlite3"
SCHEMA_VERSION = 1
OPEN_WAIT = 5.0  # seconds opening (and migrating) the file waits for another process's lock
WRITE_WAIT = 0.5  # seconds a write waits for it (capd's own writes are serialised; only others hold it)
Origin = Literal["auto", "manual", "pinned"]
ORIGINS: tuple[Origin, ...] = ("auto", "manual", "pinned")

_SCHEMA = (
    "CREATE TABLE sessions (id TEXT PRIMARY KEY, last_seen REAL NOT NULL, next_seq INTEGER NOT NULL,"
    " active TEXT NOT NULL)",
)
# version n -> statements that take a schema-n file to n + 1.
_MIGRATIONS: dict[int, tuple[str, ...]] = {}
_MISSING = object()


@dataclass(frozen=True)
class ServerSnapshot:
    """One server of an active capability as it was at activation: name, allowed tools, spec."""

    name: str
    tools: tuple[str, ...]
    spec: Mapping[str, Any]


@dataclass(frozen=True)
class ActiveCapability:
    """A capability active in a session."""

    name: str
    origin: Origin
    seq: int  # activation sequence number within the session
    last_used: float
    servers: tuple[ServerSnapshot, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "last_used": self.last_used,
            "origin": self.origin,
            "servers": [{"name": s.name, "tools": list(s.tools)} for s in self.servers],
        }


@dataclass(frozen=True)
class SessionRecord:
    """Everything stored about one session. ``active`` is kept in activation order."""

    session: str
    last_seen: float
    next_seq: int
    active: tuple[ActiveCapability, ...] = ()


def _encode(record: SessionRecord) -> str:
    return json.dumps(
        [{"name": a.name, "origin": a.origin, "seq": a.seq, "last_used": a.last_used,
          "servers": [{"name": s.name, "tools": list(s.tools), "spec": s.spec} for s in a.servers]}
         for a in record.active],
        ensure_ascii=False, default=str,
    )


# What decoding a damaged row raises: ``"seq": 1e999`` is an OverflowError, JSON nested deeper than
# Python's recursion limit a RecursionError; both failed the daemon's start.
_MALFORMED = (ValueError, KeyError, TypeError, OverflowError, RecursionError)


def stored_text(value: object) -> bool:
    """Whether a value read through :func:`tolerant_text` is text that was valid UTF-8 in the file."""
    if not isinstance(value, str):
        return False
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def tolerant_text(value: bytes) -> str:
    """A TEXT value of a capd SQLite file (``text_factory``). Bytes that are not UTF-8 (a damaged row)
    failed the whole read; they come back with surrogates in their place, for the reader to skip the
    row (``str.encode`` refuses them)."""
    return value.decode("utf-8", "surrogateescape")


def _decode(session: object, last_seen: float, next_seq: int, active: str) -> SessionRecord:
    """Rebuild a record from a row; raises one of :data:`_MALFORMED` if it is malformed."""
    if not isinstance(session, str):  # a NULL id: sorting the ids failed the start
        raise TypeError(f"the session id is {type(session).__name__}, not text")
    if not all(stored_text(text) for text in (session, active) if isinstance(text, str)):
        raise ValueError("it holds text that is not UTF-8")
    entries: list[ActiveCapability] = []
    for item in json.loads(active):
        origin = item["origin"]
        if origin not in ORIGINS:
            raise ValueError(f"unknown origin {origin!r}")
        servers = tuple(ServerSnapshot(str(s["name"]), tuple(str(t) for t in s["tools"]), dict(s["spec"]))
                        for s in item["servers"])
        entries.append(ActiveCapability(str(item["name"]), cast(Origin, origin), int(item["seq"]),
                                        float(item["last_used"]), servers))
    return SessionRecord(session, float(last_seen), int(next_seq), tuple(entries))


def set_busy_timeout(conn: sqlite3.Connection, milliseconds: int) -> None:
    """How long ``conn``'s writes wait for another process's lock (session state, learned corrections:
    a store whose writes keep failing stops waiting, so one locked file costs one wait, not one per write)."""
    with contextlib.suppress(sqlite3.Error):  # the write's own error says what is wrong
        conn.execute(f"PRAGMA busy_timeout = {milliseconds}")


def advice(path: Path, exc: BaseException, what: str) -> str:
    """What to do about ``exc`` on the SQLite file ``path`` holding capd's ``what`` tables (session
    state, learned corrections). Every error used to advise making the data directory writable (or
    nothing at all), also for a directory in the file's place, a lock, a full disk or a damaged file."""
    code = getattr(exc, "sqlite_errorcode", 0) & 0xFF
    if isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.OperationalError):
        return "the file is damaged; capd leaves it as it is: move it aside to start afresh"  # not a database
    if path.is_dir():
        return "a directory is in the file's place: move it aside (capd creates the file)"
    if code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
        return "another process holds the file locked: stop it (an open sqlite3 shell, a backup tool) or wait"
    if code == sqlite3.SQLITE_FULL:
        return "the disk is full: free some space, or use another --data-dir / CAPD_DATA_DIR"
    if code == sqlite3.SQLITE_ERROR:  # no such table or column, a table already there: not capd's layout
        return (f"the file does not hold capd's {what} tables (another program's, or edited); capd leaves it as "
                "it is: move it aside to start afresh")
    return ("make the data directory writable (--data-dir / CAPD_DATA_DIR), or move the file aside to start "
            "afresh")  # cannot create, open or write it


class SessionStore:
    """Sessions in SQLite, cached in memory. Thread-safe; a write holds the file only to commit."""

    def __init__(self, path: Path | str, *, timeout: float = WRITE_WAIT, memory: bool = False) -> None:
        """``memory=True``: an in-memory database that nothing outlives (the fallback when ``path``
        cannot be opened); ``path`` then only names, in messages, the file it stands in for.
        ``timeout``: how long a write waits for another process's lock on the file."""
        self.path = Path(path)
        self.persistent = not memory
        self.last_error: str | None = None
        self._wait_ms = int(timeout * 1000)
        self._cache: dict[str, SessionRecord] = {}
        self._pending: dict[str, SessionRecord | None] = {}  # None = delete
        self._forgotten: set[str] = set()  # deleted while in memory only: to delete from the file on attach
        self._cache_lock = threading.Lock()  # brief: dict access only
        self._db_lock = threading.Lock()  # one writer on the connection at a time
        self._conn: sqlite3.Connection | None = self._open_memory() if memory else self._open(timeout)
        self._cache = self._load()

    def attach(self) -> bool:
        """For a store in memory only: open :attr:`path` now and move the sessions to it (theirs
        win over the file's copy of the same id; the file's others are kept, except those deleted
        meanwhile). True once the store is persistent; False, changing nothing, while the file
        still cannot be used."""
        if self.persistent:
            return True
        conn: sqlite3.Connection | None = None
        try:
            conn = self._open(self._wait_ms / 1000)  # not under the write lock: opening may wait for a lock
            stored = self._read(conn)
            with self._db_lock:
                with self._cache_lock:
                    batch: dict[str, SessionRecord | None] = {**dict.fromkeys(self._forgotten), **self._cache}
                self._write(conn, batch)
                with self._cache_lock:
                    self._cache = {**{k: v for k, v in stored.items() if k not in batch}, **self._cache}
                    self._forgotten -= batch.keys()
                self._settle(batch)
                old, self._conn = self._conn, conn
                self.persistent, self.last_error = True, None
        except (StateError, sqlite3.Error) as exc:
            log.debug("%s is still unusable: %s", self.path, exc)
            if conn is not None:
                conn.close()
            return False
        if old is not None:
            old.close()
        return True

    def _open_memory(self) -> sqlite3.Connection:
        conn = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
        self._migrate(conn)
        return conn

    def _fail(self, doing: str, exc: BaseException) -> StateError:
        return StateError(f"{self.path}: cannot {doing} session state: {exc}; {advice(self.path, exc, 'session')}")

    def _open(self, timeout: float) -> sqlite3.Connection:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise self._fail("create the directory for", exc) from None
        conn: sqlite3.Connection | None = None
        try:
            conn = sqlite3.connect(self.path, timeout=max(timeout, OPEN_WAIT), isolation_level=None,
                                   check_same_thread=False)
            conn.text_factory = tolerant_text  # one row that is not UTF-8 kept every session in memory only
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise sqlite3.OperationalError(f"journal_mode is {mode!r}, WAL could not be enabled")
            conn.execute("PRAGMA synchronous=NORMAL")
            self._migrate(conn)
            conn.execute(f"PRAGMA busy_timeout = {self._wait_ms}")
        except sqlite3.Error as exc:
            if conn is not None:
                conn.close()
            raise self._fail("open", exc) from None
        except StateError:
            if conn is not None:
                conn.close()
            raise
        return conn

    def _migrate(self, conn: sqlite3.Connection) -> None:
        """Create or upgrade the schema. Writes ``meta`` every time, which also proves the file is writable."""
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            version = self._version(row[0]) if row else 0
            if version > SCHEMA_VERSION:
                raise StateError(f"{self.path}: session state has schema {version}, newer than this capd "
                                 f"understands ({SCHEMA_VERSION}); upgrade capd or use another --data-dir")
            statements = _SCHEMA if version == 0 else tuple(
                stmt for v in range(version, SCHEMA_VERSION) for stmt in _MIGRATIONS[v])
            for statement in statements:
                conn.execute(statement)
            conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('schema_version', ?)",
                         (str(SCHEMA_VERSION),))
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def _version(self, value: object) -> int:
        """The stored schema version; a value that is no version number (a damaged or edited file)
        used to escape as a bare ValueError, failing the daemon's start without naming the file."""
        try:
            return int(str(value))
        except ValueError:
            raise StateError(f"{self.path}: session state has schema version {value!r}, which is not a number: "
                             "the file is damaged; capd leaves it as it is: move it aside to start afresh") from None

    def _load(self) -> dict[str, SessionRecord]:
        assert self._conn is not None
        try:
            return self._read(self._conn)
        except StateError:
            self.close()
            raise

    def _read(self, conn: sqlite3.Connection) -> dict[str, SessionRecord]:
        try:
            rows = conn.execute("SELECT id, last_seen, next_seq, active FROM sessions").fetchall()
        except sqlite3.Error as exc:
            raise self._fail("read", exc) from None
        records: dict[str, SessionRecord] = {}
        for row in rows:
            try:
                records[row[0]] = _decode(*row)
            except _MALFORMED as exc:
                log.warning("%s: skipping unreadable session %r: %s", self.path, row[0], exc)
        return records

    # -- reads: memory only ------------------------------------------------------------------
    def get(self, session: str) -> SessionRecord | None:
        with self._cache_lock:
            return self._cache.get(session)

    def ids(self) -> tuple[str, ...]:
        with self._cache_lock:
            return tuple(sorted(self._cache))

    @property
    def pending(self) -> int:
        """Changes applied in memory but not yet committed to disk (0 when healthy)."""
        with self._cache_lock:
            return len(self._pending)

    # -- writes: cache first, then one transaction ----------------------------------------------
    def put(self, record: SessionRecord) -> None:
        """Store a session. Raises StateError if it could not be committed (it stays cached and pending)."""
        with self._cache_lock:
            self._cache[record.session] = record
            self._pending[record.session] = record
            self._forgotten.discard(record.session)
        self._flush()

    def delete(self, session: str) -> None:
        """Forget a session (no error if absent). Raises StateError like :meth:`put`."""
        with self._cache_lock:
            self._cache.pop(session, None)
            self._pending[session] = None
            if not self.persistent:
                self._forgotten.add(session)
        self._flush()

    def _flush(self) -> None:
        with self._db_lock:
            with self._cache_lock:
                batch = dict(self._pending)
            if not batch:
                return
            if self._conn is None:
                raise StateError(f"{self.path}: session store is closed")
            try:
                self._write(self._conn, batch)
            except sqlite3.Error as exc:
                error = self._fail("write", exc)
                if self.last_error is None:  # failing from now on: the next writes try without waiting
                    set_busy_timeout(self._conn, 0)
                self.last_error = str(error)
                raise error from None
            if self.last_error is not None:
                set_busy_timeout(self._conn, self._wait_ms)
            self.last_error = None
            self._settle(batch)

    def _settle(self, batch: Mapping[str, SessionRecord | None]) -> None:
        """``batch`` is committed: those pending changes are done, unless changed again meanwhile."""
        with self._cache_lock:
            for session, value in batch.items():
                if self._pending.get(session, _MISSING) is value:
                    del self._pending[session]

    @staticmethod
    def _write(conn: sqlite3.Connection, batch: Mapping[str, SessionRecord | None]) -> None:
        conn.execute("BEGIN IMMEDIATE")
        try:
            for session, record in batch.items():
                if record is None:
                    conn.execute("DELETE FROM sessions WHERE id = ?", (session,))
                else:
                    conn.execute("INSERT OR REPLACE INTO sessions (id, last_seen, next_seq, active) "
                                 "VALUES (?, ?, ?, ?)",
                                 (session, record.last_seen, record.next_seq, _encode(record)))
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def close(self) -> int:
        """Commit what is still pending (one last try, waiting for another process's lock as a healthy
        write does), then close. Returns how many changes could not be committed and are lost with
        this process (0 normally; always 0 in memory, where nothing outlives it anyway)."""
        with self._db_lock:
            if self._conn is None:
                return 0  # closed before: already counted then
            if self.persistent and self.last_error is not None:
                set_busy_timeout(self._conn, self._wait_ms)  # failing writes stopped waiting; this one may
        if self.persistent:
            with contextlib.suppress(StateError):  # what it could not commit is counted below
                self._flush()
        with self._db_lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
        return self.pending if self.persistent else 0

    def __enter__(self) -> SessionStore:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def sessions_owner(path: Path) -> BinaryIO | None:
    """Hold ``<sessions file>.owner`` (``flock``) for as long as this daemon serves sessions from
    ``path``: a second daemon on the data directory finds it held and warns. Each daemon serves its
    own copy of the sessions (read at its start), so two daemons given the same session id would
    overwrite each other's; everything else in a data directory is safe to share."""
    try:
        handle = flocked(path.with_name(path.name + ".owner"), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return None  # a data directory that cannot be written: the session store says so
    if handle is None:
        log.warning("another capd daemon keeps its sessions in %s: sessions are not shared between daemons, so "
                    "give each daemon its own session ids (or its own --data-dir)", path)
    return handle
