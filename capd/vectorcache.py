"""The content-hash vector cache: (model_id, sha256 of the exact text) → float32 vector.

One SQLite file, ``<data_dir>/vectors.sqlite3``, in WAL mode so that readers never wait for
a writer. Writes are short ``BEGIN IMMEDIATE`` transactions with a generous busy timeout,
so several threads (one connection, one lock) and several processes can fill it at once;
racing writers of the same key are harmless: the first row stays.

Only finite vectors are stored (:meth:`VectorCache.put_many` refuses NaN and inf). A row that
cannot be used (a torn one, or NaN / inf written by a damaged model before capd refused them)
reads as missing, so it is embedded again, and the new vector replaces it.

Failure policy (losing the cache only costs time, so it never stops capd):

- a corrupt file, or a foreign one (another program's SQLite database, or a different
  schema version), is renamed to ``vectors.sqlite3.corrupt-<timestamp>`` with a logged
  warning, and a fresh cache is created in its place; the newest ``KEEP_SET_ASIDE`` such copies
  are kept, older ones deleted;
- a file another process holds locked while this one opens it ("database is locked": SQLite
  does not always wait in its busy handler, e.g. while another process switches the file to
  WAL or recovers it) is never taken for a corrupt one: opening retries for up to
  ``OPEN_RETRY_S``, then falls back like an unwritable directory, leaving the file as it is;
- a data directory that cannot be written (read-only, or not creatable) gives an
  in-memory cache for this process, with a logged warning; ``persistent`` is then False.
  It still de-duplicates within the process; nothing is kept.

:class:`capd.embedder.CachedEmbedder` puts an encoder in front of the cache.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from filelock import FileLock

from capd.encoder import Vectors
from capd.errors import CacheError

log = logging.getLogger(__name__)

CACHE_FILE = "vectors.sqlite3"
APPLICATION_ID = 0x63617064  # "capd": marks the file as ours
SCHEMA_VERSION = 1
BUSY_TIMEOUT_S = 60.0
OPEN_RETRY_S = BUSY_TIMEOUT_S  # how long opening retries a file another process holds locked
OPEN_RETRY_PAUSE_S = 0.05
CHUNK = 500  # SQL parameters per statement
LOOKUP_SLICE = 4096  # texts looked up at a time (capd.embedder.CachedEmbedder, capd index --check)
KEEP_SET_ASIDE = 2  # unusable caches kept for a look (see VectorCache._prune_set_asides)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS vectors (
    model_id TEXT NOT NULL,
    text_hash TEXT NOT NULL,
    dim INTEGER NOT NULL,
    vector BLOB NOT NULL,
    PRIMARY KEY (model_id, text_hash)
) WITHOUT ROWID
"""

_T = TypeVar("_T")


def text_hash(text: str) -> str:
    """sha256 hex of the exact text (no normalisation: changed text must re-embed)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class _Unusable(Exception):
    """The file exists but is not a usable capd cache (corrupt or foreign)."""


class VectorCache:
    """SQLite-backed vector store. ``VectorCache.open(data_dir)`` is the usual entry point."""

    def __init__(self, path: Path | None) -> None:
        """``path`` None gives an in-memory cache (nothing persists)."""
        self.path = path
        self._lock = threading.Lock()
        self._conn = self._connect_with_recovery() if path is not None else self._memory()

    @classmethod
    def open(cls, data_dir: Path) -> VectorCache:
        """The cache of a data directory; in memory, with a warning, when it cannot be written."""
        path = data_dir / CACHE_FILE
        try:
            data_dir.mkdir(parents=True, exist_ok=True)
            return cls(path)
        except (OSError, sqlite3.OperationalError, CacheError) as exc:
            log.warning("vector cache %s cannot be used (%s); using an in-memory cache: vectors will be "
                        "re-embedded on every start until the data directory is writable", path, exc)
            return cls(None)

    @property
    def persistent(self) -> bool:
        return self.path is not None

    # -- opening -------------------------------------------------------------------------------

    def _memory(self) -> sqlite3.Connection:
        conn = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
        _add_functions(conn)
        conn.execute(_SCHEMA)
        return conn

    def _connect_with_recovery(self) -> sqlite3.Connection:
        assert self.path is not None
        try:
            return self._connect(self.path)
        except _Unusable as exc:
            with FileLock(str(self.path) + ".lock", timeout=BUSY_TIMEOUT_S):
                try:  # another process may have replaced it already
                    return self._connect(self.path)
                except _Unusable:
                    self._set_aside(self.path, str(exc))
                return self._connect_fresh(self.path)

    @classmethod
    def _connect_fresh(cls, path: Path) -> sqlite3.Connection:
        """A connection to the new file that replaces one set aside; one that is unusable as well
        says so as a :class:`CacheError` (the caller falls back to memory), never escapes."""
        try:
            return cls._connect(path)
        except _Unusable as exc:
            raise CacheError(f"{path}: a new vector cache cannot be created there: {exc}") from None

    def _replace_corrupt(self, why: str) -> sqlite3.Connection:
        """Called when a query found the file corrupt: set it aside unless another process already did."""
        assert self.path is not None
        with FileLock(str(self.path) + ".lock", timeout=BUSY_TIMEOUT_S):
            try:
                conn = self._connect(self.path)
                if conn.execute("PRAGMA quick_check").fetchone()[0] == "ok":
                    return conn
                conn.close()
            except (_Unusable, sqlite3.DatabaseError):
                pass
            self._set_aside(self.path, why)
            return self._connect_fresh(self.path)

    @staticmethod
    def _connect(path: Path) -> sqlite3.Connection:
        """A checked connection; a file held locked by another process is waited for, never set aside."""
        deadline = time.monotonic() + OPEN_RETRY_S
        while True:
            conn = sqlite3.connect(str(path), timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
            _add_functions(conn)
            try:
                _check_or_init(conn, path)
                return conn
            except _Unusable:
                conn.close()
                raise
            except sqlite3.DatabaseError as exc:
                conn.close()
                if not isinstance(exc, sqlite3.OperationalError):
                    raise _Unusable(f"not a readable SQLite database ({exc})") from None
                if _is_busy(exc):
                    if time.monotonic() < deadline:
                        time.sleep(OPEN_RETRY_PAUSE_S)
                        continue
                    raise CacheError(f"{path}: the vector cache stayed locked by another process: {exc}") from None
                if _is_access_error(exc):
                    raise CacheError(f"{path}: cannot open the vector cache: {exc}") from None
                raise _Unusable(f"not a readable SQLite database ({exc})") from None

    @staticmethod
    def _set_aside(path: Path, why: str) -> None:
        stamp = f"{path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}"
        taken = [_set_aside_order(p)[1] for p in path.parent.glob(f"{glob.escape(stamp)}*")]
        # a second one within the second gets the next number (renaming over the first lost it)
        aside = path.with_name(f"{stamp}-{max(taken) + 1}" if taken else stamp)
        log.warning("vector cache %s is unusable (%s); moved it to %s and starting a new one", path, why, aside)
        try:
            path.rename(aside)
            for suffix in ("-wal", "-shm"):
                side = path.with_name(path.name + suffix)
                if side.exists():
                    side.rename(aside.with_name(aside.name + suffix))
        except OSError as exc:
            raise CacheError(f"{path}: the vector cache is unusable ({why}) and cannot be moved aside: {exc}") \
                from None
        VectorCache._prune_set_asides(path)

    @staticmethod
    def _prune_set_asides(path: Path) -> None:
        """Keep the newest :data:`KEEP_SET_ASIDE` copies set aside (each is a whole cache, and a disk
        that keeps damaging the file would otherwise fill up with them); older ones are deleted."""
        copies = sorted((p for p in path.parent.glob(f"{glob.escape(path.name)}.corrupt-*")
                         if not p.name.endswith(("-wal", "-shm"))), key=_set_aside_order, reverse=True)
        for old in copies[KEEP_SET_ASIDE:]:
            for victim in (old, old.with_name(old.name + "-wal"), old.with_name(old.name + "-shm")):
                try:
                    victim.unlink(missing_ok=True)
                except OSError as exc:
                    log.warning("cannot remove the old vector cache copy %s: %s", victim, exc)
                    break
            else:
                log.info("removed %s: only the newest %d unusable vector caches are kept", old, KEEP_SET_ASIDE)

    # -- operations --------------------------------------------------------------------------

    def _execute(self, immediate: bool, operation: Callable[[sqlite3.Connection], _T]) -> _T:
        """Run ``operation`` in one transaction; a file found corrupt mid-run is replaced once."""
        with self._lock:
            try:
                return _in_transaction(self._conn, immediate, operation)
            except sqlite3.OperationalError as exc:  # locked past the timeout, disk full, read-only
                raise CacheError(f"{self.path or 'in-memory vector cache'}: {exc}") from None
            except sqlite3.DatabaseError as exc:  # "database disk image is malformed" and friends
                if self.path is None:
                    raise CacheError(f"in-memory vector cache: {exc}") from None
                self._conn.close()
                try:
                    self._conn = self._replace_corrupt(str(exc))
                except (OSError, CacheError) as err:
                    raise self._to_memory(f"the vector cache is unusable ({exc}) and cannot be replaced: {err}") \
                        from None
                return _in_transaction(self._conn, immediate, operation)

    def _to_memory(self, why: str) -> CacheError:
        """Carry on in memory, as :meth:`open` does with a file it cannot use, and say why. A damaged
        file that could not be set aside (the directory remounted read-only after disk errors, its
        ``.lock`` held) used to raise OSError out of every later lookup: a traceback in a route."""
        path, self.path = self.path, None
        self._conn = self._memory()
        log.warning("%s: %s; using an in-memory cache until capd restarts", path, why)
        return CacheError(f"{path}: {why}")

    def get_many(self, model_id: str, hashes: Sequence[str]) -> dict[str, Vectors]:
        """Vectors found for these text hashes (missing ones are simply absent)."""
        unique = list(dict.fromkeys(hashes))

        def read(conn: sqlite3.Connection) -> tuple[dict[str, Vectors], int]:
            found: dict[str, Vectors] = {}
            unusable = 0
            for start in range(0, len(unique), CHUNK):
                chunk = unique[start:start + CHUNK]
                marks = ",".join("?" * len(chunk))
                rows = conn.execute(f"SELECT text_hash, dim, vector FROM vectors WHERE model_id = ? "
                                    f"AND text_hash IN ({marks})", [model_id, *chunk]).fetchall()
                usable = _usable_rows(rows)
                unusable += len(rows) - len(usable)
                found.update(usable)
            return found, unusable

        found, unusable = self._execute(False, read)
        if unusable:
            log.warning("vector cache: %d stored vector(s) of %s are torn or hold NaN / inf (written by a damaged "
                        "model or an interrupted write); they count as missing and are embedded again",
                        unusable, model_id)
        return found

    def put_many(self, model_id: str, items: Iterable[tuple[str, Any]]) -> int:
        """Store ``(text hash, vector)`` pairs; returns how many were new (or replaced a row that
        :meth:`get_many` cannot use). A usable row already stored stays: the first writer wins.

        Raises :class:`CacheError`, storing nothing, when a vector holds NaN or inf.
        """
        rows = []
        bad = 0
        for key, vector in items:
            array = np.ascontiguousarray(vector, dtype="<f4").reshape(-1)
            bad += not bool(np.isfinite(array).all())
            rows.append((model_id, key, int(array.shape[0]), array.tobytes()))
        if bad:
            raise CacheError(f"{self.path or 'in-memory vector cache'}: refusing to store {bad} vector(s) of "
                             f"{model_id} holding NaN or inf")
        if not rows:
            return 0

        def write(conn: sqlite3.Connection) -> int:
            before = conn.total_changes
            conn.executemany("INSERT INTO vectors (model_id, text_hash, dim, vector) VALUES (?, ?, ?, ?) "
                             "ON CONFLICT (model_id, text_hash) DO UPDATE SET dim = excluded.dim, "
                             "vector = excluded.vector WHERE capd_unusable(vectors.dim, vectors.vector)", rows)
            return conn.total_changes - before

        return self._execute(True, write)

    def prune(self, model_id: str, keep_hashes: Iterable[str]) -> int:
        """Delete this model's vectors whose hash is not in ``keep_hashes``; returns how many."""
        keep = [(h,) for h in set(keep_hashes)]

        def delete(conn: sqlite3.Connection) -> int:
            conn.execute("CREATE TEMP TABLE IF NOT EXISTS keep (h TEXT PRIMARY KEY)")
            conn.execute("DELETE FROM keep")
            conn.executemany("INSERT OR IGNORE INTO keep (h) VALUES (?)", keep)
            cursor = conn.execute("DELETE FROM vectors WHERE model_id = ? AND text_hash NOT IN (SELECT h FROM keep)",
                                  (model_id,))
            conn.execute("DELETE FROM keep")
            return cursor.rowcount

        return self._execute(True, delete)

    def counts(self) -> dict[str, int]:
        """Number of stored vectors per model id."""

        def count(conn: sqlite3.Connection) -> dict[str, int]:
            rows = conn.execute("SELECT model_id, COUNT(*) FROM vectors GROUP BY model_id ORDER BY model_id")
            return {str(model): int(n) for model, n in rows}

        return self._execute(False, count)

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self) -> VectorCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _usable_rows(rows: Sequence[tuple[str, int, bytes]]) -> dict[str, Vectors]:
    """The vectors of the rows that can be used: a short blob is a torn row, TEXT in its place an
    edited file, and NaN or inf was written by a damaged model; all are left out (missing).
    Checked a chunk at a time: per row it cost ~3 us, ~0.3 s on a warm start over 90k triggers."""
    by_dim: dict[int, list[tuple[str, bytes]]] = {}
    for key, dim, blob in rows:
        if isinstance(blob, bytes) and len(blob) == dim * 4:
            by_dim.setdefault(dim, []).append((key, blob))
    found: dict[str, Vectors] = {}
    for dim, items in by_dim.items():
        matrix = np.frombuffer(b"".join(blob for _, blob in items), dtype="<f4").astype(np.float32)
        matrix = matrix.reshape(len(items), dim)
        finite = np.asarray(np.isfinite(matrix).all(axis=1))
        found.update((key, matrix[i]) for i, (key, _) in enumerate(items) if finite[i])
    return found


def _unusable(dim: int, blob: bytes) -> bool:
    """SQL ``capd_unusable(dim, vector)``: whether a stored row is one :func:`_usable_rows` leaves out."""
    if not isinstance(blob, bytes) or len(blob) != dim * 4:
        return True
    return not bool(np.isfinite(np.frombuffer(blob, dtype="<f4")).all())


def _add_functions(conn: sqlite3.Connection) -> None:
    conn.create_function("capd_unusable", 2, _unusable, deterministic=True)


def _in_transaction(conn: sqlite3.Connection, immediate: bool, operation: Callable[[sqlite3.Connection], _T]) -> _T:
    conn.execute("BEGIN IMMEDIATE" if immediate else "BEGIN")
    try:
        result = operation(conn)
    except BaseException:
        with contextlib.suppress(sqlite3.Error):  # SQLite may have rolled back already; report the first error
            conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
    return result


def _is_busy(exc: sqlite3.OperationalError) -> bool:
    """SQLITE_BUSY / SQLITE_LOCKED: another connection holds the file. Transient, never corruption."""
    code = getattr(exc, "sqlite_errorcode", 0)  # set on every error sqlite3 raises (Python >= 3.11)
    return code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


# Errors of the file's surroundings, not its contents: a full disk (SQLITE_FULL) used to be taken for
# a corrupt file, set aside, and the fresh cache failing the same way escaped as a traceback.
def _set_aside_order(path: Path) -> tuple[str, int]:
    """``…corrupt-<stamp>[-<n>]`` in the order they were set aside (by name: a rename keeps the mtime)."""
    stamp, _, rest = path.name.rpartition(".corrupt-")[2].partition("-")
    time_part, _, nth = rest.partition("-")
    return f"{stamp}-{time_part}", int(nth) if nth.isdigit() else 1


_ACCESS_CODES = (sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_PERM, sqlite3.SQLITE_IOERR,
                 sqlite3.SQLITE_FULL, sqlite3.SQLITE_NOMEM, sqlite3.SQLITE_AUTH)


def _is_access_error(exc: sqlite3.OperationalError) -> bool:
    if getattr(exc, "sqlite_errorcode", 0) & 0xFF in _ACCESS_CODES:
        return True
    text = str(exc).lower()
    return any(s in text for s in ("unable to open", "readonly", "read-only", "permission", "disk i/o", "disk is full"))


def _check_or_init(conn: sqlite3.Connection, path: Path) -> None:
    """Accept our own file, initialise an empty one, reject anything else with :class:`_Unusable`."""
    conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
    app_id = conn.execute("PRAGMA application_id").fetchone()[0]  # reads the header: fails if corrupt
    if app_id not in (0, APPLICATION_ID):
        raise _Unusable(f"application id {app_id:#x} is not capd's")
    if app_id == 0 and conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]:
        raise _Unusable("a SQLite database of another program")
    if conn.execute("PRAGMA journal_mode = WAL").fetchone()[0].lower() != "wal":
        raise CacheError(f"{path}: cannot switch the vector cache to WAL mode")
    if app_id == 0:
        conn.execute("BEGIN IMMEDIATE")
        try:  # re-check inside the write lock: another process may have initialised it meanwhile
            if conn.execute("PRAGMA application_id").fetchone()[0] == 0:
                conn.execute(_SCHEMA)
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version != SCHEMA_VERSION:
        raise _Unusable(f"schema version {version}, expected {SCHEMA_VERSION}")
