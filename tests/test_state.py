"""Durable session state: round trips, kill -9 of a real writer process, unwritable directories, schema."""

from __future__ import annotations

import logging
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path

import pytest

from capd.catalog import Catalog
from capd.errors import StateError
from capd.service import Service
from capd.sessions import SessionRegistry
from capd.settings import Settings
from capd.state import FILENAME, SCHEMA_VERSION, ActiveCapability, SessionRecord, SessionStore
from capd.taps import load_catalog
from tests.conftest import file_held
from tests.taputil import write_capability

REPO = Path(__file__).resolve().parent.parent
CAPS = ("fs-read", "git", "rust", "fs-write")
FILESYSTEM = """[[mcp.servers]]
name = "filesystem"
command = "npx"
args = ["-y", "@modelcontextprotocol/server-filesystem", "{{ENV:HOME}}"]
timeout_seconds = 30
"""
PROVIDERS = {
    "fs-read": f'[roles.mcp]\nserver_refs = ["filesystem"]\nallowed_tools = ["filesystem:read_file"]\n{FILESYSTEM}',
    "fs-write": f'[roles.mcp]\nserver_refs = ["filesystem"]\nallowed_tools = ["filesystem:write_file"]\n{FILESYSTEM}',
    "git": '[roles.mcp]\nserver_refs = ["git"]\nallowed_tools = ["git:*"]\n[[mcp.servers]]\nname = "git"\n'
           'command = "uvx"\nargs = ["mcp-server-git"]\n[mcp.servers.env]\nGIT_TOKEN = "{{ENV:GIT_TOKEN}}"\n',
    "rust": '[deps]\nrequire = ["rust-lang/rustup"]\n',
}


@pytest.fixture
def tap(tmp_path: Path) -> Path:
    for name, text in PROVIDERS.items():
        write_capability(tmp_path / "tap", name, [f"use {name}"], {name: text}, default="<inline>")
    return tmp_path / "tap"


@pytest.fixture
def catalog(tap: Path) -> Catalog:
    return load_catalog([tap])


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_state_is_read_back_exactly_by_a_new_store(tmp_path: Path, catalog: Catalog) -> None:
    path, clock = tmp_path / "data" / FILENAME, Clock()
    with SessionStore(path) as store:
        registry = SessionRegistry(store, lambda: catalog, max_active=2, pinned=("rust",), clock=clock)
        for session, names in (("a", ["git", "fs-read"]), ("b", ["fs-write"]), ("c", ["git"])):
            for name in names:
                clock.t += 1.5
                registry.activate(session, name, "auto")
        clock.t += 0.25
        registry.tool_result("a", "git", "git_log", ok=True)
        registry.drop("c")
        before = {s: store.get(s) for s in store.ids()}
        states = {s: registry.get(s) for s in registry.sessions()}
    with SessionStore(path) as reopened:
        assert reopened.ids() == ("a", "b")
        assert {s: reopened.get(s) for s in reopened.ids()} == before
        again = SessionRegistry(reopened, lambda: catalog, max_active=2, pinned=("rust",), clock=clock)
        assert {s: again.get(s) for s in again.sessions()} == states
        spec = again.get("a").active[1].servers[0].spec
        assert spec["env"] == {"GIT_TOKEN": "{{ENV:GIT_TOKEN}}"}  # stored verbatim, never resolved
        clock.t += 1
        plan = again.activate("a", "fs-write")  # the LRU continues from the stored last_used
        assert plan.removed == ("fs-read",) and plan.active == ("rust", "git", "fs-write")
        assert [a.seq for a in again.get("a").active] == [0, 1, 3]


def test_put_delete_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / FILENAME
    record = SessionRecord("s", 5.0, 2, (ActiveCapability("x", "auto", 1, 4.5),))
    with SessionStore(path) as store:
        store.put(record)
        store.put(SessionRecord("t", 6.0, 0))
        store.delete("s")
        store.delete("never-there")
        assert store.ids() == ("t",) and store.get("s") is None and store.pending == 0
        store.put(record)
    with SessionStore(path) as store:
        assert store.get("s") == record and store.ids() == ("s", "t")
    closed = SessionStore(path)
    closed.close()
    with pytest.raises(StateError, match="closed"):
        closed.put(record)


def test_schema_is_versioned(tmp_path: Path) -> None:
    path = tmp_path / FILENAME
    SessionStore(path).close()
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == (str(SCHEMA_VERSION),)
        assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        db.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    db.close()
    with pytest.raises(StateError, match="schema 99, newer"):
        SessionStore(path)


def test_a_file_that_is_not_a_database(tmp_path: Path) -> None:
    path = tmp_path / FILENAME
    path.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StateError, match=r"sessions\.sqlite3.*the file is damaged.*move it aside") as info:
        SessionStore(path)
    assert "writable" not in str(info.value)  # the directory is fine: the advice is about the file
    assert path.read_bytes() == b"this is not sqlite" * 100  # left as it is


def test_a_schema_version_that_is_not_a_number(tmp_path: Path) -> None:
    """It used to escape as a bare ValueError ("invalid literal for int()"): the daemon failed to
    start, naming no file, instead of serving sessions from memory."""
    path = tmp_path / FILENAME
    SessionStore(path).close()
    with sqlite3.connect(path) as db:
        db.execute("UPDATE meta SET value = 'x' WHERE key = 'schema_version'")
    db.close()
    with pytest.raises(StateError, match=r"sessions\.sqlite3: .*schema version 'x'.*damaged.*move it aside"):
        SessionStore(path)
    with sqlite3.connect(path) as db:  # left as it is
        assert db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == ("x",)
    db.close()


def test_the_advice_fits_what_is_wrong(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every failure used to advise making the data directory writable, also where it is."""
    monkeypatch.setattr("capd.state.OPEN_WAIT", 0.05)
    path = tmp_path / FILENAME
    path.mkdir()
    with pytest.raises(StateError, match="a directory is in the file's place") as info:
        SessionStore(path)
    path.rmdir()
    with sqlite3.connect(path) as db:  # another program's tables
        db.execute("CREATE TABLE sessions (who TEXT, what TEXT)")
    db.close()
    with pytest.raises(StateError, match="does not hold capd's session tables") as other:
        SessionStore(path)
    path.unlink()
    SessionStore(path).close()
    with file_held(path), pytest.raises(StateError, match="another process holds the file locked") as locked:
        SessionStore(path, timeout=0.05)
    assert not any("writable" in str(e.value) for e in (info, other, locked))


def test_unreadable_rows_are_skipped_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / FILENAME
    with SessionStore(path) as store:
        store.put(SessionRecord("good", 1.0, 0))
    with sqlite3.connect(path) as db:
        db.execute("INSERT INTO sessions VALUES ('bad', 1.0, 0, '[{\"name\": 1}]')")
    db.close()
    with caplog.at_level(logging.WARNING, logger="capd.state"), SessionStore(path) as store:
        assert store.ids() == ("good",)
    assert "skipping unreadable session 'bad'" in caplog.text


def test_rows_that_failed_the_start_are_skipped_with_a_warning_too(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Each of these failed the daemon's start ("cannot convert float infinity to integer", a
    RecursionError, "'<' not supported between 'str' and 'NoneType'"), and text that is not UTF-8
    kept every session in memory only ("Could not decode to UTF-8")."""
    path = tmp_path / FILENAME
    with SessionStore(path) as store:
        store.put(SessionRecord("good", 1.0, 0))
    item = '{"name": "git", "origin": "manual", "seq": 1e999, "last_used": 1.0, "servers": []}'
    with sqlite3.connect(path) as db:
        db.executemany("INSERT INTO sessions VALUES (?, 1.0, 0, ?)",
                       [("infinite", f"[{item}]"), ("deep", "[" * 100_000 + "]" * 100_000), (None, "[]")])
        db.execute("INSERT INTO sessions VALUES (CAST(x'eda080' AS TEXT), 1.0, 0, '[]')")
        undecodable = b'[{"name": "\xed\xa0\x80", "origin": "manual", "seq": 0, "last_used": 1.0, "servers": []}]'
        db.execute("INSERT INTO sessions VALUES ('undecodable', 1.0, 0, CAST(? AS TEXT))", (undecodable,))
    db.close()
    with caplog.at_level(logging.WARNING, logger="capd.state"), SessionStore(path) as store:
        assert store.persistent and store.ids() == ("good",)
        store.put(SessionRecord("next", 2.0, 0))  # the file is used as ever
    for session in ("'infinite'", "'deep'", "None", "'undecodable'"):
        assert f"skipping unreadable session {session}" in caplog.text
    assert caplog.text.count("skipping unreadable session") == 5
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT count(*) FROM sessions").fetchone()[0] == 7  # left in the file
    db.close()


def test_directory_that_cannot_be_created(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(StateError, match=r"a-file.*writable"):
        SessionStore(blocker / "data" / FILENAME)


def _freeze(*paths: Path) -> bool:
    """Make paths read-only even for root (chattr +i) if chmod does not stop us; False if impossible."""
    for path in paths:
        path.chmod(0o555 if path.is_dir() else 0o444)
    if not any(os.access(p, os.W_OK) for p in paths):
        return True
    done = subprocess.run(["chattr", "+i", *map(str, paths)], capture_output=True, check=False)
    return done.returncode == 0


def _thaw(*paths: Path) -> None:
    subprocess.run(["chattr", "-i", *map(str, paths)], capture_output=True, check=False)
    for path in paths:
        path.chmod(0o755 if path.is_dir() else 0o644)


def test_read_only_directory(tmp_path: Path) -> None:
    data = tmp_path / "data"
    SessionStore(data / FILENAME).close()
    try:
        if not _freeze(data):
            pytest.skip("cannot make a directory read-only here (root without chattr)")
        with pytest.raises(StateError, match=r"sessions\.sqlite3: cannot open session state.*writable"):
            SessionStore(data / FILENAME)
    finally:
        _thaw(data)


def test_a_store_on_memory_moves_to_the_file_once_it_can(tmp_path: Path, catalog: Catalog,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Locked (or full, or read-only) at the start, the file used to stay unused for the whole run,
    and the sessions of that run were lost at the next stop."""
    monkeypatch.setattr("capd.state.OPEN_WAIT", 0.05)
    path = tmp_path / FILENAME
    with SessionStore(path) as before:
        for session in ("old-1", "old-2", "gone"):
            before.put(SessionRecord(session, 1.0, 0))
    with file_held(path):
        with pytest.raises(StateError):
            SessionStore(path, timeout=0.05)
        store = SessionStore(path, timeout=0.05, memory=True)  # what the service falls back to
        registry = SessionRegistry(store, lambda: catalog, clock=Clock())
        registry.activate("old-1", "git")  # the agent came back: a fresh session under its old id
        registry.activate("new", "rust")
        store.delete("gone")  # dropped meanwhile (e.g. by an agent that knew it)
        assert store.attach() is False and not store.persistent  # still locked: nothing changes
    assert store.attach() is True and store.persistent
    assert store.ids() == ("new", "old-1", "old-2")
    registry.activate("new", "fs-read")  # written to the file from now on
    store.close()
    with SessionStore(path) as after:
        assert after.ids() == ("new", "old-1", "old-2")
        assert [a.name for a in (after.get("old-1") or SessionRecord("", 0, 0)).active] == ["git"]
        assert [a.name for a in (after.get("new") or SessionRecord("", 0, 0)).active] == ["rust", "fs-read"]


def test_the_service_reattaches_its_session_file(tmp_path: Path, tap: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("capd.state.OPEN_WAIT", 0.05)
    settings = Settings(taps=(tap,), data_dir=tmp_path / "data", model="hash")
    path = settings.data_dir / FILENAME
    SessionStore(path).close()
    with file_held(path):
        service = Service(settings, sessions=True).start()
        assert service.registry is not None and not service.registry.store.persistent
        error = service.health()["errors"][0]
        assert "kept in memory only" in error["reason"] and error["file"] == str(path)
        assert str(path) not in error["reason"]  # `capd status` printed "FILE: FILE: …"
        service.registry.activate("s1", "git")
        assert service.reattach_state() is False
    assert service.reattach_state() is True and service.health()["errors"] == []
    service.close()
    with SessionStore(path) as stored:
        assert stored.ids() == ("s1",)


@pytest.mark.parametrize("released", [True, False], ids=["file usable at the stop", "still locked"])
def test_sessions_kept_in_memory_since_the_start_are_stored_at_the_stop_if_they_can_be(
        tmp_path: Path, tap: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
        released: bool) -> None:
    """They used to wait for the daemon's next minutely try, and were lost if it stopped first."""
    monkeypatch.setattr("capd.state.OPEN_WAIT", 0.05)
    settings = Settings(taps=(tap,), data_dir=tmp_path / "data", model="hash")
    path = settings.data_dir / FILENAME
    SessionStore(path).close()
    with file_held(path) as release:
        service = Service(settings, sessions=True).start()
        assert service.registry is not None and not service.registry.store.persistent
        service.registry.activate("s1", "git")
        if released:
            release()
        with caplog.at_level(logging.WARNING, logger="capd.service"):
            service.close()
    with SessionStore(path) as stored:
        assert stored.ids() == (("s1",) if released else ())
    assert ("1 session(s) kept in memory are lost" in caplog.text) is not released
    assert ("the sessions kept in memory were moved there" in caplog.text) is released


@pytest.mark.parametrize("released", [True, False], ids=["lock released", "lock still held"])
def test_a_stopping_service_commits_what_a_locked_file_held_back(
        tmp_path: Path, tap: Path, caplog: pytest.LogCaptureFixture, released: bool) -> None:
    """A change another process's lock kept from the file is committed when the service stops, or
    counted in a warning when the lock is still held; either way the files are closed, so no
    write-ahead log is left beside them."""
    settings = Settings(taps=(tap,), data_dir=tmp_path / "data", model="hash")
    path = settings.data_dir / FILENAME
    service = Service(settings, sessions=True).start()
    assert service.registry is not None
    service.registry.activate("s1", "git")  # committed
    with file_held(path) as release:
        service.registry.activate("s1", "rust")  # held back: kept in memory, pending
        assert service.registry.store.pending == 1
        assert "capd_unsaved_session_changes 1" in service.metrics.render()  # what an operator can alert on
        if released:
            release()
        with caplog.at_level(logging.WARNING, logger="capd.service"):
            service.close()
    with SessionStore(path) as stored:
        active = [a.name for a in (stored.get("s1") or SessionRecord("", 0, 0)).active]
    if released:
        assert active == ["git", "rust"] and "could not be saved" not in caplog.text
        assert not [f.name for f in settings.data_dir.iterdir() if f.name.endswith(("-wal", "-shm"))]
    else:
        assert active == ["git"]
        assert f"1 session change(s) could not be saved to {path} before capd stopped" in caplog.text


def test_failed_writes_keep_serving_from_memory(tmp_path: Path, catalog: Catalog, caplog: pytest.LogCaptureFixture,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A locked file costs one wait, not one per call: once a write has failed, the next ones try
    without waiting for the lock, until one succeeds."""
    path = tmp_path / FILENAME
    store = SessionStore(path, timeout=0.05)
    registry = SessionRegistry(store, lambda: catalog, clock=Clock())
    waits: list[int] = []
    write = SessionStore._write

    def observed(conn: sqlite3.Connection, batch: Mapping[str, SessionRecord | None]) -> None:
        waits.append(conn.execute("PRAGMA busy_timeout").fetchone()[0])
        write(conn, batch)

    monkeypatch.setattr(SessionStore, "_write", staticmethod(observed))
    registry.activate("s1", "git")
    registry.activate("gone", "git")
    with file_held(path):  # every write of ours fails
        with pytest.raises(StateError, match="cannot write session state"):
            store.put(SessionRecord("direct", 1.0, 0))
        with caplog.at_level(logging.WARNING, logger="capd.sessions"):
            plan = registry.activate("s1", "fs-read")
            registry.drop("gone")
        assert plan.activated == ("fs-read",)
        assert registry.active_names("s1") == ("git", "fs-read")
        assert store.pending == 3 and store.last_error is not None
        assert "kept in memory only" in caplog.text
        assert waits == [50, 50, 50, 0, 0]  # two before the block, one that met it and waited, two that did not
    registry.activate("s2", "rust")  # the next write flushes everything pending
    assert store.pending == 0 and store.last_error is None
    registry.activate("s2", "fs-read")
    assert waits[-2:] == [0, 50]  # healthy again: writes wait for a lock again
    store.close()
    with SessionStore(path) as reopened:
        assert reopened.ids() == ("direct", "s1", "s2")
        assert [a.name for a in (reopened.get("s1") or SessionRecord("", 0, 0)).active] == ["git", "fs-read"]


CHILD = textwrap.dedent("""
    import sys
    from capd.sessions import SessionRegistry
    from capd.state import SessionStore
    from capd.taps import load_catalog

    caps = sys.argv[3].split(",")
    catalog = load_catalog([sys.argv[1]])
    now = [0.0]
    registry = SessionRegistry(SessionStore(sys.argv[2]), lambda: catalog, max_active=2, clock=lambda: now[0])
    i = 0
    while True:
        now[0] = float(i)
        registry.activate(f"s{i}", caps[i % len(caps)])
        registry.activate("hot", caps[i % len(caps)])
        if i % 3 == 0:
            registry.tool_result("hot", "filesystem", "read_file", ok=True)
        if registry.store.pending:  # acknowledge only what was committed; say why otherwise
            sys.exit(f"iteration {i} not committed: {registry.store.last_error}")
        print(i, flush=True)
        i += 1
""")


def _reference(catalog: Catalog, path: Path, upto: int) -> tuple[SessionStore, list[list[SessionRecord]]]:
    """Replay the child's loop in-process; returns the store and, per iteration, each state 'hot' went through."""
    now = [0.0]
    store = SessionStore(path)
    registry = SessionRegistry(store, lambda: catalog, max_active=2, clock=lambda: now[0])
    hot: list[list[SessionRecord]] = []

    def snapshot() -> SessionRecord:
        record = store.get("hot")
        assert record is not None
        return record

    for i in range(upto):
        now[0] = float(i)
        registry.activate(f"s{i}", CAPS[i % len(CAPS)])
        registry.activate("hot", CAPS[i % len(CAPS)])
        hot.append([snapshot()])
        if i % 3 == 0:
            registry.tool_result("hot", "filesystem", "read_file", ok=True)
            hot[-1].append(snapshot())
    return store, hot


@pytest.mark.slow
def test_kill_9_mid_writes_keeps_every_committed_session(tmp_path: Path, tap: Path, catalog: Catalog) -> None:
    path = tmp_path / "data" / FILENAME
    # Unbuffered binary pipe: readline() then takes exactly one acknowledgement at a time, so no
    # line the child printed is hidden in a read-ahead buffer when it is killed.
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tap), str(path), ",".join(CAPS)], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
    assert child.stdout is not None
    try:
        while (line := child.stdout.readline()) and int(line) < 400:
            pass
        os.kill(child.pid, signal.SIGKILL)  # mid-write: the loop commits continuously
    finally:
        child.kill()
        rest, err = child.communicate(timeout=30)
    assert child.returncode == -signal.SIGKILL, err.decode()
    # Every acknowledged iteration; a line cut short by the kill was never acknowledged.
    acknowledged = [int(x) for x in rest.decode().split("\n")[:-1]]
    last = max([400, *acknowledged])

    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    db.close()
    reference, hot = _reference(catalog, tmp_path / "reference.sqlite3", last + 2)
    with SessionStore(path) as store, reference:
        committed = {int(s[1:]) for s in store.ids() if s.startswith("s")}
        assert set(range(last + 1)) <= committed <= set(range(last + 2))  # at most one write was in flight
        for i in committed:
            assert store.get(f"s{i}") == reference.get(f"s{i}")
        assert store.get("hot") in [hot[last][-1], *hot[last + 1]]
        store.put(SessionRecord("after", 1.0, 0))  # the recovered file takes writes
    with SessionStore(path) as store:
        assert store.get("after") == SessionRecord("after", 1.0, 0)


def test_a_second_daemon_on_the_data_directory_is_told_sessions_are_not_shared(
        tmp_path: Path, tap: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Each daemon serves its own copy of the sessions, so two given one session id overwrote each
    other's on disk without a word."""
    settings = Settings(taps=(tap,), data_dir=tmp_path / "data", model="hash")
    first = Service(settings, sessions=True).start()
    try:
        with caplog.at_level(logging.WARNING, logger="capd.service"):
            second = Service(settings, sessions=True).start()
            second.close()
        assert "another capd daemon keeps its sessions in" in caplog.text
    finally:
        first.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="capd.service"):
        Service(settings, sessions=True).start().close()  # the first one let go when it closed
    assert "another capd daemon" not in caplog.text
