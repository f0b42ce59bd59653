"""Live reload: a thin watchdog adapter plus a debounced :meth:`TapWatcher.apply_changes`.

The watchdog handler only records paths. A worker thread waits until no event has
arrived for ``debounce`` seconds, then calls ``apply_changes(paths)``, which reloads the
capability folders those paths belong to (``Service.reload(changed=…)``). Tests call
``apply_changes`` directly, or run a real observer end to end.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from watchdog import events
from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

if TYPE_CHECKING:
    from capd.service import Service

log = logging.getLogger(__name__)

REARM_INTERVAL = 2.0  # seconds between checks that the watches match the taps on disk (a few stat calls)

# Every kind of event the handler records; "opened" and "closed_no_write" are left out so that they
# stay out of the inotify mask. Reading a large tap (10k capabilities: 30k files) otherwise overflows
# the kernel's event queue, and watchdog's rescan after an overflow opens every directory again,
# which overflows it again: the daemon then spent a whole core on it for as long as it ran.
_EVENTS: list[type[FileSystemEvent]] = [
    events.FileCreatedEvent, events.DirCreatedEvent, events.FileModifiedEvent, events.DirModifiedEvent,
    events.FileDeletedEvent, events.DirDeletedEvent, events.FileMovedEvent, events.DirMovedEvent,
    events.FileClosedEvent,
    *(getattr(events, name) for name in ("FileAttribEvent", "DirAttribEvent") if hasattr(events, name)),
]


def _ignore_rewatch_warning() -> None:
    """Keep watchdog's "Callback with id … already exists for watch" RuntimeWarning out of the log.

    watchdog (7.x, inotify) keeps the watch of a folder moved out of a recursively watched tap (it
    drops watches only when the kernel does: see the TODO in ``InotifyWatchGroup.on_event``). Moved
    back, the folder is the same inode, so the kernel returns the same watch descriptor and watchdog
    warns as it replaces its callback with itself. Nothing leaks (no fd or kernel watch over 20
    cycles), and the warning cannot come from a path scheduled twice (each schedule has its own
    callback id). Upstream: gorakhargosh/watchdog#1094 (moves across the watched tree's edge) and
    the review of #1278. Warning filters are process-wide, so this one matches only that message
    from that module.
    """
    warnings.filterwarnings("ignore", message=r"Callback with id '\d+' already exists for watch ",
                            category=RuntimeWarning, module=r"watchdog\.observers\.inotify\Z")


class _Queue(FileSystemEventHandler):
    """Records paths inside a tap (or a tap directory itself); nothing else happens here."""

    def __init__(self, watcher: TapWatcher, taps: list[Path]) -> None:
        self.watcher = watcher
        self.taps = taps

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type in ("opened", "closed_no_write"):
            return
        raw = [event.src_path, getattr(event, "dest_path", "")]
        paths = [Path(p if isinstance(p, str) else p.decode()) for p in raw if p]
        inside = [p for p in paths if any(p == tap or tap in p.parents for tap in self.taps)]
        # a folder on the way to a tap, created, deleted or moved: the tap itself may have come or gone
        inside += [tap for tap in self.taps if any(p in tap.parents for p in paths)]
        if inside:
            self.watcher.notify(inside)


def _nearest_dir(path: Path) -> Path:
    """``path`` if it is a directory, else its nearest ancestor that is."""
    while not path.is_dir() and path != path.parent:
        path = path.parent
    return path


class TapWatcher:
    """Watches each tap recursively, and the nearest existing folder above it (not recursively),
    so that a tap deleted, renamed or created, or a parent of it deleted and created again (a
    repository cloned afresh), is seen. Every :data:`REARM_INTERVAL` seconds the watches are
    checked against the file system as well: a tap that appeared without an event reaching the
    watcher is loaded then."""

    def __init__(self, service: Service, debounce: float = 0.25) -> None:
        self.service = service
        self.debounce = debounce
        self._pending: set[Path] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._observer: Any = None
        self._thread: threading.Thread | None = None
        self._taps: list[Path] = []
        self._handler: _Queue | None = None
        self._watches: dict[Path, tuple[int, Any]] = {}  # a tap -> its inode and recursive watch
        self._above: dict[Path, tuple[int, Any]] = {}  # the nearest existing folder above a tap -> the same
        self.applied = 0  # batches applied, for tests and metrics

    def start(self) -> None:
        """:meth:`observe` and :meth:`apply`: for a service already started."""
        self.observe()
        self.apply()

    def observe(self) -> None:
        """Record changes from now on, applying none yet. The daemon calls this before the
        service loads its taps, so nothing written while they load (a fused first start on a
        large tap takes minutes) or just after they are ready is missed."""
        _ignore_rewatch_warning()
        observer = Observer()
        self._taps = [Path(t).expanduser().absolute() for t in self.service.settings.taps]
        self._handler = _Queue(self, self._taps)
        self._observer = observer
        self._watch_taps()
        observer.start()  # the inotify watches are in place when this returns

    def apply(self) -> None:
        """Reload what changes touch (those recorded since :meth:`observe` first), once the
        service has started."""
        self._thread = threading.Thread(target=self._run, name="capd-watcher", daemon=True)
        self._thread.start()

    def _watch_taps(self) -> list[Path]:
        """Bring the watches in line with the file system: each existing tap recursively (again
        if it was deleted and created anew), and the nearest existing folder above each tap.
        Returns the taps that are watched anew (they appeared)."""
        self._rewatch(self._above, {_nearest_dir(tap.parent) for tap in self._taps}, recursive=False)
        return self._rewatch(self._watches, {tap for tap in self._taps if tap.is_dir()}, recursive=True)

    def _rewatch(self, table: dict[Path, tuple[int, Any]], wanted: set[Path], recursive: bool) -> list[Path]:
        inodes = {}
        for directory in wanted:
            try:
                inodes[directory] = directory.stat().st_ino
            except OSError:
                continue
        for directory, (inode, watch) in list(table.items()):
            if inodes.get(directory) != inode:  # gone, or a new folder under the same name
                with contextlib.suppress(KeyError, OSError):  # the kernel may have dropped it already
                    self._observer.unschedule(watch)
                del table[directory]
        added = [d for d in inodes if d not in table]
        for directory in added:
            table[directory] = (inodes[directory], self._observer.schedule(
                self._handler, str(directory), recursive=recursive, event_filter=_EVENTS))
        return added

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout=5)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def notify(self, paths: Iterable[Path]) -> None:
        with self._lock:
            self._pending.update(paths)
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._wake.wait(REARM_INTERVAL):
                appeared = self._watch_taps()
                if appeared:
                    log.info("tap directory appeared: %s", ", ".join(map(str, appeared)))
                    self.notify(appeared)
                continue
            # Debounce: wait until events stop arriving for `debounce` seconds.
            while self._wake.is_set() and not self._stop.is_set():
                self._wake.clear()
                self._stop.wait(self.debounce)
            with self._lock:
                paths, self._pending = self._pending, set()
            if paths and not self._stop.is_set():
                self._watch_taps()  # first, so nothing written into a re-created tap is missed
                self.apply_changes(paths)
                self._watch_taps()

    def apply_changes(self, paths: Iterable[Path]) -> dict[str, Any]:
        """Reload what ``paths`` touched; errors are logged and shown in health, never raised."""
        relevant = [p for p in paths if p.suffix in (".toml", "") or p.is_dir() or not p.exists()]
        try:
            report = self.service.reload(changed=relevant)
        except Exception:
            log.exception("reload after file changes failed; serving the previous catalog")
            return {"error": "reload failed"}
        self.applied += 1
        log.info("reloaded after %d changed paths: %s", len(relevant), {k: v for k, v in report.items()
                                                                         if k != "errors"})
        return report
