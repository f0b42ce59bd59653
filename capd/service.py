"""The one service object that the daemon, the CLI and the tests all go through.

It owns the catalog, the encoder (micro-batched), the vector cache, the trigger index,
the router and — in the daemon — the session registry. Reads go through an immutable
snapshot (catalog + router) that a reload replaces in one assignment, so no request ever
sees half a catalog. Slow work (embedding new triggers) happens before the swap, outside
the lock; the swap itself only moves cached vectors into the index.

What each publish is fitted with (the fused head, auto gates, the gates in force) is
:mod:`capd.fits`; when the model is tuned to the taps is :mod:`capd.tuner`; how a route meets its
session is :mod:`capd.session_routing`; the switch to a tuned model is :mod:`capd.model_switch`. The
service keeps what ties them together: the lock, the snapshot, the encoder in use, learning from
corrections and health.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from capd.batching import MicroBatcher
from capd.calibrate import Point
from capd.catalog import Capability, Catalog, Problem
from capd.corrections import Learner
from capd.embedder import CachedEmbedder
from capd.encoder import Encoder, Vectors, open_encoder
from capd.errors import StateError, Stopping, UnknownCapability
from capd.fits import RuleFits, fitting_threads, heads_dir
from capd.fused import TOKEN_BUDGET
from capd.health import health as health_of
from capd.index import SyncReport, TriggerIndex
from capd.learned import LearnedStore
from capd.learned_rows import KINDS
from capd.live_taps import LiveTaps
from capd.metrics import Metrics
from capd.model_switch import ModelSwitch
from capd.models import manifest_for
from capd.router import Router, example_catalog
from capd.session_routing import RouteResult, SessionRouting
from capd.sessions import SessionRegistry
from capd.settings import Settings, own_data_dir
from capd.state import SessionStore, sessions_owner
from capd.tuner import Tuner, Tuning
from capd.vectorcache import VectorCache
from capd.vetoes import Vetoes, abstain_corpus, veto_text

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Snapshot:
    catalog: Catalog
    router: Router


@dataclass
class Counters:
    embedded: int = 0
    cached: int = 0
    reloads: int = 0


def learned_in_effect(catalog: Catalog, rule: str, store: LearnedStore | None
                      ) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]]]:
    """The learned triggers and abstains that routing ``catalog`` under ``rule`` uses (none under ``anchor``)."""
    if rule == "anchor" or store is None:
        return {}, {}
    return store.for_catalog(catalog), store.for_catalog(catalog, "abstain")


def cached_texts(catalog: Catalog, rule: str, store: LearnedStore | None) -> set[str]:
    """Every text a service routing ``catalog`` under ``rule`` may embed through the vector cache
    (:meth:`Service._publish`): the examples it indexes, the learned abstains and the taps' vetoes,
    and the abstain corpus (whether it is used depends on gates). ``capd index --prune`` keeps their vectors, so a text
    embedded there must be listed here (``tests/test_cli.py``: a restart after a prune embeds nothing)."""
    learned, refused = learned_in_effect(catalog, rule, store)
    texts = {t for capability in example_catalog(catalog, rule, learned) for t in capability.triggers}
    texts.update(message for messages in refused.values() for message in messages)
    texts.update(veto_text(message) for config in catalog.tap_configs.values() for message in config.vetoes)
    texts.update(abstain_corpus())
    return texts


class Service:
    def __init__(self, settings: Settings, encoder: Encoder | None = None, sessions: bool = False,
                 clock: Callable[[], float] = time.time, learn: bool | None = None) -> None:
        """``sessions``: keep per-session state (the daemon). ``learn`` (default: with sessions and
        ``settings.learn``): record corrections and route with learned examples (:mod:`capd.learned`)."""
        self.settings = settings
        self._want_learning = (sessions and settings.learn) if learn is None else learn
        self.learned: LearnedStore | None = None
        self.learner = Learner(self.catalog_now, lambda: self.learned, self.apply_learned)
        # what the served snapshot was built from: the learned file's data_version when it was read,
        # and the learned (triggers, abstains) read then (refresh_learned compares against both)
        self._learned_version: int | None = None
        self._learned_in_use: tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]]] = ({}, {})
        self.metrics = Metrics()
        self.counters = Counters()
        self._encoder_override = encoder
        self._want_sessions = sessions
        self._clock = clock
        self._lock = threading.RLock()  # serialises reloads
        self._snapshot: Snapshot | None = None
        self.fits = RuleFits(settings)
        self._taps = LiveTaps(settings.taps)
        self._tap_errors: list[Problem] = []
        self.encoder: Encoder | None = None
        self.embedder: CachedEmbedder | None = None
        self.index: TriggerIndex | None = None
        self.registry: SessionRegistry | None = None
        self.started_at = time.monotonic()
        self.ready_after: float | None = None
        self.startup_error: str | None = None
        self.state_error: str | None = None  # why session state is not stored on disk, if it is not
        self.watch_problems: list[Problem] = []  # taps scanned for changes, or not at all (capd.watcher)
        self.models = ModelSwitch(self)  # the tuned model in use, and the switches to it
        self.tuner = Tuner(settings, self.catalog_now, self.models.use)
        self._cache: VectorCache | None = None
        self._sessions_owner: BinaryIO | None = None  # see sessions_owner()
        self._closed = False
        self.routing = SessionRouting(self)

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._snapshot is not None

    def start(self) -> Service:
        """Load the model, the cache and the taps; build the index. Blocking; call once."""
        try:
            own_data_dir(self.settings.data_dir)
            base = self._encoder_override or open_encoder(self.settings)
            self.encoder = MicroBatcher(base)
            self._check_open()
            self._cache = self._open_cache()
            self.embedder = CachedEmbedder(self.encoder, self._cache, stopping=self.fits.stopping)
            self.index = TriggerIndex(self.encoder.dim)
            if self._want_sessions:
                store = self._open_sessions()
                self.registry = SessionRegistry(store, self.catalog_now, max_active=self.settings.max_active,
                                                pinned=self.settings.pinned, clock=self._clock,
                                                ttl=self.settings.session_ttl)
                self.registry.on_manual = self.learner.manual_enable
                self.registry.on_disable = self.learner.manual_disable
                self.registry.on_end = self.learner.turns.forget_session  # its turns teach nothing after it
            if self._want_learning:
                self.learned = LearnedStore.open(self.settings.data_dir, self.settings.learn_max)
            self.reload()
            if self.tuning.enabled:
                self.tuner.ensure(background=self._want_sessions)
        except Exception as exc:
            self.startup_error = str(exc)
            raise
        self.ready_after = time.monotonic() - self.started_at
        self._register_gauges()
        return self

    def _check_open(self) -> None:
        """Raise :class:`Stopping` once :meth:`close` was called: a start or publish under way ends
        here rather than finish work nobody will route with."""
        if self._closed:
            raise Stopping("capd is stopping")

    def _open_cache(self) -> VectorCache:
        return VectorCache.open(self.settings.data_dir)

    def _open_sessions(self) -> SessionStore:
        """The session store; in memory (with a warning, and an error in health) if the file cannot be used."""
        path = self.settings.data_dir / "sessions.sqlite3"
        self._sessions_owner = sessions_owner(path)
        try:
            return SessionStore(path)
        except StateError as exc:
            self.state_error = (f"{exc}. Sessions are kept in memory only, and moved to the file once it can "
                                "be used (tried every minute and at the stop); if it never can, they are lost when "
                                "capd stops")
            log.warning("%s", self.state_error)
            return SessionStore(path, memory=True)

    def reattach_state(self) -> bool:
        """Sessions kept in memory since the start because the file could not be used: try the
        file again (the daemon does every minute), moving them there. True when stored on disk."""
        store = self.registry.store if self.registry is not None else None
        if store is None or store.persistent:
            return store is not None
        if not store.attach():
            return False
        self.state_error = None
        log.warning("session state is stored in %s again: the sessions kept in memory were moved there", store.path)
        return True

    def interrupt(self) -> None:
        """Ask the work under way to end: a start or publish raises :class:`Stopping` at its next
        check, and a fit of the fused head or its auto gates within one step of its optimiser
        (seconds sooner on a large tap). Nothing can be started or published afterwards. Call it
        before waiting for a thread that may be publishing (the daemon's tap watcher); :meth:`close`
        calls it too."""
        self._closed = True
        self.fits.stopping.set()
        self.learner.close()

    def close(self) -> None:
        self.interrupt()
        self.tuner.close()
        if self._snapshot is None:  # still starting: stop its embedding at the next batch, not after them all
            self.models.close_encoder(self.encoder)
        with self._lock:  # a reload or learning pass already under way finishes before its stores close
            self.models.close_encoder(self.encoder)
            if self.learned is not None and (lost := self.learned.close()):
                log.warning("%d learned correction(s) could not be stored in %s before capd stopped: %s",
                            lost, self.learned.path, self.learned.error)
            if self.registry is not None:  # before letting go of the file: a last try at what is pending
                self._close_sessions(self.registry.store)
            if self._sessions_owner is not None:
                self._sessions_owner.close()
            if self._cache is not None:
                self._cache.close()

    def _close_sessions(self, store: SessionStore) -> None:
        """Store the sessions before stopping: what a lock held back, or, when they were kept in
        memory since the start, all of them if the file can be used now; say what is lost."""
        if store.ids() and not self.reattach_state():
            log.warning("%d session(s) kept in memory are lost: %s still cannot be used", len(store.ids()), store.path)
        if unsaved := store.close():
            log.warning("%d session change(s) could not be saved to %s before capd stopped: %s",
                        unsaved, store.path, store.last_error)

    def _register_gauges(self) -> None:
        self.metrics.gauge("capd_capabilities", "Capabilities in the catalog.", lambda: len(self.catalog_now()))
        self.metrics.gauge("capd_index_triggers", "Trigger vectors in the index.",
                           lambda: self.index.trigger_count if self.index else 0)
        self.metrics.gauge("capd_sessions", "Live sessions.",
                           lambda: len(self.registry.sessions()) if self.registry else 0)
        self.metrics.gauge("capd_triggers_embedded", "Trigger texts this process had to embed.",
                           lambda: self.counters.embedded)
        self.metrics.gauge("capd_triggers_cached", "Trigger texts served from the vector cache.",
                           lambda: self.counters.cached)
        self.metrics.gauge("capd_unsaved_session_changes", "Session changes served from memory, not yet stored "
                           "(another process's lock, a full disk).",
                           lambda: self.registry.store.pending if self.registry else 0)
        self.metrics.gauge("capd_unsaved_learned_corrections", "Learned corrections used from memory, not yet "
                           "stored (another process's lock, a full disk).",
                           lambda: self.learned.unsaved if self.learned else 0)

    # -- catalog ---------------------------------------------------------------------------

    def catalog_now(self) -> Catalog:
        snapshot = self._snapshot
        if snapshot is None:
            return Catalog(taps=tuple(self.settings.taps), capabilities={})
        return snapshot.catalog

    def reload(self, changed: Iterable[Path] | None = None) -> dict[str, Any]:
        """Rescan taps and swap in the new catalog atomically; returns what changed."""
        assert self.embedder is not None and self.index is not None and self.encoder is not None
        with self._lock:
            self._check_open()  # the cache and stores are closed
            before = self._snapshot.catalog if self._snapshot is not None else None
            catalog = self._taps.load(changed)
            if self.tuning.enabled and self.tuning.key is None and self.ready_after is None:
                report = self.models.publish_adopting(catalog)  # a restart starts on its tuned model: embeds once
            else:
                report = self._publish(catalog)
            self.counters.reloads += 1
            if self.tuning.enabled and self.ready_after is not None and self._want_sessions:
                self.tuner.catalog_changed(catalog)
        for problem in catalog.errors:
            log.error("tap error: %s", problem)
        self._warn_unknown_pinned(catalog)
        added, removed, edited = catalog.changes_from(before)
        return {"capabilities": len(catalog), "added": added, "removed": removed, "changed": edited,
                "embedded": report.embedded, "cached": report.cached, "errors": [p.as_dict() for p in catalog.errors]}

    def _warn_unknown_pinned(self, catalog: Catalog) -> None:
        """A pinned name the catalog lacks is ignored until a tap provides it (taps reload live, so
        not an error), but a typo there must not go unnoticed."""
        unknown = [name for name in self.settings.pinned if catalog.get(name) is None]
        if unknown and self.registry is not None:
            log.warning("pinned capability not in the catalog, ignored until a tap provides it: %s",
                        ", ".join(unknown))

    def _publish(self, catalog: Catalog) -> SyncReport:
        """Index ``catalog``'s examples for the rule and swap in a router for it (under the lock).
        What it embeds through the vector cache is :func:`cached_texts`; keep the two in step."""
        assert self.index is not None
        # the version before the entries: a commit made while they are read is seen at the next check
        version = self.learned.version() if self.learned is not None else None
        learned, refused = self._learned_in_effect(catalog)
        previous = self._snapshot.router if self._snapshot is not None else None
        router, report = self._build_router(catalog, self.index, learned, refused, previous)
        self._snapshot = Snapshot(catalog, router)
        self._learned_version, self._learned_in_use = version, (learned, refused)
        return report

    def router_with_examples(self, examples: Mapping[str, Sequence[str]]) -> Router:
        """A router on the served catalog whose taps' examples are ``examples`` instead of their
        ``examples.jsonl`` (capability name -> messages: :meth:`Catalog.with_examples`), built on
        an index of its own and never served: ``capd calibrate`` scores each fold with the other
        folds' examples. Its fused head is fitted and not cached (each fold's is used once)."""
        with self._lock:
            catalog = self.catalog_now().with_examples(examples)
            learned, refused = self._learned_in_effect(catalog)
            assert self.encoder is not None
            router, _ = self._build_router(catalog, TriggerIndex(self.encoder.dim), learned, refused, None)
            return router

    def _build_router(self, catalog: Catalog, index: TriggerIndex, learned: Mapping[str, tuple[str, ...]],
                      refused: Mapping[str, tuple[str, ...]], previous: Router | None) -> tuple[Router, SyncReport]:
        """Index ``catalog``'s examples into ``index`` and build a router on it: the served one
        (``index`` is the service's: the auto gates are refitted with the head, and the head is
        cached) or one for :meth:`router_with_examples`."""
        assert self.embedder is not None and self.encoder is not None
        rule = self.settings.rule
        serving = index is self.index
        examples = example_catalog(catalog, rule, learned)
        self._check_open()
        with self.embedder.keeping_tokens(TOKEN_BUDGET if rule == "fused" else 0) as fresh:  # one pass for both
            report = index.sync(examples, self.embedder)
        self.counters.embedded += report.embedded
        self.counters.cached += report.cached
        self._check_open()  # before the fits: seconds of CPU on a large tap
        embedder = self.embedder

        def vectors_of(texts: list[str]) -> Vectors:  # through the vector cache
            return embedder.embed(texts)[0]

        vetoes = Vetoes.build(refused, vectors_of)
        manifest = manifest_for(self.settings)  # reads the manifest files: once per publish
        gate_model = self._gate_model(manifest.name)
        with fitting_threads(replacing=previous is not None):
            if serving:
                head = self.fits.refit(catalog, index, self.encoder, previous, fresh.matrices, gate_model)
            else:
                head = self.fits.head(index, self.encoder, self.router, fresh.matrices,
                                      cache=False) if rule == "fused" else None
        gates = self.fits.gatebook(catalog, manifest, gate_model)
        if gates.abstain_corpus:  # a tap's capd.toml turns it on (`capd calibrate` decides)
            vetoes = vetoes.with_corpus(vectors_of)
            if head is not None:  # and, for the fused rule, as a class of its ranking (cached with the head)
                with fitting_threads(replacing=previous is not None):
                    vetoes = vetoes.with_corpus_class(head, index.examples(), heads_dir(self.settings) if serving
                                                      else None, self.fits.stopping.is_set)
        vetoes = vetoes.with_taps({tap: config.vetoes for tap, config in catalog.tap_configs.items()}, vectors_of)
        recalled = self.learned.recalls(catalog, learned, refused) if self.learned is not None and learned else {}
        router = Router(self.encoder, index, catalog, gates, rule=rule,
                        min_chars=self.settings.min_chars, head=head, vetoes=vetoes, recalled=recalled)
        return router, report

    @property
    def tuning(self) -> Tuning:
        """The tuned model's state: :mod:`capd.tuner` decides when to tune, :mod:`capd.model_switch` switches."""
        return self.tuner.state

    # -- learning from corrections (capd/corrections.py records them) ----------------------

    def apply_learned(self) -> int:
        """Route with the learned examples recorded so far (blocking); returns how many are in effect."""
        with self._lock:
            snapshot = self._snapshot
            if snapshot is None or self.learned is None or self._closed:  # a timer that fired as we closed
                return 0
            self._publish(snapshot.catalog)
            return sum(len(v) for kind in KINDS for v in self.learned.for_catalog(snapshot.catalog, kind).values())

    def refresh_learned(self) -> bool:
        """Route with the learned examples as another process left them in ``learned.sqlite3``
        (``capd learned forget``, a second daemon on this data directory); the daemon calls this
        every few seconds (capd/api.py). A few microseconds when the file has not changed since the
        served snapshot read it; its own corrections never count as a change. True when it re-published."""
        if self.learned is None or self._snapshot is None or self._closed:
            return False
        version = self.learned.version()  # None in memory: nothing else writes there
        if version is None or version == self._learned_version:
            return False
        with self._lock:
            snapshot = self._snapshot
            if snapshot is None or self._closed or version == self._learned_version:
                return False
            self._learned_version = version  # tried once per change: a failing publish is not retried every tick
            if self._learned_in_effect(snapshot.catalog) == self._learned_in_use:
                return False  # e.g. another daemon's corrections for a tap this one does not serve
            log.info("learned examples changed in %s by another process: routing with them", self.learned.path)
            self._publish(snapshot.catalog)
            return True

    def _learned_in_effect(self, catalog: Catalog) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]]]:
        """The learned triggers and abstains that routing ``catalog`` uses (none under ``anchor``)."""
        return learned_in_effect(catalog, self.settings.rule, self.learned)

    @property
    def auto_gates(self) -> Point | None:
        """The fused rule's gates fitted on the served examples (None when they gate nothing)."""
        return self.fits.auto_gates

    def fit_auto_gates(self) -> Point | None:
        """See :meth:`capd.fits.RuleFits.fit_auto_gates`."""
        return self.fits.fit_auto_gates(self.router)

    @property
    def gate_model(self) -> str:
        """The model name gates are recorded for in ``capd.toml``: a tuned model has its own scale,
        so its gates are kept apart (``<manifest>+tuned``) from the untuned model's."""
        return self._gate_model(manifest_for(self.settings).name)

    def _gate_model(self, manifest_name: str) -> str:
        return f"{manifest_name}+tuned" if self.models.key is not None else manifest_name

    @property
    def snapshot(self) -> Snapshot | None:
        """The catalog and router served now (None until the first publish)."""
        return self._snapshot

    @property
    def router(self) -> Router:
        snapshot = self._snapshot
        if snapshot is None:
            raise RuntimeError("service not started")
        return snapshot.router

    # -- routing ---------------------------------------------------------------------------

    def route(self, message: str, session: str | None = None) -> RouteResult:
        """Route one message, blocking while the model encodes it (CLI, tests): :class:`SessionRouting`."""
        return self.routing.route(message, session)

    async def aroute(self, message: str, session: str | None = None,
                     gone: threading.Event | None = None) -> RouteResult:
        """:meth:`route` for the event loop (``POST /v1/route``): :meth:`SessionRouting.aroute`."""
        return await self.routing.aroute(message, session, gone)

    def discover(self, intent: str, limit: int = 5) -> list[tuple[str, float]]:
        return self.router.discover(intent, limit)

    def explain(self, message: str, limit: int = 5) -> list[dict[str, Any]]:
        return self.router.explain(message, limit)

    def capability(self, name: str) -> Capability:
        capability = self.catalog_now().get(name)
        if capability is None:
            raise UnknownCapability(name)
        return capability

    # -- health ----------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        """``GET /v1/health``'s body: :func:`capd.health.health`."""
        return health_of(self)
