"""The session registry: which capabilities each agent session has active, and the plans that change that.

Pure logic over a :class:`~capd.state.SessionStore`; the catalog is read through a callable
so that a reload swaps it between operations. Every change returns a :class:`Plan` in the
shape DESIGN.md fixes ("Sessions, LRU and refcounted teardown").

Decisions where DESIGN.md is silent:

- **Pinned** capabilities (settings ``pinned``, those present in the catalog) are active from
  a session's creation with origin ``pinned``. They do not count toward ``max_active`` (so
  pinning never shrinks the LRU), are never evicted, and cannot be disabled
  (:class:`~capd.errors.PinnedCapability`). A pinned name the catalog lacks is ignored
  until a reload adds it; the next plan then starts it.
- A session is **created on first use** by any plan-returning call (activate, deactivate,
  reconcile): its first plan carries the start items of the pinned capabilities.
- **Re-activating** an active capability changes nothing but ``last_used`` (the plan is
  empty apart from ``active``); ``manual`` upgrades an ``auto`` entry (the user asked for it
  explicitly; both stay evictable), and an origin is never downgraded. A route whose winner
  is already active (``already_active``) re-activates it: the agent is about to use it, so
  it must not be the next one evicted.
- **Start**, **teardown** and **snapshots** (what a plan asks of the agent, and how an edited
  capability is refreshed): :mod:`capd.plans`.
- **Settings that changed across a restart** are applied by a session's next plan, as an edited
  capability is: a formerly pinned capability becomes ``manual``, and the LRU is trimmed to
  ``max_active``.
- **Idle** (for ``ttl``): every call on a session except the reads (get, active_names,
  sessions) touches it, including a failed tool result. A session idle past ``ttl`` has ended,
  whether or not the periodic sweep (:meth:`SessionRegistry.expire`, every 60 s in the
  daemon) has seen it yet: reads and tool results find no session, and a plan-returning
  call starts it afresh, its plan tearing down what it had (pinned capabilities stay);
  ``drop`` still returns that teardown. The ended session's record is kept for
  :data:`ENDED_KEPT` past its ``ttl`` so that this holds after the sweep too (an agent that
  comes back to the id still runs the servers it was told to start); only then is it deleted,
  and the id would start a session with nothing to tear down.
- **Persistence failures** (:class:`~capd.errors.StateError` from the store) are logged, the
  registry keeps serving from the store's in-memory copy, and the next write retries.
- ``{{ENV:…}}`` placeholders in server specs are passed through verbatim, never resolved.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from capd.catalog import Catalog, tool_allowed
from capd.errors import InvalidSessionId, PinnedCapability, StateError, UnknownCapability, UnknownSession
from capd.plans import Plan, SessionChange, StartItem, in_session_order
from capd.state import ActiveCapability, Origin, SessionRecord, SessionStore

log = logging.getLogger(__name__)

# 1-128 of these characters, not all dots: "." and ".." name no session, only a path step.
SESSION_ID = re.compile(r"[A-Za-z0-9._:-]*[A-Za-z0-9_:-][A-Za-z0-9._:-]*")
ActivationOrigin = Literal["auto", "manual"]
# How long an ended session's record outlives its ttl (see the module docstring): long enough for an
# agent left open over a holiday, short enough that the file does not keep every id ever used.
ENDED_KEPT = 14 * 86400.0


def check_session_id(session: str) -> str:
    if not isinstance(session, str) or len(session) > 128 or not SESSION_ID.fullmatch(session):
        raise InvalidSessionId(str(session))
    return session


@dataclass(frozen=True)
class SessionState:
    """A read-only view of one session; ``active`` in stable order (activation order, then name)."""

    session: str
    last_seen: float
    active: tuple[ActiveCapability, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.active)

    def as_dict(self) -> dict[str, Any]:
        return {"session": self.session, "last_seen": self.last_seen, "active": [a.as_dict() for a in self.active]}


@dataclass
class _LockEntry:
    lock: threading.RLock = field(default_factory=threading.RLock)
    users: int = 0


class SessionRegistry:
    """Active capabilities per session, LRU eviction, refcounted teardown; durable through the store."""

    def __init__(self, store: SessionStore, catalog: Callable[[], Catalog], max_active: int = 4,
                 pinned: Sequence[str] = (), clock: Callable[[], float] = time.time, ttl: float = 86400) -> None:
        if max_active < 1:
            raise ValueError(f"max_active must be at least 1, got {max_active}")
        if ttl <= 0:
            raise ValueError(f"ttl must be positive, got {ttl}")
        self.store = store
        self.max_active = max_active
        self.pinned = tuple(dict.fromkeys(pinned))
        self.ttl = float(ttl)
        self._catalog = catalog
        self._clock = clock
        self._latest = 0.0  # the latest time _now gave
        self._latest_guard = threading.Lock()
        self._locks: dict[str, _LockEntry] = {}
        self._locks_guard = threading.Lock()
        self._degraded = False
        self._drop_invalid_ids()
        # Sessions whose end has been told (on_end), their records still kept. Those found ended at
        # the start ended under an earlier process: nothing here remembers their turns.
        now = self._now()
        self._ended: set[str] = {s for s in store.ids() if (r := store.get(s)) is not None and self._idle(r, now)}
        # Called as on_manual(session, name) after a manual activation that made name active, and as
        # on_disable(session, name) after a disable that removed an active capability (capd.learned listens).
        self.on_manual: Callable[[str, str], None] | None = None
        self.on_disable: Callable[[str, str], None] | None = None
        # Called as on_end(session) when a session ends: dropped, swept after ttl, or found idle past
        # ttl when next used (a session id used again then starts a new conversation).
        self.on_end: Callable[[str], None] | None = None

    @contextmanager
    def locked(self, session: str) -> Iterator[None]:
        """Hold one session's (re-entrant) lock, e.g. to make read-decide-activate atomic."""
        check_session_id(session)
        with self._locks_guard:
            entry = self._locks.setdefault(session, _LockEntry())
            entry.users += 1
        try:
            with entry.lock:
                yield
        finally:
            with self._locks_guard:
                entry.users -= 1
                if entry.users == 0:
                    del self._locks[session]

    # -- plan-returning operations ---------------------------------------------------------------
    def activate(self, session: str, name: str, origin: ActivationOrigin = "manual") -> Plan:
        """Make ``name`` active, evicting at most one LRU capability. Creates the session on first use."""
        if origin not in ("auto", "manual"):
            raise ValueError(f"origin must be 'auto' or 'manual', got {origin!r}")
        with self.locked(session):
            catalog = self._catalog()
            capability = catalog.get(name)
            if capability is None:
                raise UnknownCapability(name)
            now = self._now()
            change = self._begin(session, catalog, now)
            entry = change.active.get(name)
            if entry is not None:
                kept: Origin = "manual" if origin == "manual" and entry.origin == "auto" else entry.origin
                change.active[name] = replace(entry, last_used=now, origin=kept)
            else:
                if len(change.unpinned()) >= self.max_active:
                    self._evict_one(change)
                change.add(capability, origin, now)
            plan = self._commit(change, now)
        if origin == "manual" and entry is None:  # enabling what is active already changes (and teaches) nothing
            self._notify(self.on_manual, session, name)
        return plan

    def deactivate(self, session: str, name: str) -> Plan:
        """Remove ``name`` (idempotent). Pinned → PinnedCapability; never active and not in the catalog → Unknown."""
        with self.locked(session):
            catalog = self._catalog()
            if name in self.pinned and name in catalog:  # a pinned name no tap provides is ignored, so unknown
                raise PinnedCapability(name)
            if name not in catalog and name not in self.active_names(session):
                raise UnknownCapability(name)
            now = self._now()
            change = self._begin(session, catalog, now)
            removed = name in change.active
            if removed:
                change.remove(name)
            plan = self._commit(change, now)
        if removed:
            self._notify(self.on_disable, session, name)
        return plan

    @staticmethod
    def _notify(listener: Callable[..., None] | None, session: str, *args: str) -> None:
        if listener is None:
            return
        try:
            listener(session, *args)
        except Exception:  # learning is best effort; the change to the session itself succeeded
            log.exception("listener failed for session %s %s", session, " ".join(args))

    def reconcile(self, session: str) -> Plan:
        """Apply catalog and settings changes: tear down deleted capabilities, start newly present pinned ones."""
        with self.locked(session):
            catalog = self._catalog()
            now = self._now()
            return self._commit(self._begin(session, catalog, now), now)

    def drop(self, session: str) -> Plan:
        """Forget a session; the plan tears down everything it had (an ended session's too, while
        its record is kept). UnknownSession if absent."""
        with self.locked(session):
            record = self.store.get(check_session_id(session))
            if record is None:
                raise UnknownSession(session)
            change = SessionChange(record)
            for entry in record.active:
                change.remove(entry.name)
            self._persist(self.store.delete, session)
            self._ended.discard(session)
            self._notify(self.on_end, session)
            return change.plan()

    # -- other operations --------------------------------------------------------------------------
    def tool_result(self, session: str, server: str, tool: str, ok: bool) -> list[str]:
        """Report a tool call. On success bump every active capability granting it; returns their names."""
        with self.locked(session):
            record = self._require(session)
            now = self._now()
            bumped = [a.name for a in record.active if ok and any(
                s.name == server and tool_allowed(s.tools, tool) for s in a.servers)]
            active = tuple(replace(a, last_used=now) if a.name in bumped else a for a in record.active)
            self._persist(self.store.put, replace(record, last_seen=now, active=active))
            return bumped

    def get(self, session: str) -> SessionState:
        record = self._require(session)
        return SessionState(record.session, record.last_seen, in_session_order(record.active))

    def resume(self, session: str) -> Plan:
        """The plan that brings an agent running nothing to the session as capd holds it: every
        server of every active capability to start, with its spec and tool grant (as the plans that
        activated them said), nothing to tear down. For an agent that lost a plan: a route whose
        answer never arrived (a timeout, a dropped connection) is committed all the same, and the
        next route says ``already_active`` with nothing to start. A read: it changes nothing.
        UnknownSession if absent."""
        state = self.get(session)
        start = tuple(StartItem(a.name, s.spec, s.tools) for a in state.active for s in a.servers)
        return Plan(start, (), state.names)

    def active_names(self, session: str) -> tuple[str, ...]:
        """Active capability names in stable order. A session not started yet (or ended) has the
        pinned ones the catalog provides: they are active in every session from its start, so a
        listing for it marked them inactive until its first plan."""
        record = self._record(session)
        if record is None:
            catalog = self._catalog()
            return tuple(name for name in self.pinned if name in catalog)
        return tuple(a.name for a in in_session_order(record.active))

    def sessions(self) -> tuple[str, ...]:
        """The live sessions' ids (not those idle past ``ttl``, whose records may still be kept)."""
        return tuple(session for session in self.store.ids() if self._record(session) is not None)

    def expire(self) -> list[str]:
        """End the sessions idle for longer than ``ttl`` and return their ids (each session once);
        delete the records of those idle for :data:`ENDED_KEPT` longer than that."""
        expired: list[str] = []
        for session in self.store.ids():
            with self.locked(session):
                record = self.store.get(session)
                now = self._now()
                if record is None or not self._idle(record, now):
                    continue
                if session not in self._ended:
                    self._notify(self.on_end, session)
                    expired.append(session)
                if now - record.last_seen > self.ttl + ENDED_KEPT:
                    self._persist(self.store.delete, session)
                    self._ended.discard(session)
                else:
                    self._ended.add(session)
        if expired:
            log.info("%d session(s) idle past the ttl ended: %s", len(expired), ", ".join(expired))
        return expired

    # -- internals ---------------------------------------------------------------------------------
    def _now(self) -> float:
        """The clock, never going back while this registry runs: eviction picks the capability used
        least recently by these times, and after the system clock was set back the one just used
        looked the oldest (idle times past a jump back last longer by the jump, never shorter)."""
        with self._latest_guard:
            now = self._clock()
            # behind: just after the latest, so that what is used after a jump back is the newest
            self._latest = now if now >= self._latest else math.nextafter(self._latest, math.inf)
            return self._latest

    def _drop_invalid_ids(self) -> None:
        """Drop stored sessions whose id is no longer valid (``.`` and ``..``, which capd accepted
        before ids had to hold a character other than a dot): no request can name them, and every
        walk over the store (the idle sweep, ``/metrics``'s session count) failed on them."""
        for session in self.store.ids():
            try:
                check_session_id(session)
            except InvalidSessionId:
                log.warning("dropped stored session %r: not a valid session id (any more)", session)
                self._persist(self.store.delete, session)

    def _record(self, session: str) -> SessionRecord | None:
        """The session's record; None if there is none or it has been idle past ``ttl`` (kept for
        the next plan, which tears its capabilities down: see the module docstring)."""
        record = self.store.get(check_session_id(session))
        return None if record is None or self._idle(record, self._now()) else record

    def _idle(self, record: SessionRecord, now: float) -> bool:
        """Idle for longer than ``ttl``: ended, whether or not the sweep has seen it yet."""
        return now - record.last_seen > self.ttl

    def _require(self, session: str) -> SessionRecord:
        record = self._record(session)
        if record is None:
            raise UnknownSession(session)
        return record

    def _begin(self, session: str, catalog: Catalog, now: float) -> SessionChange:
        record = self.store.get(session)
        expired = record is not None and self._idle(record, now)
        if expired:
            log.info("session %s was idle past the ttl: its capabilities are torn down", session)
            if session not in self._ended:  # the sweep has not said so yet
                self._notify(self.on_end, session)
            self._ended.discard(session)
        if record is None:
            log.debug("session %s created", session)
            record = SessionRecord(session, now, 0)
        change = SessionChange(record)
        pinned = set(self.pinned)
        for entry in in_session_order(change.active.values()):
            capability = catalog.get(entry.name)
            if capability is None or (expired and entry.name not in pinned):
                change.remove(entry.name)
                continue
            if (entry.origin == "pinned") != (entry.name in pinned):
                change.active[entry.name] = replace(entry, origin="pinned" if entry.name in pinned else "manual")
            change.refresh(capability)
        for name in self.pinned:
            capability = catalog.get(name)
            if capability is not None and name not in change.active:
                change.add(capability, "pinned", now)
        while len(change.unpinned()) > self.max_active:
            self._evict_one(change)
        return change

    @staticmethod
    def _evict_one(change: SessionChange) -> None:
        victim = min(change.unpinned(), key=lambda a: (a.last_used, a.seq))
        change.remove(victim.name)

    def _commit(self, change: SessionChange, now: float) -> Plan:
        plan = change.plan()
        self._persist(self.store.put, change.record(now))
        if plan.changed:
            log.debug("session %s: +%s -%s", change.session, list(plan.activated), list(plan.removed))
        return plan

    def _persist(self, write: Callable[[Any], None], value: Any) -> None:
        try:
            write(value)
        except StateError as exc:
            if not self._degraded:
                log.warning("session state is kept in memory only until the store is writable again: %s", exc)
            self._degraded = True
        else:
            if self._degraded:
                log.warning("session state is being stored again (%s)", self.store.path)
            self._degraded = False
