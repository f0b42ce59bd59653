"""Routing a message for a session: the request path of :meth:`capd.service.Service.route`.

The router decides on the served snapshot (:class:`capd.router.Router`); here that decision meets
the session: the session's active and pinned capabilities are what ``already_active`` is judged
against, an activation goes into the session registry and comes back as its plan (servers to start
and tear down), and the turn is recorded for learning from corrections (:mod:`capd.corrections`).
Each route is timed and counted in the service's metrics. A session is locked from the decision to
its plan, so concurrent routes of one session take turns; a route whose client has gone by then is
dropped (:class:`ClientGone`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from capd.encoder import TokenVectors, Vectors
from capd.errors import FAILED_START, UnknownCapability
from capd.index import SMALL_ROWS
from capd.plans import Plan
from capd.router import Decision
from capd.text import clean_message

if TYPE_CHECKING:  # the service builds one of these for itself
    from capd.service import Service, Snapshot

log = logging.getLogger(__name__)

OFFLOAD_TRIGGERS = SMALL_ROWS  # above this many examples, aroute scores in a worker thread


@dataclass(frozen=True)
class RouteResult:
    decision: Decision
    plan: Plan | None = None
    latency_ms: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**self.decision.as_dict(), "plan": self.plan.as_dict() if self.plan else None}


class ClientGone(Exception):
    """The client of a route disconnected before its session changed: the route is dropped, the
    session left as it was (a plan committed but never received is a server the agent never started)."""


class SessionRouting:
    """Routes messages for ``service`` (its served snapshot, session registry, learner and metrics)."""

    def __init__(self, service: Service) -> None:
        self._service = service

    def route(self, message: str, session: str | None = None) -> RouteResult:
        """Route one message, blocking while the model encodes it (CLI, tests). See :meth:`aroute`."""
        started = time.perf_counter()
        prepared = self._prepare(message)
        if isinstance(prepared, RouteResult):
            return self._routed(prepared, session, started)
        snapshot, text = prepared
        if text is None:
            return self._routed(self._too_short(snapshot, session), session, started)
        vector, tokens = snapshot.router.embed(text)
        return self._routed(self._decide(snapshot, text, vector, session, tokens), session, started)

    async def aroute(self, message: str, session: str | None = None,
                     gone: threading.Event | None = None) -> RouteResult:
        """:meth:`route` for the event loop (``POST /v1/route``): the same result, metrics and
        session semantics, but it awaits the micro-batcher instead of holding a thread meanwhile.
        ``gone`` is set when the caller stopped waiting (the client disconnected): the session is
        then left as it was (:class:`ClientGone`), since the plan could never reach the agent."""
        started = time.perf_counter()
        prepared = self._prepare(message)
        if isinstance(prepared, RouteResult):
            return self._routed(prepared, session, started)
        snapshot, text = prepared
        if text is None:  # with a session, its plan is a store write: off the event loop, as below
            result = (self._too_short(snapshot, session) if session is None
                      else await asyncio.to_thread(self._too_short, snapshot, session))
            return self._routed(result, session, started)
        vector, tokens = await snapshot.router.aembed(text)
        if session is not None or snapshot.router.index.trigger_count > OFFLOAD_TRIGGERS:
            # Off the event loop: with a session, the decision is committed to the session store
            # (a disk write, which waits when another process holds the file), and scoring a large
            # index takes milliseconds of numpy (GIL released), which in a thread overlaps other
            # requests' encoding.
            result = await asyncio.to_thread(self._decide, snapshot, text, vector, session, tokens, gone)
        else:
            result = self._decide(snapshot, text, vector, session, tokens, gone)
        return self._routed(result, session, started)

    def _prepare(self, message: str) -> tuple[Snapshot, str | None] | RouteResult:
        """The snapshot and the cleaned text to route (None: too short to route), or the result when
        capd cannot route yet."""
        snapshot = self._service.snapshot
        if snapshot is None:
            if self._service.startup_error is not None:  # never ready: say why rather than "warming up" forever
                return RouteResult(Decision("skipped", f"{FAILED_START} {self._service.startup_error}"))
            return RouteResult(Decision("skipped", "warming up: the model and index are loading"))
        text, long_enough = clean_message(message, snapshot.router.min_chars)
        return snapshot, text if long_enough else None

    def _too_short(self, snapshot: Snapshot, session: str | None) -> RouteResult:
        """A message too short to route: skipped, with the session's plan (tap changes since)."""
        min_chars = snapshot.router.min_chars
        return RouteResult(Decision("skipped", f"too short: fewer than {min_chars} characters after removing tags"),
                           self._session_plan(session))

    def _decide(self, snapshot: Snapshot, text: str, vector: Vectors, session: str | None,
                tokens: TokenVectors | None = None, gone: threading.Event | None = None) -> RouteResult:
        router, registry = snapshot.router, self._service.registry
        if session is None or registry is None:
            return RouteResult(router.decide(vector, (), text, tokens))
        with registry.locked(session):
            if gone is not None and gone.is_set():  # last moment before the session changes
                raise ClientGone(session)
            # pinned capabilities are active in every session, a new one too (its first plan starts them)
            pinned = tuple(name for name in registry.pinned if name in snapshot.catalog)
            decision = router.decide(vector, (*registry.active_names(session), *pinned), text, tokens)
            plan = None
            if decision.decision in ("activate", "already_active") and decision.capability is not None:
                # already active: routed to again, it is about to be used, so its last_used is refreshed
                try:
                    plan = registry.activate(session, decision.capability, "auto")
                except UnknownCapability:  # a reload removed it between this decision and now
                    decision = Decision("abstain", f"{decision.capability} was removed by a tap reload while this "
                                        "message was routed", decision.capability, decision.score, decision.margin,
                                        decision.candidates)
            if plan is None:
                plan = registry.reconcile(session)
            self._service.learner.turns.routed(session, text, decision.decision, decision.capability)
        return RouteResult(decision, plan)

    def _routed(self, result: RouteResult, session: str | None, started: float) -> RouteResult:
        """Record a finished route (latency, decision count, a debug line) and stamp its latency."""
        elapsed = time.perf_counter() - started
        metrics, d = self._service.metrics, result.decision
        metrics.observe_route(elapsed)
        metrics.inc("capd_decisions_total", "Routing decisions by kind.", decision=d.decision)
        if log.isEnabledFor(logging.DEBUG):  # a line per agent turn is debug detail, not info
            log.debug("route session=%s decision=%s capability=%s score=%s margin=%s latency_ms=%.2f", session,
                      d.decision, d.capability, None if d.score is None else round(d.score, 4),
                      None if d.margin is None else round(d.margin, 4), elapsed * 1000)
        return RouteResult(d, result.plan, elapsed * 1000)

    def _session_plan(self, session: str | None) -> Plan | None:
        registry = self._service.registry
        return None if session is None or registry is None else registry.reconcile(session)
