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


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts open files in /proc")
def test_a_tuning_run_leaves_no_file_descriptor_open(tmp_path: Path) -> None:
    """Each run kept the pipe of its child's stderr open for as long as the process ran: a daemon
    retuning after every tap edit leaked one file descriptor per edit."""
    started: list[subprocess.Popen[bytes]] = []  # kept, as the daemon's tuner keeps its children

    def runs(keys: range) -> None:
        for i in keys:
            with pytest.raises(ModelError):
                run_child(tmp_path / "no-model", GROUPS, tuned_dir(tmp_path, f"k{i}"), started=started)

    runs(range(1))  # first use: whatever the process opens once
    before = len(os.listdir("/proc/self/fd"))
    runs(range(1, 4))
    assert len(os.listdir("/proc/self/fd")) <= before  # fewer when something else in the process closed one


def test_a_failed_tuning_says_why(tmp_path: Path) -> None:
    """The child's error is the reason (a full disk shows as ENOSPC, not just "exit 1")."""
    with pytest.raises(ModelError, match="at least two capabilities") as caught:
        run_child(tmp_path / "no-model", GROUPS[:1], tuned_dir(tmp_path, "k"))
    assert "exit 1" not in str(caught.value)


def test_a_data_directory_that_cannot_hold_tuned_models_is_said_plainly(tmp_path: Path) -> None:
    """It was a bare ``[Errno 1] Operation not permitted: '.../tuned'`` (read-only or immutable data
    directory); a file where the folder goes fails the same way, for any user."""
    (tmp_path / "tuned").write_text("a file where the tuned models' folder goes")
    expected = r"cannot create .*tuned for tuned models \(File exists\); make the data directory writable"
    with pytest.raises(ModelError, match=expected):
        run_child(tmp_path / "no-model", GROUPS, tuned_dir(tmp_path, "k"))


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


FILL_DISK_THEN_FAIL = """
import json, os, sys
from pathlib import Path
out = Path(json.loads(Path(sys.argv[1]).read_text())["out"])
scratch = out.with_name(f".{out.name}.{os.getpid()}.tmp")  # where train() saves, as the child
scratch.mkdir()
(scratch / "model.safetensors").write_bytes(b"w" * 1000)  # the weights fit; the tokenizer did not
sys.stderr.write("capd tuning: error: No space left on device (os error 28)\\n")
sys.exit(1)
"""


def test_a_failed_tuning_removes_its_half_written_copy_at_once(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk: the child's ~90 MB half-saved copy stayed in tuned/ (keeping the disk full)
    until some later tuning swept it, and a daemon does not retune a key that failed."""
    real_popen = subprocess.Popen

    def popen(argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        spec = next(a for a in argv if a.endswith(".spec.json"))
        return real_popen([sys.executable, "-c", FILL_DISK_THEN_FAIL, spec], **kwargs)

    monkeypatch.setattr(subprocess, "Popen", popen)
    out = tuned_dir(tmp_path, "k")
    with pytest.raises(ModelError, match=r"No space left on device"):
        run_child(tmp_path / "no-model", GROUPS, out)
    assert sorted(p.name for p in out.parent.iterdir()) == [".k.lock"]


def test_a_full_disk_while_saving_says_so_without_a_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """safetensors reports ENOSPC as its own SafetensorError, not an OSError: the child printed
    a traceback for it, as for a bug in capd, into the daemon's log."""
    from safetensors import SafetensorError

    import capd.tuning as tuning

    def full_disk(*_: Any, **__: Any) -> dict[str, Any]:
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(tuning, "train", full_disk)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"base": "b", "out": str(tmp_path / "k"), "groups": GROUPS}), encoding="utf-8")
    assert tuning.main([str(spec)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.endswith(f"{tuning.ERROR_PREFIX}Error while serializing: I/O error: No space left on device "
                        "(os error 28)\n")


def test_a_killed_tuning_child_says_it_was_killed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The out-of-memory killer (or a kill -9) ends the child without an error line: the reason
    was "exit -9"."""
    real_popen = subprocess.Popen

    def popen(argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        return real_popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
                          **kwargs)

    monkeypatch.setattr(subprocess, "Popen", popen)
    with pytest.raises(ModelError, match=r"^tuning failed \(killed by SIGKILL\); "):
        run_child(tmp_path / "no-model", GROUPS, tuned_dir(tmp_path, "k"))


WAIT_FOR_KEY = """
import sys
from pathlib import Path
from capd.tuning import key_lock
with key_lock(Path(sys.argv[1])):
    print("got it", flush=True)
"""


def test_a_process_waiting_for_another_ones_tuning_says_so(tmp_path: Path) -> None:
    """A second `capd tune` on one data directory waited minutes without a word: the notice was
    logged at INFO, which the CLI does not show."""
    import fcntl
    import select

    out = tuned_dir(tmp_path, "k")
    out.parent.mkdir(parents=True)
    with open(out.with_name(".k.lock"), "a+b") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        waiter = subprocess.Popen([sys.executable, "-c", WAIT_FOR_KEY, str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        try:
            assert waiter.stderr is not None and waiter.stdout is not None
            assert select.select([waiter.stderr], [], [], 10)[0], "nothing said while waiting"
            assert "another process is tuning k; waiting for its result" in waiter.stderr.readline()
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
    try:
        assert waiter.stdout.readline() == "got it\n"
    finally:
        waiter.kill()
        waiter.wait()
