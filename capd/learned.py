"""Learning from corrections: what an agent does right after a routing decision teaches the router.

Two corrections are recorded for a capability's tap, each keyed by the routed message:

- **trigger**: the agent manually enables capability X within :data:`~capd.corrections.WINDOW` routed turns
  after a message that abstained, or activated (or found already active) another capability:
  *(that message → X)*. It counts as an extra trigger of X.
- **abstain**: the agent manually disables capability Y right after the message that
  activated it (no other message routed in between): *(that message ↛ Y)*. Y is then vetoed
  for any message at least as close to a refused message as to Y's own examples
  (:class:`capd.vetoes.Vetoes`): the agent said no to a message like this one. Disabling Y
  later (after another message, e.g. because the work is done) teaches nothing.

A later correction of the same (capability, message) replaces the earlier one. Each capability
keeps its latest ``learn_max`` corrections of each kind (:data:`MAX_PER_CAPABILITY` by default;
the oldest go first), so a misbehaving agent that enables the same capability after every turn
cannot bury its tap's own triggers under thousands of learned ones, nor grow the store and the
fused head's fit without bound. Learned entries:

- live in the data directory (``learned.sqlite3``), never in the tap;
- are used by the ``capd`` and ``fused`` rules (never by ``anchor``, which stays the
  reference), applied shortly after they are recorded;
- are listed, forgotten and exported (triggers as suggested triggers, abstains as messages
  to review) by ``capd learned``.

Which turn an enable or a disable corrects is :mod:`capd.corrections`. A data directory that
cannot be written keeps learned entries in memory; so does a file that will not take a
correction later (locked, disk full), until a write or a
:meth:`LearnedStore.version` check succeeds (:meth:`LearnedStore.close` tries once more). Such a
held-back correction lives in the daemon only: ``capd learned forget``, another process, does not
see it until it is stored.

Other processes write the file too: ``capd learned forget``, and a second daemon sharing the data
directory (another port or socket). A daemon notices their commits within
:data:`capd.api.LEARNED_CHECK_INTERVAL` seconds by :meth:`LearnedStore.version` (SQLite's
``PRAGMA data_version``, which changes only for other connections' commits) and routes with the
entries as they now are. A store kept in memory has no other writers: with a read-only data
directory the file's entries are copied in once, at the start (nobody here can change the file;
whoever can is seen at the next start), and corrections learned meanwhile live only in that copy.

Rows that cannot be corrections (a damaged or edited file: a BLOB or text that is not UTF-8 where
text belongs, a ``created`` that is no number, an unknown kind) are skipped and logged, and left in
the file. A file damaged while the daemon uses it is treated like one that could not be opened at
the start: the store carries on in memory with the corrections it had read from it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import closing, contextmanager
from dataclasses import astuple, replace
from pathlib import Path

from capd.catalog import Catalog
from capd.learned_rows import (
    KINDS,
    SCHEMA,
    Learned,
    canonical_tap,
    damaged,
    matches,
    read_only_rows,
    skipped_rows,
    usable_rows,
    where_clause,
)
from capd.state import advice, set_busy_timeout, tolerant_text
from capd.text import recall_key

log = logging.getLogger(__name__)

# Per capability and kind. Taps here have 5-30 triggers per capability: 100 lets corrections
# outnumber a capability's own triggers several times over, and bounds what one agent can add.
MAX_PER_CAPABILITY = 100
WRITE_WAIT = 5.0  # seconds a write waits for another process's lock on the file
FILE_NAME = "learned.sqlite3"
class LearnedStore:
    """Learned examples in SQLite; in memory when ``path`` is None or cannot be written."""

    def __init__(self, path: Path | None, limit: int = MAX_PER_CAPABILITY, timeout: float = WRITE_WAIT) -> None:
        """``timeout``: how long a write waits for another process's lock on the file."""
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        self.path = path
        self.limit = limit  # corrections of one kind kept per capability (the latest)
        self.error: str | None = None
        self.persistent = False  # the file is in use (not an in-memory store)
        self.unreadable = False  # the file is there but what it holds cannot be read (damaged, a directory)
        self._closed = False
        self._unreadable = False  # version() failed and said so: quiet until it works again
        self._lock = threading.Lock()
        self._timeout = timeout
        self._wait_ms = int(timeout * 1000)
        # Corrections the file would not take (locked, disk full): used, and stored at the next write
        # or check that succeeds. Keyed like the table; each (tap, capability, kind) keeps its latest ``limit``.
        self._unsaved: dict[tuple[str, str, str], Learned] = {}
        self._clock = 0.0  # the latest ``created`` this store gave (:meth:`_now`)
        self._advice = ""  # what to do about the file that could not be opened
        # Recorded in memory because the file could not be opened at the start: tried again at the stop.
        self._learned_in_memory: dict[tuple[str, str, str], Learned] = {}
        # The file's corrections as last read, by key: kept in memory if the file is damaged in use.
        self._read: dict[tuple[str, str, str], Learned] = {}
        self._skipped: set[int] = set()  # rowids of the file's rows that are no corrections (said once)
        self.skipped = 0  # of a :meth:`read_only` store: the file's rows that are no corrections
        self._conn = self._connect(path)

    @classmethod
    def open(cls, data_dir: Path, limit: int = MAX_PER_CAPABILITY) -> LearnedStore:
        return cls(Path(data_dir) / FILE_NAME, limit)

    @classmethod
    def read_only(cls, path: Path) -> LearnedStore:
        """What ``path`` holds, copied into a store in memory; the file is only read, never written
        (``capd learned list | export``: a zero-length file stays zero-length, a file from an older
        capd keeps its columns). Raises :class:`sqlite3.Error` or :class:`OSError` when it cannot be
        read (damaged, a directory); rows that are no corrections are left out, counted in :attr:`skipped`."""
        if path.is_dir():
            raise IsADirectoryError(f"{path} is a directory")
        entries, skipped = usable_rows(read_only_rows(path))
        store = cls(None)
        store.skipped = len(skipped)
        with store._cursor() as conn:
            conn.executemany("INSERT OR REPLACE INTO learned VALUES (?, ?, ?, ?, ?, ?, ?)", map(astuple, entries))
        return store

    @property
    def unsaved(self) -> int:
        """Corrections in use but not yet in the file (0 when healthy)."""
        with self._lock:
            return len(self._unsaved)

    def _connect(self, path: Path | None) -> sqlite3.Connection:
        if path is not None:
            try:
                conn = self._open_file(path)
                self.persistent = True
                return conn
            except (OSError, sqlite3.Error) as exc:
                self.error = f"cannot store learned examples in {path}: {exc}; keeping them in memory"
                self._advice = advice(path, exc, "learned")
        conn = sqlite3.connect(":memory:", check_same_thread=False)
        conn.execute(SCHEMA)
        if path is not None and self.error is not None:
            self.error += self._copy_readable(path, conn) + f"; {self._advice}"
            log.error("%s", self.error)
        return conn

    def _open_file(self, path: Path) -> sqlite3.Connection:
        """``path`` opened for writing, its table created or brought up to date."""
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(path, check_same_thread=False, timeout=self._timeout)
        conn.text_factory = tolerant_text  # text that is not UTF-8 failed the query: usable_rows skips its row
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute(SCHEMA)
            if "kind" not in {row[1] for row in conn.execute("PRAGMA table_info(learned)")}:
                # a store from before abstains were learned: its entries are triggers
                conn.execute("ALTER TABLE learned ADD COLUMN kind TEXT NOT NULL DEFAULT 'trigger'")
            conn.commit()
        except BaseException:
            conn.close()
            raise
        return conn

    def _store_learned_in_memory(self) -> int:
        """A store kept in memory since the start because its file could not be used: at the stop, try
        the file once more with what was learned meanwhile (a disk full at the start may have room
        now). Returns how many of them are lost: they used to go with the process, and unsaid."""
        with self._lock:
            learned = sorted(self._learned_in_memory.values(), key=lambda e: e.created)
            self._learned_in_memory = {}
        if self.path is None or not learned:
            return 0
        try:
            with closing(self._open_file(self.path)) as conn, conn:
                for entry in learned:
                    self._insert(conn, entry)
        except (OSError, sqlite3.Error) as exc:
            log.debug("%s still cannot be written: %s", self.path, exc)
            return len(learned)
        log.warning("%s can be written now: stored the %d correction(s) learned in memory", self.path, len(learned))
        return 0

    def _copy_readable(self, path: Path, conn: sqlite3.Connection) -> str:
        """What a file that cannot be written still holds (a read-only data directory), copied into
        ``conn`` so routing keeps its corrections; the words to add to the error."""
        if not path.is_file():
            self.unreadable = path.exists()
            return ""
        try:
            entries, skipped = usable_rows(read_only_rows(path))
        except sqlite3.Error as exc:
            self.unreadable = True
            return f" (its contents cannot be read either: {exc})"
        if skipped:
            log.warning("%s", skipped_rows(path, len(skipped)))
        conn.executemany("INSERT OR REPLACE INTO learned VALUES (?, ?, ?, ?, ?, ?, ?)", map(astuple, entries))
        conn.commit()
        return f" (the {len(entries)} it holds are used, read-only)"

    @contextmanager
    def _cursor(self) -> Iterator[sqlite3.Connection]:
        with self._lock, self._conn:
            yield self._conn

    def _spellings(self, conn: sqlite3.Connection, tap: Path | str | None) -> list[str] | None:
        """Every spelling of ``tap`` the file holds (None: any tap). Corrections are stored under the
        tap's real path; a file from before that may hold it as a daemon was given it (``a/../b``, a
        link), and those rows belong to the same tap."""
        if tap is None:
            return None
        wanted = canonical_tap(tap)
        stored = [row[0] for row in conn.execute("SELECT DISTINCT tap FROM learned")]
        return [wanted, *(t for t in stored if t != wanted and canonical_tap(t) == wanted)]

    def record(self, tap: Path | str, capability: str, message: str, previous: str | None = None,
               session: str | None = None, kind: str = "trigger") -> bool:
        """Store one correction (replacing one of the other kind), dropping the capability's oldest
        of that kind beyond :attr:`limit`; False when it was already known (it is then dated anew,
        so that it counts as the latest). When the file will not
        take it, it is kept in memory (used all the same, listed in :attr:`error`) until a later
        write or :meth:`version` check stores it."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
        entry = Learned(canonical_tap(tap), capability, message, previous, session, self._now(), kind)
        try:
            with self._cursor() as conn:
                stored = self._insert(conn, entry)
        except sqlite3.Error as exc:
            if not self.persistent:
                log.error("cannot record a learned example for %s: %s", capability, exc)
                return False
            return self._hold(entry, exc)
        if not self.persistent and self.path is not None:
            with self._lock:
                key = (entry.tap, entry.capability, entry.message)
                if stored or key in self._learned_in_memory:  # new, or taught again: dated anew
                    self._learned_in_memory[key] = entry
        self._store_unsaved()
        return stored

    def _now(self) -> float:
        """``time.time()``, never earlier than this store's last correction: "latest" is by ``created``."""
        with self._lock:
            self._clock = max(time.time(), math.nextafter(self._clock, math.inf))
            return self._clock

    def _insert(self, conn: sqlite3.Connection, entry: Learned) -> bool:
        key = (entry.tap, entry.capability, entry.kind)
        latest = conn.execute("SELECT MAX(created) FROM learned WHERE tap = ? AND capability = ? AND kind = ? "
                              "AND typeof(created) IN ('integer', 'real')", key).fetchone()[0]  # not a damaged row
        if latest is not None and latest >= entry.created:
            # The clock went back (or another process's runs ahead): a correction dated before the ones
            # kept was the oldest, and dropped at once by the limit below, though it is the newest.
            entry = replace(entry, created=math.nextafter(float(latest), math.inf))
        known = conn.execute("SELECT kind FROM learned WHERE tap = ? AND capability = ? AND message = ?",
                             (entry.tap, entry.capability, entry.message)).fetchone()
        # Taught again, it becomes the latest of its kind: the limit below drops the corrections
        # agents stopped making, not the ones they keep making.
        conn.execute(
            "INSERT INTO learned (tap, capability, message, previous, session, created, kind) "
            "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (tap, capability, message) DO UPDATE SET "
            "kind = excluded.kind, previous = excluded.previous, session = excluded.session, "
            "created = excluded.created",
            (entry.tap, entry.capability, entry.message, entry.previous, entry.session, entry.created, entry.kind))
        if known is not None and known[0] == entry.kind:
            return False  # routing does not change
        dropped = conn.execute(
            "DELETE FROM learned WHERE tap = ? AND capability = ? AND kind = ? AND rowid NOT IN ("
            "SELECT rowid FROM learned WHERE tap = ? AND capability = ? AND kind = ? "
            "ORDER BY created DESC, rowid DESC LIMIT ?)", (*key, *key, self.limit)).rowcount
        if dropped:
            log.info("learned: %s keeps its latest %d %s corrections (dropped the oldest %d)",
                     entry.capability, self.limit, entry.kind, dropped)
        return True

    def _hold(self, entry: Learned, exc: sqlite3.Error) -> bool:
        """Keep ``entry`` in memory because the file would not take it; False when already known."""
        key = (entry.tap, entry.capability, entry.message)
        with self._lock:
            held = self._unsaved.get(key)
            if held is not None and held.kind == entry.kind:
                self._unsaved[key] = replace(held, created=entry.created)  # the latest, as in the file
                return False
            if held is None:
                with contextlib.suppress(sqlite3.Error):  # reading usually still works: the file may know it
                    row = self._conn.execute("SELECT kind FROM learned WHERE tap = ? AND capability = ? AND "
                                             "message = ?", key).fetchone()
                    if row is not None and row[0] == entry.kind:
                        return False
            self._unsaved[key] = entry
            group = sorted((e for e in self._unsaved.values() if (e.tap, e.capability, e.kind)
                            == (entry.tap, entry.capability, entry.kind)), key=lambda e: e.created)
            for old in group[:-self.limit]:
                del self._unsaved[(old.tap, old.capability, old.message)]
            first = self.error is None
            self.error = (f"{self.path}: cannot store learned examples: {exc}; {len(self._unsaved)} new "
                          "correction(s) are used from memory until it can")  # health shows it without the path
            if first:  # while it fails, writes and retries do not wait for a lock (nor block this store meanwhile)
                set_busy_timeout(self._conn, 0)
        if first:
            log.warning("%s", self.error)
        return True

    def _store_unsaved(self) -> None:
        """Write the corrections held in memory, if any, now that the file may take them."""
        with self._lock:
            if not self._unsaved or self._closed:
                return
            try:
                with self._conn:
                    for entry in sorted(self._unsaved.values(), key=lambda e: e.created):
                        self._insert(self._conn, entry)
            except sqlite3.Error:
                return  # still failing: kept, and said so in :attr:`error` already
            count, self._unsaved, self.error = len(self._unsaved), {}, None
            set_busy_timeout(self._conn, self._wait_ms)
        log.warning("%s takes learned examples again: stored the %d kept in memory", self.path, count)

    def entries(self, tap: Path | str | None = None, capability: str | None = None,
                kind: str | None = None) -> list[Learned]:
        """The matching corrections, those held in memory included (over the file's of the same message).
        Rows that are no corrections are skipped (logged once); a file damaged meanwhile leaves the
        store in memory (:meth:`_lose_file`)."""
        with self._lock:
            unsaved = list(self._unsaved.values())
        try:
            found = self._select(tap, capability, None if unsaved else kind)
        except sqlite3.DatabaseError as exc:
            if not (self.persistent and damaged(exc)):
                raise
            self._lose_file(exc)
            return self.entries(tap, capability, kind)
        if not unsaved:
            return found
        merged = {(e.tap, e.capability, e.message): e for e in found}
        merged.update({(e.tap, e.capability, e.message): e for e in unsaved if matches(e, tap, capability)})
        # the query's order: kind DESC puts triggers before abstains
        return sorted((e for e in merged.values() if matches(e, kind=kind)),
                      key=lambda e: (e.tap, e.capability, KINDS.index(e.kind), e.created, e.message))

    def _select(self, tap: Path | str | None, capability: str | None, kind: str | None) -> list[Learned]:
        """The file's matching rows that are corrections, remembered (:attr:`_read`) while it is used."""
        with self._cursor() as conn:
            spellings = self._spellings(conn, tap)
            where, args = where_clause(spellings, capability, kind)
            rows = conn.execute(f"SELECT rowid, tap, capability, message, previous, session, created, kind FROM "
                                f"learned{where} ORDER BY tap, capability, kind DESC, created, message",
                                args).fetchall()
        found, skipped = usable_rows(row[1:] for row in rows)
        with self._lock:
            new = {rows[i][0] for i in skipped} - self._skipped
            self._skipped |= new
        if new:
            log.warning("%s", skipped_rows(self.path or Path(":memory:"), len(new)))
        if self.persistent:
            with self._lock:  # what the query covered, as the file has it now
                for key in [k for k, e in self._read.items() if (spellings is None or e.tap in spellings)
                            and matches(e, capability=capability, kind=kind)]:
                    del self._read[key]
                self._read.update(((e.tap, e.capability, e.message), e) for e in found)
        return found

    def _lose_file(self, exc: sqlite3.Error) -> None:
        """The file was damaged while in use: carry on in memory, as when it cannot be opened at the
        start, with the corrections read from it so far and those held back (all stored in the file
        at the stop if it can be used by then)."""
        assert self.path is not None
        with self._lock:
            if not self.persistent:
                return  # another thread found it first
            kept = {**self._read, **self._unsaved}
            memory = sqlite3.connect(":memory:", check_same_thread=False)
            with memory:
                memory.execute(SCHEMA)
                memory.executemany("INSERT INTO learned VALUES (?, ?, ?, ?, ?, ?, ?)", map(astuple, kept.values()))
            old, self._conn = self._conn, memory
            self._learned_in_memory, self._unsaved = kept, {}
            self.persistent, self.unreadable = False, True
            self.error = (f"cannot store learned examples in {self.path}: {exc}; keeping them in memory (the "
                          f"{len(kept)} read from it before are used); {advice(self.path, exc, 'learned')}")
        old.close()
        log.error("%s", self.error)

    def forget(self, tap: Path | str | None = None, capability: str | None = None,
               message: str | None = None, kind: str | None = None) -> int:
        """Delete matching entries (all of them when nothing is given); returns how many. ``message``
        matches as routing knows a message again (:func:`~capd.text.recall_key`: case and runs of
        white space aside), so the text as the user typed it finds what was stored."""
        wanted = None if message is None else recall_key(message)
        with self._cursor() as conn:  # (no RETURNING: older SQLite builds lack it)
            where, args = where_clause(self._spellings(conn, tap), capability, kind)
            deleted = {row for row in conn.execute(f"SELECT tap, capability, message FROM learned{where}", args)
                       if wanted is None or recall_key(row[2]) == wanted}
            conn.executemany("DELETE FROM learned WHERE tap = ? AND capability = ? AND message = ?", sorted(deleted))
        with self._lock:
            held = [key for key, e in self._unsaved.items() if matches(e, tap, capability, message, kind)]
            for key in held:
                del self._unsaved[key]
            for key in [k for k, e in self._learned_in_memory.items() if matches(e, tap, capability, message, kind)]:
                del self._learned_in_memory[key]
            if held and not self._unsaved:
                self.error = None
                set_busy_timeout(self._conn, self._wait_ms)
        return len(deleted | set(held))

    def for_tap(self, tap: Path | str, kind: str = "trigger") -> dict[str, tuple[str, ...]]:
        """capability → learned messages of ``kind``, for one tap: each capability's latest
        :attr:`limit`, oldest first. The store keeps no more than that per capability, except what
        a daemon with a larger ``learn_max`` (or before it was lowered) left in the file."""
        latest: dict[str, dict[str, float]] = {}
        for entry in self.entries(tap=tap, kind=kind):
            when = latest.setdefault(entry.capability, {})
            when[entry.message] = max(entry.created, when.get(entry.message, entry.created))
        return {name: tuple(sorted(when, key=lambda m: (when[m], m))[-self.limit:]) for name, when in latest.items()}

    def for_catalog(self, catalog: Catalog, kind: str = "trigger") -> dict[str, tuple[str, ...]]:
        """capability → learned messages of ``kind``, for the capabilities ``catalog`` serves from
        the tap they were learned for (a capability now provided by another tap gets none)."""
        out: dict[str, tuple[str, ...]] = {}
        for tap in catalog.taps:
            for name, messages in self.for_tap(tap, kind).items():
                capability = catalog.get(name)
                if capability is not None and capability.tap == tap:
                    out[name] = messages
        return out

    def recalls(self, catalog: Catalog, triggers: Mapping[str, Sequence[str]],
                abstains: Mapping[str, Sequence[str]]) -> dict[str, str]:
        """message key (:func:`~capd.text.recall_key`) → the capability a message goes to when seen
        again, whatever the scores: the learned ``triggers`` in effect (:meth:`for_catalog`) that
        say routing got that very message wrong. It abstained, or the agent also refused what it
        activated (one of the learned ``abstains`` in effect). Enabling X after routing activated Y,
        and keeping Y, may only add X's tools, so it stays an example among X's others. A message
        corrected to two capabilities (two agents disagreeing) recalls neither. Only the triggers'
        ``previous`` is read here; the rest comes with the arguments."""
        in_effect = {(name, recall_key(m)) for name, messages in triggers.items() for m in messages}
        refused = {(name, recall_key(m)) for name, messages in abstains.items() for m in messages}
        owners: dict[str, set[str]] = {}
        for tap in catalog.taps:
            for entry in self.entries(tap=tap, kind="trigger"):
                key = recall_key(entry.message)
                if (entry.capability, key) in in_effect and (
                        entry.previous == "abstain" or (entry.previous, key) in refused):
                    owners.setdefault(key, set()).add(entry.capability)
        return {key: next(iter(names)) for key, names in owners.items() if len(names) == 1}

    def version(self) -> int | None:
        """The file's ``PRAGMA data_version``: it changes when another connection commits to it
        (``capd learned forget``, another daemon on this data directory), never for this store's
        own writes. A few microseconds. None when the store is in memory (no other writer), closed,
        or the file cannot be read (logged once, until it can be again)."""
        if not self.persistent:
            return None
        self._store_unsaved()  # the daemon checks every few seconds: a held-back correction goes in then
        with self._lock:
            if self._closed:
                return None
            try:
                version = int(self._conn.execute("PRAGMA data_version").fetchone()[0])
            except sqlite3.Error as exc:
                if not self._unreadable:
                    log.error("cannot check %s for learned examples changed by another process: %s; "
                              "routing keeps the ones it has", self.path, exc)
                self._unreadable = True
                return None
            if self._unreadable:
                log.warning("%s can be checked again for learned examples changed by another process", self.path)
                self._unreadable = False
            return version

    def close(self) -> int:
        """Store what is held in memory (one last try; for a store in memory since the start because
        the file could not be used, what it learned), then close. Returns how many corrections could
        not be stored and are lost with this process (0 normally)."""
        with self._lock:
            if self._unsaved and not self._closed:
                set_busy_timeout(self._conn, self._wait_ms)  # the last try waits for a lock as a healthy write does
        self._store_unsaved()
        with self._lock:
            if self._closed:
                return 0  # counted at the first close
            self._closed = True
            self._conn.close()
            lost = len(self._unsaved)
        return lost + self._store_learned_in_memory()


