"""Replacing a file at once, safe against readers and against other writers.

Every file capd writes outside SQLite (fitted heads, auto gates, model stamps, the ONNX export, a
tap's ``capd.toml``) is written to a temporary file beside it and then renamed over it, so a reader
sees the old file or the new one, never half of one. The temporary name is unique per write: two
processes that fit the same head at once (a daemon and a ``capd eval`` on one data directory) each
write their own file, and the last rename wins. With one shared temporary name their writes
interleaved in one file, and a reader got a zip with a bad CRC. A temporary left by a killed
writer is recognised by the dead process id in its name (:func:`process_alive`).
Lock files that several processes hold (a tuned model in use, a daemon's sessions) go through
:func:`flocked`.
"""

from __future__ import annotations

import fcntl
import os
import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import BinaryIO


@contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """Yield a fresh temporary path beside ``path``; on a clean exit it replaces ``path``.

    The temporary file is created as a plain write would create it (mode 0666 less the umask);
    the new file keeps the mode of the file it replaces. On an exception the temporary file is
    removed and ``path`` is untouched. The new contents are flushed to disk before the rename.
    Raises OSError when the directory cannot be written.
    """
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        yield tmp
        with suppress(FileNotFoundError):  # a new file keeps the mode it was created with
            tmp.chmod(path.stat().st_mode & 0o7777)
        _flush_to_disk(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _flush_to_disk(path: Path) -> None:
    """The file's contents on disk before it is renamed over the old one: after a power cut the
    rename may have reached the disk and the data not, leaving an empty file where a tap's
    ``capd.toml`` was (file systems order the two only with this)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` (UTF-8) at once (:func:`replacing`)."""
    with replacing(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_with(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Replace ``path`` at once (:func:`replacing`) with what ``write`` writes to an open binary
    handle (a handle, not a name: ``numpy.savez`` would append ``.npz`` to a name), creating its
    directory first. Raises OSError when the directory cannot be written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path) as tmp, tmp.open("wb") as handle:
        write(handle)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (someone else's counts): a temporary file or directory
    whose name carries a PID that is gone was left by a killed writer and may be removed."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def flocked(path: Path, mode: int) -> BinaryIO | None:
    """``path`` (created if missing) opened and ``flock``-ed in ``mode``; the lock lasts while the
    returned file stays open. None when ``mode`` has ``LOCK_NB`` and another holds it. A lock file
    its remover unlinks while holding it must not leave us locking the unlinked copy, so the lock
    taken is checked to be on the file still at ``path``; otherwise it is opened again. Raises
    OSError when the file cannot be opened."""
    while True:
        handle = open(path, "a+b")  # noqa: SIM115 - the caller keeps it open: that is the lock
        try:
            fcntl.flock(handle, mode)
        except BlockingIOError:
            handle.close()
            return None
        try:
            same = os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return handle
        handle.close()
