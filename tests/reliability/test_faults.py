"""Faults: kill -9 under heavy writes, taps vanishing while serving, an unwritable or full data
directory, and a hundred capability files edited at once while the watcher runs."""

from __future__ import annotations

import copy
import errno
import os
import random
import shutil
import sqlite3
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from capd.taps import load_catalog
from tests.reliability.harness import (
    FLEET,
    FLEET_BY_NAME,
    DaemonFactory,
    fleet_tap,
    plain_tap,
    sized,
    wait_until,
    write_config,
)
from tests.reliability.sessionmodel import SessionModel, normalize, state_snapshot

pytestmark = pytest.mark.reliability

MAX_ACTIVE = 3
ENV = {"CAPD_MAX_ACTIVE": str(MAX_ACTIVE), "CAPD_LOG_LEVEL": "info"}


def _model(session: str) -> SessionModel:
    return SessionModel(session, FLEET_BY_NAME, MAX_ACTIVE)


def _clone(model: SessionModel) -> SessionModel:
    return copy.deepcopy(model, {id(model.caps): model.caps})


def _write(http: httpx.Client, trial: SessionModel, rng: random.Random) -> None:
    """One random write (enable / disable / tool-result) on ``trial``'s session. ``trial`` is first moved to
    the state the write predicts, then the request goes out: if no answer comes (httpx.TransportError),
    ``trial`` is what the session may have become; if one comes, it must be the predicted one."""
    roll, name = rng.random(), rng.choice(FLEET).name
    session = trial.session
    expected: dict[str, Any] | None = None
    bumped: list[str] | None = None
    if roll < 0.5 or not trial.exists:
        status, expected = trial.expect_enable(name)
        response = http.post(f"/v1/sessions/{session}/enable", json={"name": name})
    elif roll < 0.8:
        status, expected = trial.expect_disable(name)
        response = http.post(f"/v1/sessions/{session}/disable", json={"name": name})
    else:
        server, tool = rng.choice([(s.name, t) for c in FLEET for s in c.servers for t in s.tools])
        status, bumped = trial.expect_tool_result(server, tool, True)
        response = http.post(f"/v1/sessions/{session}/tool-result", json={"server": server, "tool": tool, "ok": True})
    assert response.status_code == status, (session, response.status_code, response.text)
    if expected is not None:
        assert normalize(response.json()) == expected, (session, response.json(), expected)
    if bumped is not None:
        assert response.json()["bumped"] == bumped, (session, response.json(), bumped)


def _step(http: httpx.Client, models: dict[str, SessionModel], session: str, rng: random.Random) -> None:
    trial = _clone(models[session])
    _write(http, trial, rng)
    models[session] = trial


# -- kill -9 under heavy writes ------------------------------------------------------------------------

@dataclass
class Storm:
    """Writers on their own sessions until the daemon dies; what was acknowledged, and what was in flight."""

    models: dict[str, SessionModel]
    inflight: dict[str, SessionModel] = field(default_factory=dict)
    acks: int = 0
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def writer(self, url: str, sessions: list[str], seed: int, deadline: float) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=url, timeout=10) as http:
            while time.monotonic() < deadline:
                session = rng.choice(sessions)
                trial = _clone(self.models[session])
                try:
                    _write(http, trial, rng)
                except httpx.TransportError:
                    self.inflight[session] = trial
                    return
                except AssertionError as exc:
                    with self.lock:
                        self.errors.append(f"{session}: {exc}")
                    return
                with self.lock:
                    self.models[session] = trial
                    self.acks += 1


def _grow_tap(tap: Path, prefix: str, count: int, stop: threading.Event) -> None:
    """New capabilities, so the watcher keeps embedding and writing the vector cache during the storm."""
    for i in range(count):
        if stop.is_set():
            return
        directory = tap / "capabilities" / f"{prefix}-{i:03d}"
        directory.mkdir()
        write_config(directory, [f"{prefix} extra capability {i} alpha", f"{prefix} extra capability {i} beta"])
        stop.wait(0.4 if i % 3 == 2 else 0.01)  # bursts, with pauses longer than the watcher's debounce


def _check_sqlite(path: Path) -> None:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",), path
    db.close()


def test_kill_9_during_heavy_writes(tmp_path: Path, daemon_factory: DaemonFactory) -> None:
    tap = fleet_tap(tmp_path)
    daemon = daemon_factory([tap], env=ENV)
    writers, per_writer = sized(6, 16), sized(3, 4)
    sessions = [f"w{w}-s{s}" for w in range(writers) for s in range(per_writer)]
    models = {s: _model(s) for s in sessions}
    for cycle in range(sized(1, 4)):
        storm = Storm(models)
        stop = threading.Event()
        deadline = time.monotonic() + 60
        threads = [threading.Thread(target=storm.writer, args=(daemon.url, sessions[w::writers], 100 * cycle + w,
                                                                deadline)) for w in range(writers)]
        threads.append(threading.Thread(target=_grow_tap, args=(tap, f"c{cycle}", sized(30, 80), stop)))
        for thread in threads:
            thread.start()
        target, grown = sized(150, 1500), len(load_catalog([tap])) + 6

        def busy(storm: Storm = storm, target: int = target, grown: int = grown) -> bool:
            health = daemon.health() or {"capabilities": 0}
            return bool(storm.errors) or (storm.acks >= target and health["capabilities"] >= grown)

        assert wait_until(busy, 60)
        daemon.kill9()  # writers are mid-request
        stop.set()
        for thread in threads:
            thread.join(30)
            assert not thread.is_alive()
        assert not storm.errors, storm.errors
        assert storm.inflight, "the kill should have caught writes in flight"
        for name in ("sessions.sqlite3", "vectors.sqlite3"):
            _check_sqlite(daemon.data_dir / name)

        health = daemon.start().wait_ready()
        assert health["ready"] and health["errors"] == []
        assert health["embedded"] + health["cached"] == health["triggers"]  # the cache is intact or rebuilt
        assert health["capabilities"] == len(load_catalog([tap]))
        with daemon.client() as http:
            for session in sessions:
                response = http.get(f"/v1/sessions/{session}")
                acked = models[session].snapshot() if models[session].exists else None  # the last acknowledged
                maybe = storm.inflight.get(session)
                if response.status_code == 404:
                    assert acked is None, f"{session}: acknowledged writes lost"
                    models[session] = _model(session)
                    continue
                state = response.json()
                got = state_snapshot(state)
                assert got == acked or (maybe is not None and got == maybe.snapshot()), (session, got, acked)
                models[session] = SessionModel.from_state(state, FLEET_BY_NAME, MAX_ACTIVE)
        print(f"\nkill -9 cycle {cycle}: {storm.acks} writes acknowledged, {len(storm.inflight)} in flight at the "
              f"kill, {health['embedded']} trigger texts re-embedded, {health['cached']} from the cache")

    assert daemon.stop() is not None
    warm = daemon.start().wait_ready()
    assert warm["embedded"] == 0 and warm["cached"] == warm["triggers"]  # a clean restart: all from the cache
    assert "Traceback" not in daemon.log_text()


# -- taps vanishing while serving --------------------------------------------------------------------

def test_tap_directory_renamed_then_deleted_while_serving(tmp_path: Path, daemon_factory: DaemonFactory) -> None:
    tap, other = fleet_tap(tmp_path), plain_tap(tmp_path, 5)
    daemon = daemon_factory([tap, other], env=ENV)
    backup = tmp_path / "backup"
    shutil.copytree(tap, backup, symlinks=True)
    with daemon.client() as http:
        before = http.get("/v1/capabilities").json()["capabilities"]
        for how in ("rename", "delete"):
            if how == "rename":
                tap.rename(tmp_path / "renamed")
            else:
                shutil.rmtree(tap)
            assert wait_until(lambda: any(e["file"] == str(tap) and "missing" in e["reason"]
                                          for e in http.get("/v1/health").json()["errors"]), 15), how
            assert http.get("/v1/capabilities").json()["capabilities"] == before  # the last good catalog
            session = f"v-{how}"
            routed = http.post("/v1/route", json={"session": session, "message": "query the postgres database"})
            assert routed.json()["decision"] == "activate" and routed.json()["capability"] == "db-postgres"
            assert http.post(f"/v1/sessions/{session}/enable", json={"name": "k8s"}).status_code == 200
            assert http.post("/v1/reload").status_code == 200  # an explicit reload keeps serving too
            assert http.get("/v1/capabilities").json()["capabilities"] == before

            if how == "rename":
                (tmp_path / "renamed").rename(tap)
            else:
                shutil.copytree(backup, tap, symlinks=True)
            assert wait_until(lambda: http.get("/v1/health").json()["errors"] == [], 15), how
            late = f"late-{how}"
            write_config(_mkdir(tap / "capabilities" / late), [f"a capability added after the {how}"])
            assert wait_until(lambda late=late: any(c["name"] == late for c in
                                                    http.get("/v1/capabilities").json()["capabilities"]), 15), how
            before = http.get("/v1/capabilities").json()["capabilities"]
            state = http.get(f"/v1/sessions/{session}").json()
            assert [a["name"] for a in state["active"]] == ["db-postgres", "k8s"]
    assert "Traceback" not in daemon.log_text()


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


# -- an unwritable or full data directory ------------------------------------------------------------

def _chattr(flag: str, *paths: Path) -> bool:
    done = subprocess.run(["chattr", flag, *map(str, paths)], capture_output=True, check=False)
    return done.returncode == 0


def _writable(directory: Path) -> bool:
    probe = directory / ".probe"
    try:
        probe.write_bytes(b"x")
    except OSError:
        return False
    probe.unlink()
    return True


@contextmanager
def _immutable(data: Path) -> Iterator[None]:
    """Make the data directory and its SQLite files immutable (chmod does not stop root). Not the ``-shm``
    files: SQLite maps them into memory, and writing to a mapped immutable file is SIGBUS, not an error."""
    if shutil.which("chattr") is None:
        pytest.skip("chattr is not available to make the data directory unwritable for root")
    files = [data / n for n in ("sessions.sqlite3", "sessions.sqlite3-wal", "vectors.sqlite3", "vectors.sqlite3-wal")]
    targets = [data, *(f for f in files if f.exists())]
    try:
        if not _chattr("+i", *targets) or _writable(data):
            pytest.skip("cannot make the data directory immutable here (chattr +i refused)")
        yield
    finally:
        _chattr("-i", *targets)


@contextmanager
def _filled(data: Path) -> Iterator[None]:
    """Fill the (small tmpfs) data directory to the last byte; free it again afterwards."""
    filler = data / "filler"
    with filler.open("wb", buffering=0) as out:  # unbuffered: nothing left to flush into a full disk
        try:
            for _ in range(4096):
                out.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
        else:
            raise AssertionError("the data directory did not fill up")
    try:
        yield
    finally:
        filler.unlink()


@contextmanager
def _tmpfs(path: Path, size: str) -> Iterator[None]:
    path.mkdir(parents=True)
    # mode 0700: a tmpfs root is 1777, which capd refuses as a data directory every user may write to
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                          capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill up: {done.stderr.decode().strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def _state_error(http: httpx.Client) -> list[dict[str, Any]]:
    return [e for e in http.get("/v1/health").json()["errors"] if e["file"].endswith("sessions.sqlite3")]


def _learned_error(http: httpx.Client) -> str | None:
    errors = [e["reason"] for e in http.get("/v1/health").json()["errors"] if e["file"].endswith("learned.sqlite3")]
    return errors[0] if errors else None


def _correct(http: httpx.Client, session: str, message: str) -> str:
    """Route ``message`` in ``session``, then enable by hand a capability it did not choose: a learned
    correction (capd/learned.py). Returns the capability enabled."""
    routed = http.post("/v1/route", json={"session": session, "message": message}).json()
    taught = "k8s" if routed.get("capability") != "k8s" else "db-sync"
    assert http.post(f"/v1/sessions/{session}/enable", json={"name": taught}).status_code == 200
    return taught


@pytest.mark.parametrize("how", ["immutable", "full"])
def test_unwritable_data_dir_while_serving(tmp_path: Path, daemon_factory: DaemonFactory, how: str) -> None:
    tap, data = fleet_tap(tmp_path), tmp_path / "data"
    with _tmpfs(data, "2m") if how == "full" else nullcontext():
        daemon = daemon_factory([tap], data_dir=data, env=ENV)
        rng = random.Random(11)
        models = {s: _model(s) for s in ("ro-a", "ro-b", "ro-c")}
        with daemon.client() as http:
            for _ in range(10):
                _step(http, models, rng.choice(list(models)), rng)
            with _immutable(data) if how == "immutable" else _filled(data):
                for _ in range(sized(20, 200)):  # every write keeps being served, from memory, with the predicted plan
                    _step(http, models, rng.choice(list(models)), rng)
                errors = _state_error(http)
                assert errors and "cannot write session state" in errors[0]["reason"], errors
                assert "kept in memory only" in daemon.log_text()
                for session, model in models.items():
                    assert state_snapshot(http.get(f"/v1/sessions/{session}").json()) == model.snapshot()
                # The tap changes meanwhile: the new trigger vectors cannot be cached, and are served anyway.
                write_config(_mkdir(tap / "capabilities" / "while-unwritable"), ["a capability added while full"])
                assert wait_until(lambda: any(c["name"] == "while-unwritable"
                                              for c in http.get("/v1/capabilities").json()["capabilities"]), 15)
                routed = http.post("/v1/route", json={"message": "a capability added while full"}).json()
                assert routed["capability"] == "while-unwritable"
                if how == "full":  # a correction the full disk will not take is routed with from memory
                    taught = _correct(http, "learn", "the thing with the boxes is slow again")
                    assert wait_until(lambda: _learned_error(http) is not None, 5)
                    reason = str(_learned_error(http))
                    assert "used from memory" in reason and str(data) not in reason  # the path is its "file"
                    assert "capd_unsaved_learned_corrections 1" in http.get("/metrics").text
            _step(http, models, "ro-a", rng)  # writable again: this write lands everything pending
            assert _state_error(http) == []
            assert "being stored again" in daemon.log_text()
            if how == "full":  # ... and stored by the daemon's check once the disk has room again
                assert wait_until(lambda: _learned_error(http) is None, 10)
                assert "capd_unsaved_learned_corrections 0" in http.get("/metrics").text
                with sqlite3.connect(f"file:{data / 'learned.sqlite3'}?mode=ro", uri=True) as stored:
                    rows = stored.execute("SELECT capability, message FROM learned").fetchall()
                assert rows == [(taught, "the thing with the boxes is slow again")]
        daemon.kill9()
        daemon.start()
        with daemon.client() as http:
            for session, model in models.items():
                assert state_snapshot(http.get(f"/v1/sessions/{session}").json()) == model.snapshot(), session
        daemon.stop()  # before the tmpfs goes away


def test_read_only_data_dir_at_start_serves_from_memory(tmp_path: Path, daemon_factory: DaemonFactory) -> None:
    data = tmp_path / "data"
    data.mkdir()
    with _immutable(data):
        daemon = daemon_factory([fleet_tap(tmp_path)], data_dir=data, env=ENV)
        with daemon.client() as http:
            health = http.get("/v1/health").json()
            assert health["ready"] and health["status"] == "ok"
            error, learned = health["errors"]  # sessions and learned corrections, both in memory
            assert error["file"] == str(data / "sessions.sqlite3")
            assert "writable" in error["reason"] and "in memory only" in error["reason"]
            assert learned["file"] == str(data / "learned.sqlite3") and "keeping them in memory" in learned["reason"]
            plan = http.post("/v1/sessions/m/enable", json={"name": "db-postgres"}).json()
            assert plan["active"] == ["db-postgres"]
            assert [a["name"] for a in http.get("/v1/sessions/m").json()["active"]] == ["db-postgres"]
            assert http.post("/v1/route", json={"session": "m", "message": "list the kubernetes pods"}
                             ).json()["capability"] == "k8s"
        log = daemon.log_text()
        assert "in-memory cache" in log and "Sessions are kept in memory only" in log
        assert list(data.iterdir()) == []


# -- a hundred files edited at once ------------------------------------------------------------------

def _edit(tap: Path, index: int, versions: int, rng: random.Random) -> None:
    directory = tap / "capabilities" / f"cap-{index:03d}"
    for version in range(versions):
        text = (f'triggers = ["capability number {index} edit {version} phrase", '
                f'"edited trigger {version} for item {index}"]\ndescription = "item {index} v{version}"\n')
        if version < versions - 1 and rng.random() < 0.2:
            text = 'triggers = ["broken on purpose\n'  # a half-saved file on the way
        if rng.random() < 0.5:
            (directory / "config.toml").write_text(text)
        else:  # how editors save: a temporary file renamed over the old one
            temporary = directory / f".config.toml.{version}.tmp"
            temporary.write_text(text)
            os.replace(temporary, directory / "config.toml")


def _daemon_view(http: httpx.Client) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    return http.get("/v1/capabilities").json()["capabilities"], http.get("/v1/health").json()


def test_hundred_files_edited_concurrently(tmp_path: Path, daemon_factory: DaemonFactory) -> None:
    tap = plain_tap(tmp_path, 100)
    daemon = daemon_factory([tap], env=ENV)
    versions, threads = sized(3, 12), sized(8, 16)
    for round_ in range(sized(1, 3)):
        rng = [random.Random(round_ * 1000 + i) for i in range(100)]
        with ThreadPoolExecutor(max_workers=threads) as pool:
            list(pool.map(_edit, [tap] * 100, range(100), [versions + round_] * 100, rng))
        fresh = load_catalog([tap])
        want = [{**c.summary(), "active": False} for c in fresh]
        with daemon.client() as http:
            def settled(http: httpx.Client = http, want: list[dict[str, Any]] = want) -> bool:
                caps, health = _daemon_view(http)
                return caps == want and health["errors"] == []

            assert wait_until(settled, 30), _diff(_daemon_view(http)[0], want)
            health = http.get("/v1/health").json()
            assert (health["capabilities"], health["triggers"]) == (len(fresh), fresh.trigger_count)
            for capability in fresh:  # the index holds the new vectors, not just the catalog the new text
                found = http.post("/v1/discover", json={"intent": capability.triggers[0], "limit": 1}).json()
                assert found["candidates"][0]["name"] == capability.name
    assert "Traceback" not in daemon.log_text()


def _diff(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> str:
    wrong = [(g, w) for g, w in zip(got, want, strict=False) if g != w]
    return f"{len(got)} vs {len(want)} capabilities; first differences: {wrong[:3]}"



def test_data_dir_that_cannot_be_created_serves_from_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same without root tricks: the data directory would have to be created under a file.
    The start refuses such a path (a mistyped --data-dir, checked first below); the stores behind
    that check, which meet a directory it could not create (a read-only disk), are then checked
    with the check skipped."""
    from capd.errors import ConfigError
    from capd.service import Service
    from capd.settings import Settings

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    settings = Settings(model="hash", taps=(fleet_tap(tmp_path),), data_dir=blocker / "data")
    with pytest.raises(ConfigError, match="is not a directory"):
        Service(settings, sessions=True).start()
    assert blocker.read_text() == "not a directory"
    monkeypatch.setattr("capd.service.own_data_dir", lambda path: None)
    service = Service(settings, sessions=True).start()
    try:
        assert service.registry is not None and not service.registry.store.persistent
        assert service.registry.activate("m", "k8s").active == ("k8s",)
        error, learned = service.health()["errors"]  # sessions and learned corrections, both in memory
        assert error["file"] == str(blocker / "data" / "sessions.sqlite3") and "in memory only" in error["reason"]
        assert learned["file"] == str(blocker / "data" / "learned.sqlite3")
    finally:
        service.close()
