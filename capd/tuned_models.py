"""Tuned models in the data directory: ``<data>/tuned/<key>/``, one per tap state.

A directory is a tuned model once its :data:`MARKER` exists (training writes it last); its
mtime is the model's last use. A process routing with a model holds a shared lock on
``tuned/.KEY.inuse`` (:class:`InUse`); :func:`prune` (after every switch: the
:data:`RETAIN` most recently used are kept) and :func:`remove` (``capd tune --remove``) never
touch a model someone holds, and remove its ONNX export with it. :func:`sweep` clears what
interrupted training runs (:mod:`capd.tuning`) left behind. ``capd tune --list`` is
:func:`listing` and :func:`leftovers`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

from capd.atomic import flocked, process_alive, write_text
from capd.errors import CapdError

log = logging.getLogger(__name__)

MARKER = "capd-tuned.json"  # written last: a directory without it is not a tuned model
RETAIN = 3  # tuned models kept in a data directory (the most recently used)
LEFTOVER = re.compile(r"\.(?P<key>[^.]+)\.(?P<pid>\d+)\.(?:tmp|spec\.json)")  # an interrupted run's scratch


def tuned_dir(data_dir: Path, key: str) -> Path:
    return data_dir / "tuned" / key


def is_tuned(directory: Path) -> bool:
    return (directory / MARKER).is_file()


def set_aside(directory: Path, why: str) -> Path | None:
    """Move a tuned model that cannot be loaded to ``<key>.broken-<stamp>`` (kept for a look, never
    loaded; prune removes it in time like any older model) so that the key is tuned again; None
    if it cannot be moved."""
    stamp = f"{directory.name}.broken-{time.strftime('%Y%m%d-%H%M%S')}"
    for attempt in range(1, 100):  # a second set-aside of the key within the same second gets its own name
        aside = directory.with_name(stamp if attempt == 1 else f"{stamp}-{attempt}")
        if aside.exists():
            continue
        try:
            directory.rename(aside)
            break
        except OSError as exc:
            log.warning("cannot set aside the damaged tuned model %s: %s", directory, exc)
            return None
    else:
        log.warning("cannot set aside the damaged tuned model %s: too many set aside this second", directory)
        return None
    log.warning("tuned model %s is unusable (%s); moved it to %s and tuning again", directory, why, aside)
    return aside


def _lineage_file(data_dir: Path, lineage: str) -> Path:
    return data_dir / "tuned" / f".lineage-{lineage}"


def remember(data_dir: Path, lineage: str, key: str) -> None:
    """Record ``key`` as the tuned model a process last routed with for ``lineage`` (a base model
    and a list of taps: :func:`capd.tuner.lineage_for`), for :func:`remembered`. Best effort."""
    try:
        write_text(_lineage_file(data_dir, lineage), key + "\n")
    except OSError as exc:
        log.warning("cannot record the tuned model in use (%s): a restart after a tap edit will route "
                    "untuned until the tuning is done", exc)


def remembered(data_dir: Path, lineage: str) -> str | None:
    """The tuned model last routed with for ``lineage``, if it is still a complete one."""
    if not lineage:
        return None
    try:
        key = _lineage_file(data_dir, lineage).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return key if key and "/" not in key and not key.startswith(".") and is_tuned(tuned_dir(data_dir, key)) \
        else None


def sweep(root: Path) -> list[Path]:
    """Remove the scratch directories (``.KEY.PID.tmp``) and specs (``.KEY.PID.spec.json``) of
    tuning runs whose process is gone (killed while saving, a full disk, a killed daemon)."""
    removed = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return []
    for entry in entries:
        match = LEFTOVER.fullmatch(entry.name)
        if match is None or process_alive(int(match["pid"])):
            continue
        try:
            _delete_leftover(entry)
            removed.append(entry)
        except OSError as exc:
            log.warning("cannot remove the leftover of an interrupted tuning run %s: %s", entry, exc)
    return removed


def _delete_leftover(entry: Path) -> None:
    """Remove one leftover (:data:`LEFTOVER`): a scratch directory or a spec file. Raises OSError."""
    if entry.is_dir():
        shutil.rmtree(entry)
    else:
        entry.unlink()


def leftovers(data_dir: Path) -> list[dict[str, Any]]:
    """The scratch of tuning runs under ``tuned/`` (:data:`LEFTOVER`), for ``capd tune --list``:
    name, path, size on disk, the writing process's pid and whether it is still running (if not,
    the next tuning run or ``capd tune --remove NAME`` removes it)."""
    try:
        entries = sorted((data_dir / "tuned").iterdir())
    except OSError:
        return []
    rows = []
    for entry in entries:
        match = LEFTOVER.fullmatch(entry.name)
        if match is None:
            continue
        try:
            files = [entry] if not entry.is_dir() else [f for f in entry.rglob("*") if f.is_file()]
            size = sum(f.stat().st_size for f in files)
        except OSError:
            continue  # removed meanwhile
        pid = int(match["pid"])
        rows.append({"name": entry.name, "path": str(entry), "bytes": size, "pid": pid, "running": process_alive(pid)})
    return rows


def _remove_leftover(entry: Path, pid: int) -> Path:
    """``capd tune --remove .KEY.PID.tmp``: a leftover whose process ``pid`` is gone (:func:`leftovers`)."""
    if process_alive(pid):
        raise CapdError(f"{entry} is being written by a running tuning run (pid {pid}); "
                        "it is removed when that run ends")
    try:
        _delete_leftover(entry)
    except FileNotFoundError:
        pass  # its run, or another process sweeping, removed it first
    except OSError as exc:
        raise CapdError(f"cannot remove {entry}: {exc}") from exc
    return entry


def _in_use_path(directory: Path) -> Path:
    return directory.with_name(f".{directory.name}.inuse")


class InUse:
    """A shared hold on the tuned model in ``directory`` while this process routes with it:
    :func:`prune` and :func:`remove` leave it alone until :meth:`release`, which also marks it
    as used now (so "last used" means the last moment anyone routed with it). Without a
    writable ``tuned/`` the model is still used, only unprotected (logged)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        try:
            self._handle = flocked(_in_use_path(directory), fcntl.LOCK_SH)
        except OSError as exc:
            self._handle = None
            log.warning("cannot mark the tuned model %s as in use (other processes may prune it): %s",
                        directory, exc)

    def release(self) -> None:
        if self._handle is None:
            return
        with contextlib.suppress(OSError):
            os.utime(self.directory / MARKER)
        self._handle.close()  # closing the file drops the lock
        self._handle = None


def in_use(directory: Path) -> bool:
    """Whether some process holds the tuned model in ``directory`` (:class:`InUse`); creates nothing."""
    try:
        with open(_in_use_path(directory), "rb") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # dropped as the file closes
    except BlockingIOError:
        return True
    except OSError:  # no lock file: nobody ever held it
        return False
    return False


def _delete(data_dir: Path, directory: Path) -> bool:
    """Remove a tuned model and its ONNX export unless a process holds it (False then).
    Raises OSError when it cannot be removed; one already gone counts as removed."""
    from capd.model_weights import sha256_file
    from capd.onnx_export import onnx_dir

    handle = flocked(_in_use_path(directory), fcntl.LOCK_EX | fcntl.LOCK_NB)
    if handle is None:
        return False
    try:
        weights = directory / "model.safetensors"
        try:
            if weights.is_file():
                shutil.rmtree(onnx_dir(data_dir, sha256_file(weights)), ignore_errors=True)
            shutil.rmtree(directory)
        except FileNotFoundError:  # another process sharing the data directory removed it first
            pass
        for suffix in (".lock", ".inuse"):
            directory.with_name(f".{directory.name}{suffix}").unlink(missing_ok=True)
    finally:
        handle.close()
    return True


def prune(data_dir: Path, keep: str, retain: int = RETAIN) -> list[Path]:
    """Mark ``keep`` as just used and remove all but the ``retain`` most recently used tuned
    models (and their ONNX exports), sparing any a process is routing with; returns what went.

    Several capd processes may share a data directory (a daemon, ``capd eval`` on another
    tap), so the models of the last few tap states are kept rather than only the current one.
    """
    root = data_dir / "tuned"
    sweep(root)
    try:
        os.utime(root / keep / MARKER)
    except OSError as exc:
        log.warning("cannot mark the tuned model %s as used: %s", root / keep, exc)
        return []
    found = sorted((d for d, _ in _by_use(root)), key=lambda d: d.name == keep, reverse=True)  # stable: by use
    removed = []
    for directory in found[max(retain, 1):]:
        try:
            if _delete(data_dir, directory):
                removed.append(directory)
        except OSError as exc:
            log.warning("cannot remove the superseded tuned model %s: %s", directory, exc)
    return removed


def remove(data_dir: Path, name: str) -> Path:
    """``capd tune --remove NAME``: remove the tuned model whose directory under ``tuned/`` is
    ``name`` or the one that starts with it (its ONNX export too), or the leftover of an
    interrupted tuning run named exactly (:func:`leftovers`); returns its path. Raises CapdError
    for no match, several matches, a model a running process routes with, or a leftover whose run
    is still going."""
    root = data_dir / "tuned"
    leftover = LEFTOVER.fullmatch(name)
    if leftover is not None and (root / name).exists():  # named exactly, as --list shows it
        return _remove_leftover(root / name, int(leftover["pid"]))
    names = [d.name for d, _ in _by_use(root)]
    matches = [n for n in names if n == name] or [n for n in names if name and n.startswith(name)]
    if not matches:
        raise CapdError(f"no tuned model {name!r} in {root} (capd tune --list shows them)")
    if len(matches) > 1:
        raise CapdError(f"{name!r} names {len(matches)} tuned models ({', '.join(sorted(matches))}); "
                        "give more of the key")
    directory = root / matches[0]
    try:
        if not _delete(data_dir, directory):
            raise CapdError(f"the tuned model {directory} is in use by a running capd process; "
                              "stop it, or change its taps, first")
    except OSError as exc:
        raise CapdError(f"cannot remove the tuned model {directory}: {exc}") from exc
    return directory


def _used(directory: Path) -> float | None:
    """When a tuned model was last used (its marker's mtime); None if it is not a complete one, or
    is gone (another process pruned it meanwhile)."""
    try:
        return (directory / MARKER).stat().st_mtime
    except OSError:
        return None


def listing(data_dir: Path) -> list[dict[str, Any]]:
    """The complete tuned models in ``data_dir``, most recently used first: key, path, last use
    (the marker's mtime, which :func:`prune` goes by), size on disk, whether a process is routing
    with it now, and the training summary."""
    rows = []
    for directory, when in _by_use(data_dir / "tuned"):
        try:
            summary = json.loads((directory / MARKER).read_text(encoding="utf-8"))
            size = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
        except (OSError, ValueError):
            continue  # removed meanwhile, or not readable: not a model anyone can use
        rows.append({"key": directory.name, "path": str(directory), "last_used": when, "bytes": size,
                     "in_use": in_use(directory),
                     **{k: summary.get(k) for k in ("capabilities", "examples", "steps", "seconds")}})
    return rows


def _by_use(root: Path) -> list[tuple[Path, float]]:
    """Complete tuned models under ``root`` with their last use, most recent first."""
    try:
        entries = [d for d in root.iterdir() if not d.name.startswith(".")]
    except OSError:
        return []
    used = [(d, when) for d in entries if (when := _used(d)) is not None]
    return sorted(used, key=lambda item: item[1], reverse=True)
