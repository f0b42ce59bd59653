"""Live reload: a thin watchdog adapter plus a debounced :meth:`TapWatcher.apply_changes`.

The watchdog handler only records paths. A worker thread waits until no event has
arrived for ``debounce`` seconds, then calls ``apply_changes(paths)``, which reloads the
capability folders those paths belong to (``Service.reload(changed=…)``). Tests call
``apply_changes`` directly, or run a real observer end to end.

When the platform's notifications cannot be set up (on Linux: the per-user inotify instance or
watch limit reached, which editors and other watchers run into), the watcher scans the taps
instead, every :data:`POLL_INTERVAL` seconds or less often for a large tap, and says so in the log
and in health's ``errors``: edits still go live, a little later, and nothing else changes.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from watchdog import events
from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer
from watchdog.observers.polling import PollingObserver
from watchdog.utils.dirsnapshot import DirectorySnapshot

from capd.catalog import Problem
from capd.errors import Stopping
from capd.tap_config import TAP_EXAMPLES, TAP_VETOES

if TYPE_CHECKING:
    from capd.service import Service

log = logging.getLogger(__name__)

REARM_INTERVAL = 2.0  # seconds between checks that the watches match the taps on disk (a few stat calls)
POLL_INTERVAL = 2.0  # seconds between scans of the taps when notifications cannot be set up (at least)
POLL_SHARE = 0.05  # at most this share of a core spent scanning: larger taps are scanned less often

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


_ANCESTOR_EVENTS = frozenset({"created", "deleted", "moved"})  # a folder above a tap: what can take the tap along


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
        # a folder on the way to a tap, created, deleted or moved: the tap itself may have come or gone.
        # Not "modified": a folder above a tap is modified whenever anything next to the tap is created
        # or removed (a log, an editor's swap file), and the tap itself coming or going has its own event.
        if event.event_type in _ANCESTOR_EVENTS:
            inside += [tap for tap in self.taps if any(p in tap.parents for p in paths)]
        if event.event_type in ("deleted", "moved"):
            # A tap (or a folder above it) deleted or moved away takes its watch along. One created
            # again at once can get the same inode number back, which alone looked like the folder
            # still watched: its watch is made anew whatever the inode says.
            self.watcher.renew(paths)
        if inside:
            self.watcher.notify(inside)


class _Overflow(logging.Handler):
    """The kernel's event queue overflowed (tens of thousands of files changed at once, as a
    checkout of a large tap does): watchdog rebuilds its watches but reports the lost events only
    as a warning in its log, so which files changed is unknown and every tap is reloaded."""

    LOGGER = "watchdog.observers.inotify_c"  # where watchdog (7.x) logs "Inotify queue overflowed; …"

    def __init__(self, watcher: TapWatcher) -> None:
        super().__init__(logging.WARNING)
        self.watcher = watcher

    def emit(self, record: logging.LogRecord) -> None:
        if "overflow" in record.getMessage().lower():
            log.warning("live reload: file-system events were lost; reloading every tap")
            self.watcher.notify(self.watcher.taps)


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
        self._renew: set[Path] = set()  # folders deleted or moved away since: watched anew (:meth:`renew`)
        self._observing = threading.Lock()  # an observer is replaced (notifications -> polling) or stopped
        self.polling = False  # notifications could not be set up: the taps are scanned instead
        self._overflow = _Overflow(self)
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
        self._taps = [Path(t).expanduser().absolute() for t in self.service.settings.taps]
        self._handler = _Queue(self, self._taps)
        overflow = logging.getLogger(_Overflow.LOGGER)
        overflow.addHandler(self._overflow)
        if overflow.getEffectiveLevel() > logging.WARNING:  # --log-level error must not hide it from us
            overflow.setLevel(logging.WARNING)
        with self._observing:
            if self._stop.is_set():  # stopped first (a daemon stopping as it starts): nothing to watch for
                return
            try:
                if self.service.settings.watch == "poll":  # taps on a network file system: no notifications
                    self.polling = True
                    self._begin(PollingObserver(timeout=self._poll_interval()))
                else:
                    self._begin(Observer())  # the inotify watches are in place when this returns
            except OSError as exc:
                self._fall_back(exc)
            except Exception as exc:  # live reload is a convenience, never a reason not to serve
                log.exception("cannot watch the taps")
                self._off(exc)

    def _begin(self, observer: Any) -> None:
        """Watch the taps with ``observer`` (under :attr:`_observing`)."""
        self._observer, self._watches, self._above = observer, {}, {}
        self._watch_taps()
        observer.start()

    def _fall_back(self, exc: OSError) -> None:
        """The notifications could not be set up (``exc``): scan the taps instead; if that fails
        too, serve without live reload. Either way, say so (under :attr:`_observing`)."""
        self._halt(self._observer)
        self._observer = None
        if not self.polling:
            reason, every = exc.strerror or str(exc), self._poll_interval()
            log.warning("live reload: the taps' file-system notifications could not be set up (%s); scanning them "
                        "every %.3g s instead (on Linux, raise fs.inotify.max_user_instances / max_user_watches)",
                        reason, every)
            self.polling = True
            self._note(f"not watched for changes ({reason}); scanned every {every:.3g} s instead, so edits go "
                       "live a little later. On Linux, raise fs.inotify.max_user_instances / max_user_watches (sysctl)")
            try:
                self._begin(PollingObserver(timeout=every))
                return
            except Exception as again:
                self._off(again)
                return
        self._off(exc)

    def _poll_interval(self) -> float:
        """Seconds between scans: :data:`POLL_INTERVAL`, or longer for taps so large that scanning
        them that often would take more than :data:`POLL_SHARE` of a core (one scan of a generated
        10,000-capability tap, 40,000 files, takes 0.4-2.1 s here: ``benchmarks/README.md``)."""
        started = time.perf_counter()
        for tap in self._taps:
            with contextlib.suppress(OSError):
                DirectorySnapshot(str(tap), recursive=True)
        return max(POLL_INTERVAL, (time.perf_counter() - started) / POLL_SHARE)

    def _off(self, exc: Exception) -> None:
        """Serve without live reload, and say so (under :attr:`_observing`)."""
        self._halt(self._observer)
        self._observer = None
        log.error("live reload is off: the taps cannot be watched or scanned (%s)", exc)
        self._note(f"not watched for changes ({exc}): live reload is off; POST /v1/reload after an edit, or restart")

    @property
    def taps(self) -> list[Path]:
        """The taps watched, as absolute paths."""
        return list(self._taps)

    def _note(self, reason: str) -> None:
        """What health's ``errors`` says of every tap while it is not watched."""
        self.service.watch_problems = [Problem("warning", str(tap), reason, code="not-watched") for tap in self._taps]

    @staticmethod
    def _halt(observer: Any) -> None:
        """Stop ``observer``, whatever state it was left in (it may never have started)."""
        if observer is None:
            return
        with contextlib.suppress(Exception):
            observer.unschedule_all()
        with contextlib.suppress(Exception):
            observer.stop()
        if observer.is_alive():
            observer.join(timeout=5)

    def _rearm(self) -> list[Path]:
        """:meth:`_watch_taps` from the watcher's thread; a watch the notifications refuse (a tap
        that appeared after the limit was reached) turns to scanning every tap. Returns the taps
        watched anew."""
        with self._observing:
            if self._stop.is_set() or self._observer is None:
                return []
            try:
                return self._watch_taps()
            except OSError as exc:
                if self.polling:
                    log.warning("live reload: cannot scan the taps: %s", exc)
                    return []
                self._fall_back(exc)
                return [tap for tap in self._taps if tap.is_dir()] if self._observer is not None else []

    def apply(self) -> None:
        """Reload what changes touch (those recorded since :meth:`observe` first), once the
        service has started (nothing once stopped)."""
        with self._observing:  # stop() joins the thread it finds here
            if self._stop.is_set():
                return
            self._thread = threading.Thread(target=self._run, name="capd-watcher", daemon=True)
            self._thread.start()

    def renew(self, paths: Iterable[Path]) -> None:
        """``paths`` were deleted or moved away: a watched folder among them, or under one, is
        watched anew at the next check, even if a folder of that name with the same inode number
        is there by then (its watch went with the old folder)."""
        with self._lock:
            self._renew.update(paths)

    def _watch_taps(self) -> list[Path]:
        """Bring the watches in line with the file system: each existing tap recursively (again
        if it was deleted and created anew), and the nearest existing folder above each tap.
        Returns the taps that are watched anew (they appeared)."""
        with self._lock:
            renew, self._renew = self._renew, set()
        self._rewatch(self._above, {_nearest_dir(tap.parent) for tap in self._taps}, False, renew)
        return self._rewatch(self._watches, {tap for tap in self._taps if tap.is_dir()}, True, renew)

    def _rewatch(self, table: dict[Path, tuple[int, Any]], wanted: set[Path], recursive: bool,
                 renew: set[Path]) -> list[Path]:
        inodes = {}
        for directory in wanted:
            try:
                inodes[directory] = directory.stat().st_ino
            except OSError:
                continue
        for directory, (inode, watch) in list(table.items()):
            renewed = directory in renew or any(parent in renew for parent in directory.parents)
            if inodes.get(directory) != inode or renewed:  # gone, or a new folder under the same name
                with contextlib.suppress(KeyError, OSError):  # the kernel may have dropped it already
                    self._observer.unschedule(watch)
                del table[directory]
        added = []
        for directory in [d for d in inodes if d not in table]:
            try:
                watch = self._observer.schedule(self._handler, str(directory), recursive=recursive,
                                                event_filter=_EVENTS)
            except FileNotFoundError:  # gone again since the stat: the next check watches it if it is back
                continue  # (not a limit reached: scanning everything instead would be for nothing)
            table[directory] = (inodes[directory], watch)
            added.append(directory)
        return added

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        logging.getLogger(_Overflow.LOGGER).removeHandler(self._overflow)
        with self._observing:
            self._halt(self._observer)
            thread = self._thread
        if thread is not None:
            thread.join(timeout=5)

    def notify(self, paths: Iterable[Path]) -> None:
        with self._lock:
            self._pending.update(paths)
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._wake.wait(REARM_INTERVAL):
                appeared = self._rearm()
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
                paths |= set(self._rearm())  # first, so nothing written into a re-created tap is missed
                self.apply_changes(paths)
                if appeared := self._rearm():
                    self.notify(appeared)

    def apply_changes(self, paths: Iterable[Path]) -> dict[str, Any]:
        """Reload what ``paths`` touched; errors are logged and shown in health, never raised.

        Only tap files (``*.toml``, ``vetoes.jsonl``, ``examples.jsonl``, or without a suffix: a link's
        target may be named so), folders and paths that are gone count. A change to none of them (a
        log the daemon writes inside a tap, ``2> capd.log``) reloaded the taps all the same, and the
        reload's log line was a change again: a reload every debounce for as long as the daemon ran."""
        relevant = [p for p in paths if p.suffix in (".toml", "") or p.name in (TAP_VETOES, TAP_EXAMPLES) or p.is_dir()
                    or not p.exists()]
        if not relevant:
            return {}
        try:
            report = self.service.reload(changed=relevant)
        except Stopping:  # the daemon stops: nothing failed, and nothing will be served
            log.info("reload after file changes cut short: capd is stopping")
            return {"error": "stopping"}
        except Exception:
            log.exception("reload after file changes failed; serving the previous catalog")
            return {"error": "reload failed"}
        self.applied += 1
        log.info("reloaded after %d changed paths: %s", len(relevant), {k: v for k, v in report.items()
                                                                         if k != "errors"})
        return report
