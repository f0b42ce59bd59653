"""What an agent's manual enables and disables teach (:mod:`capd.learned` stores what they do).

:class:`Corrections` keeps each session's last :data:`WINDOW` routed turns and says which one an
enable or a disable corrects; :class:`Learner` records that correction in the learned store and
has the service route with it shortly after (:data:`LEARN_DELAY`; corrections come in bursts).

Decisions where the issue is silent: only the most recent qualifying turn is taken (a
manual enable corrects one message); a turn is used once, except that a refused turn can
still be corrected by an enable (*message → X* after Y was refused; enabling Y itself again
records *message → Y*, so the agent's last word wins); turns that
were ``skipped`` (too short) are passed over; a turn that routed to X itself means there is
nothing to learn; the recent turns are kept in memory, so a restart forgets them (not the
learned entries).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from capd.catalog import Catalog
from capd.errors import Stopping
from capd.learned import LearnedStore

log = logging.getLogger(__name__)

WINDOW = 3  # routed turns within which a manual enable counts as a correction
MAX_SESSIONS = 10_000  # sessions whose recent turns are remembered (least recently routed forgotten first)
LEARN_DELAY = 1.0  # seconds between a recorded correction and routing with it (corrections come in bursts)


@dataclass(frozen=True)
class Turn:
    """One routed message of a session, as routing decided it, and what the agent did about it since."""

    message: str
    decision: str
    capability: str | None
    refused: bool = False  # the agent disabled what it activated (a learned abstain)
    corrected: bool = False  # an enable has learned from it (a learned trigger)


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

    def _latest(self, session: str) -> tuple[deque[Turn], int] | None:
        """The session's turns and the index of its latest routed (not skipped) one."""
        turns = self._turns.get(session)
        for index in range(len(turns or ()) - 1, -1, -1):
            assert turns is not None
            if turns[index].decision != "skipped":
                return turns, index
        return None

    def enabled(self, session: str, name: str) -> Turn | None:
        """The turn that enabling ``name`` corrects, or None: the session's latest routed turn,
        once. It stays, marked corrected, so that enabling again (or after a disable) does not
        reach back to older turns: toggling a capability taught it every recent message.

        The capability routing activated is the exception: after the agent refused it, each
        enable and disable of it is the agent's last word (a trigger, then an abstain again, …)."""

        def correct(turn: Turn) -> Turn | None:
            if turn.capability == name and turn.decision in ("activate", "already_active"):
                # routing already chose it: nothing to learn, unless the agent refused it since
                return replace(turn, refused=False, corrected=True) if turn.refused else None
            return None if turn.corrected else replace(turn, corrected=True)  # once per turn

        return self._mark(session, correct)

    def disabled(self, session: str, name: str) -> Turn | None:
        """The turn that disabling ``name`` refuses, or None: the session's latest routed turn,
        when it activated ``name`` (whether or not an enable of another capability has corrected
        it: the two corrections say the same, in either order). It stays, marked refused, for an
        enable to correct."""

        def refuse(turn: Turn) -> Turn | None:
            if turn.decision != "activate" or turn.capability != name or turn.refused:
                return None
            return replace(turn, refused=True)

        return self._mark(session, refuse)

    def _mark(self, session: str, change: Callable[[Turn], Turn | None]) -> Turn | None:
        """The session's latest routed turn, as it was, when ``change`` marks it (returns it marked:
        it stays so, in place), else None (no such turn, or ``change`` returns None)."""
        with self._lock:
            found = self._latest(session)
            if found is None:
                return None
            turns, index = found
            turn = turns[index]
            marked = change(turn)
            if marked is None:
                return None
            turns[index] = marked
            return turn

    def forget_session(self, session: str) -> None:
        """Drop a session's turns when it ends: an enable in a later session with the same id
        corrects nothing routed before it."""
        with self._lock:
            self._turns.pop(session, None)


class Learner:
    """A service's learning from corrections: the sessions' recent :attr:`turns`, a correction
    recorded in the store (``store()``: None when the service does not learn) and routed with by
    ``apply`` (the service's publish), one pass at a time."""

    def __init__(self, catalog: Callable[[], Catalog], store: Callable[[], LearnedStore | None],
                 apply: Callable[[], object]) -> None:
        self.turns = Corrections()
        self._catalog = catalog
        self._store = store
        self._apply = apply
        self._timer: threading.Timer | None = None  # the learning pass waiting or under way
        self._guard = threading.Lock()  # for these fields: never held while routing or publishing
        self._wanted = 0  # corrections recorded so far (a pass routes with all it finds)
        self._closed = False

    def close(self) -> None:
        """No pass from here on; one waiting is cancelled (one under way ends at its next check)."""
        with self._guard:
            self._closed = True
            if self._timer is not None:
                self._timer.cancel()

    def manual_enable(self, session: str, name: str) -> None:
        """A manual enable right after a miss: record (message -> name) and apply it soon."""
        capability, store = self._catalog().get(name), self._store()
        if store is None or capability is None or not capability.triggers:
            return  # learns nothing, so it leaves the turn for an enable that does (manual-only capabilities)
        turn = self.turns.enabled(session, name)
        if turn is None:
            return
        previous = "abstain" if turn.decision == "abstain" else turn.capability
        if store.record(capability.tap, name, turn.message, previous, session):
            log.info("learned: %r -> %s (routing said %s)", turn.message[:80], name, previous)
            self._schedule()

    def manual_disable(self, session: str, name: str) -> None:
        """A manual disable right after routing activated ``name``: record (message -/-> name)."""
        capability, store = self._catalog().get(name), self._store()
        if store is None or capability is None or not capability.triggers:
            return
        turn = self.turns.disabled(session, name)
        if turn is None:
            return
        if store.record(capability.tap, name, turn.message, name, session, kind="abstain"):
            log.info("learned: %r -/-> %s (disabled right after routing activated it)", turn.message[:80], name)
            self._schedule()

    def _schedule(self) -> None:
        """Route with a correction just recorded, after LEARN_DELAY (corrections come in bursts).

        One learning pass at a time; one waiting or under way takes this correction too: it checks,
        before it ends, whether any came in while it published (a publish can refit for seconds),
        and goes again if so. Only ``_guard`` is taken here, never the service's lock, so an
        enable does not wait for a publish either."""
        with self._guard:
            self._wanted += 1
            if self._timer is not None or self._closed:
                return
            self._timer = threading.Timer(LEARN_DELAY, self._pass)
            self._timer.daemon = True
            self._timer.start()

    def _pass(self) -> None:
        while True:
            with self._guard:
                seen = self._wanted
            try:
                self._apply()
            except Stopping:  # close() cut the pass short
                seen = -1
            except Exception:  # logged; the next correction schedules another pass
                log.exception("could not route with the learned corrections")
                seen = -1
            with self._guard:
                if self._wanted == seen or seen < 0 or self._closed:
                    self._timer = None
                    return
