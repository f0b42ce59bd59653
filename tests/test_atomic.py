from __future__ import annotations

import threading
from pathlib import Path

import pytest

from capd import atomic


def test_a_write_replaces_the_file_and_leaves_nothing_beside_it(tmp_path: Path) -> None:
    target = tmp_path / "gates.json"
    target.write_text("old", encoding="utf-8")
    target.chmod(0o640)
    atomic.write_text(target, "new")
    assert target.read_text(encoding="utf-8") == "new"
    assert target.stat().st_mode & 0o777 == 0o640  # the replaced file's mode is kept
    assert [p.name for p in tmp_path.iterdir()] == ["gates.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "head.npz"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic.replacing(target) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("the fit failed")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["head.npz"]


def test_concurrent_writers_never_leave_a_mixed_file(tmp_path: Path) -> None:
    """Writers of one file (a daemon and ``capd eval`` fitting the same head) each finish whole:
    a reader sees one writer's bytes, never a mix. With one shared temporary name, writers
    truncated and appended to one file and readers saw zips with bad CRCs."""
    target = tmp_path / "head.bin"
    payloads = [bytes([n]) * 2_000_000 for n in range(4)]
    seen: list[bytes] = []
    errors: list[BaseException] = []

    def write(payload: bytes) -> None:
        try:
            for _ in range(15):
                with atomic.replacing(target) as tmp, tmp.open("wb") as handle:
                    for start in range(0, len(payload), 65_536):  # many small writes: room to interleave
                        handle.write(payload[start:start + 65_536])
        except OSError as exc:  # reported by the main thread
            errors.append(exc)

    writers = [threading.Thread(target=write, args=(p,)) for p in payloads]
    for writer in writers:
        writer.start()
    while any(w.is_alive() for w in writers):
        if target.exists():
            seen.append(target.read_bytes())
    for writer in writers:
        writer.join()
    seen.append(target.read_bytes())
    assert errors == []
    assert seen and all(data in payloads for data in seen)
    assert [p.name for p in tmp_path.iterdir()] == ["head.bin"]


def test_the_new_contents_reach_the_disk_before_the_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without an fsync of the temporary file, a power cut after the rename could leave an empty file
    where a tap's capd.toml was. The order of the system calls is what the file system honours."""
    import os

    calls: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        calls.append("fsync " + Path(os.readlink(f"/proc/self/fd/{fd}")).name)
        real_fsync(fd)

    def replace(src: str | Path, dst: str | Path) -> None:
        calls.append("replace " + Path(src).name)
        real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    monkeypatch.setattr(atomic.os, "replace", replace)
    target = tmp_path / "capd.toml"
    target.write_text("[gates]\nthreshold = 0.4\n")
    atomic.write_text(target, "[gates]\nthreshold = 0.5\n")
    assert target.read_text() == "[gates]\nthreshold = 0.5\n"
    assert [c.split()[0] for c in calls] == ["fsync", "replace"] and calls[0].split()[1] == calls[1].split()[1]
