"""When a service tunes its model (``tune = true``), and what health says meanwhile.

:mod:`capd.tuning` is how a model is tuned: the recipe, the cache under ``<data>/tuned/<key>/``
and the child process that trains. This module is when: at the start (blocking for the CLI, in
a background thread for the daemon, which serves with the untuned model meanwhile) and after
tap edits (:data:`TUNE_DELAY` seconds of quiet, since edits come in bursts). The service owns
the switch itself (its encoder, vector index and published router); the tuner hands it a
finished model's directory through ``use`` and records what happened in :class:`Tuning`.

A tuning run whose catalog changed while it trained is not loaded (loading it would cost an
export and a re-embed for a model nobody wants); the run for the new catalog follows it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capd.catalog import Catalog
from capd.errors import ModelError
from capd.models import HASH_MODEL, manifest_for, resolve
from capd.settings import Settings
from capd.tuned_models import is_tuned, set_aside, tuned_dir
from capd.tuning import RECIPE, Groups, Recipe, groups_for, run_child, tuning_key

log = logging.getLogger(__name__)

TUNE_DELAY = 30.0  # seconds of quiet after a tap edit before the daemon retunes (edits come in bursts)
TOO_FEW = "nothing to tune on: fewer than two capabilities with two or more examples"
HASH_UNTUNABLE = ("the built-in hash model cannot be tuned: it has no weights; tune a real model "
                  "(capd models lists them)")


@dataclass
class Tuning:
    """What ``tune = true`` is doing (shown in health as ``tuning``)."""

    enabled: bool = False
    status: str = "off"  # off | untuned | tuning | ready | stale | failed (README, Tuning the model)
    key: str | None = None  # the tuned model in use
    wanted: str | None = None  # the key the current catalog asks for
    model: str | None = None
    error: str | None = None
    seconds: float | None = None  # the last tuning run's training time

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def failed(self, error: str) -> None:
        self.status, self.error = "failed", error
        log.error("%s", error)

    def current(self) -> None:
        """The tuned model in use is the one the catalog asks for: the reason of a past failure no
        longer holds."""
        self.status, self.error = "ready", None

    def switched(self, key: str, model: Path) -> None:
        """Routing moved to the tuned model ``key`` (``stale`` if the catalog already asks for another)."""
        self.key, self.model, self.error = key, str(model), None
        self.status = "ready" if key == self.wanted or self.wanted is None else "stale"


@dataclass(frozen=True)
class Target:
    """The tuned model a catalog asks for: its key, its training groups and the base model's directory."""

    key: str
    groups: Groups
    base: Path


def target_for(settings: Settings, catalog: Catalog, recipe: Recipe = RECIPE, stamp: bool = True) -> Target:
    """What tuning ``catalog`` means. ``stamp=False`` hashes the weights without recording the check
    in the data directory (so without creating it: ``capd tune --list`` only reads)."""
    groups = groups_for(catalog)
    base = resolve(manifest_for(settings), settings.data_dir if stamp else None)
    return Target(tuning_key(base.weights_sha256, groups, recipe), groups, base.directory)


def lineage_for(settings: Settings) -> str:
    """What tuned models of one base model for one list of taps share, whatever the taps hold: a
    restart after a tap edit adopts the one last used (:func:`capd.tuned_models.remembered`) while
    the tuning for the taps as they are runs, as a daemon does after a live edit."""
    base = resolve(manifest_for(settings), settings.data_dir)
    taps = [str(Path(tap).resolve()) for tap in settings.taps]
    return hashlib.sha256(json.dumps([base.weights_sha256, taps]).encode()).hexdigest()[:24]


def tuned_model(settings: Settings, catalog: Catalog, recipe: Recipe = RECIPE) -> Path:
    """The tuned model's directory for ``catalog``, tuned now (blocking) unless cached: for
    commands that embed without starting a service (``capd index``). Raises ModelError."""
    target = target_for(settings, catalog, recipe)
    path = tuned_dir(settings.data_dir, target.key)
    if not is_tuned(path):
        if len(target.groups) < 2:
            raise ModelError(TOO_FEW)
        run_child(target.base, target.groups, path, recipe, onnx_data_dir=onnx_data_dir(settings))
    return path


def onnx_data_dir(settings: Settings) -> Path | None:
    """Where a tuning child exports the tuned model to ONNX for the backend ``settings`` load it
    with (None: torch, which needs no export)."""
    return None if settings.backend == "torch" else settings.data_dir


CLOSE_WAIT = 5.0  # seconds close() waits for a killed run to clean up after itself


class Tuner:
    """Keeps a service's model tuned to its catalog. ``use(path, key)`` switches routing to the
    tuned model in ``path`` and says whether it could (:meth:`capd.model_switch.ModelSwitch.use`)."""

    def __init__(self, settings: Settings, catalog_now: Callable[[], Catalog],
                 use: Callable[[Path, str], bool]) -> None:
        self.settings = settings
        self.state = Tuning(enabled=settings.tune and settings.model != HASH_MODEL)
        if self.state.enabled:
            self.state.status = "untuned"  # until the start adopts or tunes one
        elif settings.tune:  # asked for, and off: health and `capd tune` say why
            self.state.error = HASH_UNTUNABLE
        self.recipe: Recipe = RECIPE  # tests use a shorter one
        self._catalog_now = catalog_now
        self._use = use
        self._timer: threading.Timer | None = None
        self._thread: threading.Thread | None = None
        self._children: list[subprocess.Popen[bytes]] = []
        self._training: str | None = None  # the key a tuning run in this process is training
        self._closed = False
        # A background run under way (set when it starts, cleared when it has decided not to go on:
        # under the lock, so a retune that finds it set can leave the catalog to it, and it sees that).
        self._lock = threading.Lock()
        self._running = False
        self._recheck = False  # a retune came while it ran: it checks the catalog again when it ends

    @property
    def busy(self) -> bool:
        """A tuning run is under way in the background thread."""
        with self._lock:
            return self._running

    def target(self, catalog: Catalog) -> Target:
        return target_for(self.settings, catalog, self.recipe)

    def catalog_changed(self, catalog: Catalog) -> None:
        """A reload in the daemon: record the key the new catalog asks for, say ``stale`` while the
        model in use (or being tuned) is for another one, and retune after :data:`TUNE_DELAY`."""
        try:
            wanted = self.target(catalog).key
        except Exception as exc:  # the base model vanished: the retune reports it
            log.warning("cannot compute the tuning key of the new catalog: %s", exc)
        else:
            self.state.wanted = wanted
            if wanted == self.state.key:
                self.state.current()
            elif wanted == self._training:
                self.state.status = "tuning"
            elif self.state.key is not None or self._training is not None:
                self.state.status = "stale"
        if self._timer is not None:
            self._timer.cancel()
        self._timer = threading.Timer(TUNE_DELAY, self.ensure, kwargs={"background": True})
        self._timer.daemon = True
        self._timer.start()

    def ensure(self, background: bool) -> None:
        """Route with the tuned model for the current catalog: reuse it if it exists, else tune
        (in a background thread for the daemon, which keeps serving meanwhile; else blocking)."""
        if background and self._leave_to_the_run():
            return
        job = self._job()
        if job is None:
            return
        if not background:
            self._tune(*job)
            return
        if self._leave_to_the_run(start=True):
            return
        self._thread = threading.Thread(target=self._tune_in_background, args=(job,), name="capd-tune", daemon=True)
        self._thread.start()

    def _leave_to_the_run(self, start: bool = False) -> bool:
        """True when a background run is under way: it checks the catalog again when it ends. Else
        False, and with ``start`` the caller's run is now the one under way."""
        with self._lock:
            if self._running:
                self._recheck = True
                return True
            if start:
                self._running = True
            return False

    def _job(self) -> tuple[Target, Path] | None:
        """What the current catalog needs tuned, and where; None when nothing is to be tuned: its
        tuned model is in use, or was just switched to, or it cannot be tuned (state says why)."""
        target = self.target(self._catalog_now())
        key = self.state.wanted = target.key
        if key == self.state.key:
            self.state.current()
            return None
        path = tuned_dir(self.settings.data_dir, key)
        if is_tuned(path):
            if self._use(path, key) or self._closed:
                return None
            if set_aside(path, self.state.error or "it does not load") is None:
                return None  # stays failed: tuning again would publish next to the damaged copy
        if len(target.groups) < 2:
            self.state.status = "untuned" if self.state.key is None else "stale"
            self.state.error = TOO_FEW
            return None
        return target, path

    def close(self) -> None:
        """Cancel a pending retune and kill a training child (:func:`~capd.tuning.run_child` then
        sweeps its half-written model; the run ends quietly, not as a failure)."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        for child in self._children:
            if child.poll() is None:
                child.kill()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            # the run's own cleanup (its spec file, a half-written model) and its log line happen
            # there: a daemon thread left running when the process exits never gets to them
            thread.join(CLOSE_WAIT)

    def _tune(self, target: Target, path: Path) -> None:
        key = target.key
        self._training = key
        self.state.status = "tuning" if key == self.state.wanted else "stale"
        log.info("tuning the model on %d capabilities (%d examples) into %s", len(target.groups),
                 sum(len(texts) for _, texts in target.groups), path)
        try:
            summary = run_child(target.base, target.groups, path, self.recipe, started=self._children,
                                onnx_data_dir=onnx_data_dir(self.settings))
        except Exception as exc:
            if self._closed:  # close() killed the child: a stop, not a failure
                log.info("tuning %s stopped: capd is stopping", key)
                return
            if self._undone(key):
                log.warning("tuning %s failed, but the taps no longer ask for it: %s", key, exc)
                return
            self.state.failed(str(exc))
            return
        finally:
            self._training = None
            self._children = [child for child in self._children if child.poll() is None]  # not one per run for ever
        self.state.seconds = summary.get("seconds")
        if self._closed:
            return
        if key != self.state.wanted:
            log.info("the tuned model %s is no longer wanted (the taps changed meanwhile); not loading it", path)
            if not self._undone(key):
                self.state.status = "stale" if self.state.key is not None else "untuned"
            return
        if not self._use(path, key) and not self._closed and is_tuned(path):
            # a model routing cannot use (it does not load, or gives non-finite vectors) must not
            # be adopted by the next start from the cache: set aside, as a damaged cached one is
            set_aside(path, self.state.error or "routing cannot use it")

    def _undone(self, key: str) -> bool:
        """Whether the edit that asked for ``key`` was undone while it was tuned: the taps ask again
        for the tuned model in use, so health says ``ready`` (then this run's outcome is moot)."""
        if key == self.state.wanted or self.state.key is None or self.state.key != self.state.wanted:
            return False
        self.state.current()
        return True

    def _tune_in_background(self, job: tuple[Target, Path] | None) -> None:
        """Tune ``job``, then the catalog again while retunes came meanwhile (tap edits whose timer
        fired during the run), except after a failure of the key the taps still ask for. An edit
        whose timer has not fired yet is left to it."""
        try:
            while True:
                if job is not None:
                    self._tune(*job)
                with self._lock:
                    failed = job is not None and self.state.status == "failed" and job[0].key == self.state.wanted
                    again, self._recheck = self._recheck and not failed and not self._closed, False
                    if not again:
                        self._running = False
                        return
                job = self._job()
        finally:
            with self._lock:
                self._running = False
