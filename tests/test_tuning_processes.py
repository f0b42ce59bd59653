"""The tuning child as a process (capd/tuning.py): it dies with its parent, one process trains a
key at a time, a failure says why, and killed runs leave nothing behind. Real child processes;
the long recipes below are never run to the end (a test that lets one finish has failed)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from capd.errors import ModelError
from capd.models import manifest_for, resolve
from capd.settings import Settings
from capd.tuned_models import MARKER, is_tuned, prune, tuned_dir
from capd.tuning import Groups, run_child

ROOT = Path(__file__).resolve().parent.parent
GROUPS: Groups = [("postgres", ["run a SQL query on the database", "show the tables in postgres"]),
          ("docker", ["start a container from this image", "list running containers"]),
          ("calendar", ["schedule a meeting with Ana tomorrow", "what is on my calendar today"])]

PARENT = """
import json, sys
from pathlib import Path
from capd.tuning import Recipe, run_child
base, out, groups = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
run_child(Path(base), groups, Path(out), Recipe(epochs=5000))  # minutes: never meant to finish
"""


def wait_until(done: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)


def running(pid: int) -> bool:
    """Alive and not a zombie (a re-parented child may wait for a PID 1 that never reaps)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def tuning_children(marker: str) -> list[int]:
    """PIDs of ``python -m capd.tuning`` processes whose command line mentions ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"capd.tuning" in argv and any(marker.encode() in a for a in argv) and running(int(entry.name)):
            found.append(int(entry.name))
    return found


@pytest.fixture
def reap() -> Iterator[list[int]]:
    """PIDs to SIGKILL after the test (a child the old code let outlive its parent)."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_tuning_child_dies_with_a_killed_parent(model_settings: Settings, tmp_path: Path,
                                                     reap: list[int]) -> None:
    base = resolve(manifest_for(model_settings), model_settings.data_dir).directory
    out = tuned_dir(tmp_path / "data", "k")
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(base), str(out), json.dumps(GROUPS)], cwd=ROOT)
    try:
        wait_until(lambda: bool(tuning_children(str(out.parent))), 10, "the parent started its tuning child")
        (child,) = tuning_children(str(out.parent))
        reap.append(child)
        time.sleep(1.5)  # well into its start: the parent-death signal is armed by now
        assert running(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(5)
        wait_until(lambda: not running(child), 5, "the tuning child ended with its parent")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    assert not is_tuned(out)


def test_a_second_process_waits_for_the_key_and_uses_its_result(tmp_path: Path) -> None:
    """Another process holds the key's lock (it is tuning it): nothing is started here, and when
    the holder dies (kill -9: the kernel drops its lock) its published result is used."""
    out = tuned_dir(tmp_path, "k")
    out.parent.mkdir(parents=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time\n"
         "f = open(sys.argv[1], 'a+b'); fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)",
         str(out.with_name(".k.lock"))], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        started: list[subprocess.Popen[bytes]] = []
        result: dict[str, Any] = {}

        def tune() -> None:
            try:
                result["summary"] = run_child(tmp_path / "no-model", GROUPS, out, started=started)
            except Exception as exc:
                result["error"] = exc

        thread = threading.Thread(target=tune, daemon=True)
        thread.start()
        time.sleep(1.0)
        assert started == [] and "error" not in result  # waiting, not training a second copy
        out.mkdir()
        (out / MARKER).write_text(json.dumps({"steps": 3, "seconds": 4.2}), encoding="utf-8")
        holder.kill()
        thread.join(5)
        assert not thread.is_alive(), "never released by a dead holder"
        assert result.get("summary") == {"steps": 3, "seconds": None}, result  # nothing trained here
        assert started == []
    finally:
        holder.kill()
        holder.wait()


def test_a_failed_tuning_says_why(tmp_path: Path) -> None:
    """The child's error is the reason (a full disk shows as ENOSPC, not just "exit 1")."""
    with pytest.raises(ModelError, match="at least two capabilities") as caught:
        run_child(tmp_path / "no-model", GROUPS[:1], tuned_dir(tmp_path, "k"))
    assert "exit 1" not in str(caught.value)


PUBLISH_THEN_DIE = """
import json, os, signal, sys
from pathlib import Path
spec = json.loads(Path(sys.argv[1]).read_text())
out = Path(spec["out"])
out.mkdir()
(out / "capd-tuned.json").write_text(json.dumps({"steps": 1, "seconds": 0.1}))
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_child_killed_after_publishing_counts_as_done(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_popen = subprocess.Popen

    def popen(argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:  # the same child, killed after publishing
        spec = next(a for a in argv if a.endswith(".spec.json"))
        return real_popen([sys.executable, "-c", PUBLISH_THEN_DIE, spec], **kwargs)

    monkeypatch.setattr(subprocess, "Popen", popen)
    out = tuned_dir(tmp_path, "k")
    assert run_child(tmp_path / "no-model", GROUPS, out) == {"steps": 1, "seconds": 0.1}
    assert is_tuned(out)


def test_leftovers_of_killed_runs_are_swept(tmp_path: Path) -> None:
    root = tmp_path / "tuned"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead = int(gone.stdout)
    keep = tuned_dir(tmp_path, "k0")
    keep.mkdir(parents=True)
    (keep / MARKER).write_text("{}", encoding="utf-8")
    (root / f".k1.{dead}.tmp").mkdir()  # a child killed while saving
    (root / f".k1.{dead}.spec.json").write_text("{}", encoding="utf-8")  # a parent killed while tuning
    (root / f".k2.{os.getpid()}.tmp").mkdir()  # a run in progress
    (root / f".k2.{os.getpid()}.spec.json").write_text("{}", encoding="utf-8")
    prune(tmp_path, "k0")
    assert sorted(p.name for p in root.iterdir()) == sorted(
        [f".k2.{os.getpid()}.tmp", f".k2.{os.getpid()}.spec.json", "k0"])
