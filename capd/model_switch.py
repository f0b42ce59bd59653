"""Switching the service's encoder to a tuned model: at the first publish, and when a tuning is done.

:mod:`capd.tuner` decides *when* the model is tuned; this module swaps a tuned model in. A switch
points the service's encoder, embedder and index at the tuned model, publishes with it under the
service's lock, and either keeps it (health and the tuner see it from then on, and the encoder it
replaced is retired once requests already holding it are done) or, when the model does not load or
routing cannot use it, undoes it so the served snapshot keeps the model it had. Each tuned model in
use is held (:class:`~capd.tuned_models.InUse`) so no other process prunes it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from capd.batching import MicroBatcher
from capd.catalog import Catalog
from capd.embedder import CachedEmbedder
from capd.encoder import Encoder, open_encoder
from capd.errors import ModelError, Stopping
from capd.index import SyncReport, TriggerIndex
from capd.tuned_models import InUse, is_tuned, prune, remember, remembered, set_aside, tuned_dir
from capd.tuner import lineage_for

if TYPE_CHECKING:  # the service builds one of these for itself
    from capd.service import Service

log = logging.getLogger(__name__)

RETIRE_DELAY = 30.0  # seconds an encoder replaced by a tuned one keeps serving requests already holding it


class ModelSwitch:
    """The tuned model ``service`` embeds with, and the switches to it (part of the service: it
    uses the service's lock, vector cache and publish)."""

    def __init__(self, service: Service) -> None:
        self._service = service
        self._holds: list[tuple[Encoder, InUse]] = []  # tuned models in use, with the encoder using each
        # The tuned model the service's encoder embeds with (None: untuned). It leads the tuning's key
        # while a switch re-embeds: publishing picks gates by it, and health shows the switch once published.
        self.key: str | None = None

    def publish_adopting(self, catalog: Catalog) -> SyncReport:
        """The first publish: with the tuned model for ``catalog`` if it is cached, else with the one
        this data directory last routed with for these taps and base model (``stale``: the taps were
        edited while capd was not running; start() tunes for them as they are). One that does not
        load, or that routing cannot use (it gives non-finite vectors), is set aside and the untuned
        model published, so that start() tunes it again: a cached model that failed here used to fail
        every later start as well."""
        service = self._service
        key = service.tuner.target(catalog).key
        path = tuned_dir(service.settings.data_dir, key)
        if not is_tuned(path):
            # the taps were edited since the last run: route with the tuned model it last used (``stale``)
            # while the tuning for the taps as they are runs, as after a live edit; else untuned
            last = remembered(service.settings.data_dir, self._lineage())
            if last is None:
                return service._publish(catalog)
            service.tuning.wanted = key
            key, path = last, tuned_dir(service.settings.data_dir, last)
        previous = service.encoder
        undo = self._switch(path, key)
        if undo is None:
            set_aside(path, service.tuning.error or "it does not load")
            return service._publish(catalog)
        try:
            report = service._publish(catalog)
        except Stopping:
            raise
        except Exception as exc:
            undo()
            why = f"cannot route with the tuned model {path}: {exc}"
            service.tuning.failed(why)
            set_aside(path, why)
            return service._publish(catalog)
        self._switched(path, key, previous)
        return report

    def use(self, path: Path, key: str) -> bool:
        """Swap in the tuned model: embed every example with it and publish, under the lock.
        False when it does not load, or when publishing with it fails (e.g. the model gives
        non-finite vectors): then the served snapshot, which still routes with the model it had,
        keeps that model, and the tuned one is retired."""
        service = self._service
        with service._lock:
            if service._closed:
                return False
            previous = service.encoder
            undo = self._switch(path, key)
            if undo is None:
                return False
            try:
                service._publish(service.catalog_now())
            except Stopping:  # close() cut the fits short: nothing failed
                undo()
                return False
            except Exception as exc:
                undo()
                service.tuning.failed(f"cannot route with the tuned model {path}: {exc}")
                return False
            self._switched(path, key, previous)
            return True

    def close_encoder(self, encoder: Encoder | None) -> None:
        """Close ``encoder`` and let go of the tuned model it routed with (:class:`InUse`)."""
        if isinstance(encoder, MicroBatcher):
            encoder.close()
        for pair in [pair for pair in self._holds if pair[0] is encoder]:
            try:
                self._holds.remove(pair)
            except ValueError:
                continue  # another thread let go of it first
            pair[1].release()

    def _lineage(self) -> str:
        """:func:`~capd.tuner.lineage_for` these settings ("" when the base model cannot be resolved:
        nothing is remembered under it, so nothing is adopted)."""
        try:
            return lineage_for(self._service.settings)
        except Exception as exc:  # a model the encoder loaded resolves; this is belt and braces
            log.warning("cannot tell which tuned models belong to these taps: %s", exc)
            return ""

    def _switch(self, path: Path, key: str) -> Callable[[], None] | None:
        """Point the encoder, embedder and index at the tuned model in ``path`` (under the lock;
        the caller publishes). Returns what undoes it (None: the model does not load); the encoder
        it replaces is the caller's to :meth:`_retire` once the switch is published."""
        service = self._service
        hold = InUse(path)  # first: from here on no other process prunes it
        try:
            if not is_tuned(path):
                raise ModelError("another process removed it")
            tuned = open_encoder(dataclasses.replace(service.settings, model=str(path)))
        except Exception as exc:
            hold.release()
            service.tuning.failed(f"cannot load the tuned model {path}: {exc}")
            return None
        assert service._cache is not None
        before = (service.encoder, service.embedder, service.index, self.key)
        service.encoder = MicroBatcher(tuned)
        self._holds.append((service.encoder, hold))
        service.embedder = CachedEmbedder(service.encoder, service._cache, stopping=service.fits.stopping)
        service.index = TriggerIndex(service.encoder.dim)
        self.key = key

        def undo() -> None:
            switched = service.encoder
            service.encoder, service.embedder, service.index, self.key = before
            self._retire(switched)

        return undo

    def _retire(self, old: Encoder | None) -> None:
        """Close an encoder once requests already holding it are done (:data:`RETIRE_DELAY`)."""
        if isinstance(old, MicroBatcher):
            retire = threading.Timer(RETIRE_DELAY, self.close_encoder, args=(old,))
            retire.daemon = True
            retire.start()

    def _switched(self, path: Path, key: str, previous: Encoder | None) -> None:
        """The switch to ``key`` is published: health and the tuner see it from here on."""
        service = self._service
        service.tuning.switched(key, path)
        log.info("routing with the tuned model %s", path)
        if lineage := self._lineage():
            remember(service.settings.data_dir, lineage, key)
        prune(service.settings.data_dir, key)
        self._retire(previous)
