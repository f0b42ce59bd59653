"""Learning from corrections: the store, the turn tracker, the real daemon loop, the CLI."""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import subprocess
import time
import tomllib
from collections.abc import Iterator
from contextlib import closing
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient

from capd.api import create_app
from capd.cli import main
from capd.corrections import Corrections
from capd.errors import ConfigError
from capd.learned import LearnedStore
from capd.learned_rows import canonical_tap
from capd.service import Service
from capd.settings import Settings, default_taps, load_settings
from tests.conftest import SettingsFactory, file_held, isolated_data_dir
from tests.taputil import local_client, octomind_tap

CORE = default_taps()[0].absolute()
MISS = "the thing with the boxes is slow again"  # abstains on taps/core; the user meant docker
CHATTER = "tell me something interesting about yourself"
# small talk that activates `time` on taps/core (fused, its gates): the abstain corpus's veto and its class
# both let it through (CHATTER the class turns away)
LEAK = "time flies"


def test_store_records_once_lists_and_forgets(tmp_path: Path) -> None:
    store = LearnedStore.open(tmp_path)
    assert store.record(CORE, "docker", MISS, "abstain", "s1")
    assert not store.record(CORE, "docker", MISS, "abstain", "s2")  # known already
    store.record(CORE, "git", "undo my last save point", "mysql", "s1")
    store.record("/elsewhere", "git", "undo my last save point", None, None)
    assert store.for_tap(CORE) == {"docker": (MISS,), "git": ("undo my last save point",)}
    taps = [e.tap for e in store.entries(capability="git")]
    assert taps == sorted(["/elsewhere", str(CORE)])  # ordered by tap, wherever the clone lives
    store.close()
    reopened = LearnedStore.open(tmp_path)  # durable
    assert reopened.forget(tap=CORE, capability="git") == 1
    assert len(reopened.entries()) == 2
    assert reopened.forget() == 2 and reopened.entries() == []


def test_forget_finds_a_message_as_routing_knows_it_again(tmp_path: Path) -> None:
    """``capd learned forget --message`` matched the stored text byte for byte: the message as the
    user remembered it, in other case or spacing, forgot nothing, though routing treats the two as
    one message (:func:`~capd.text.recall_key`)."""
    path = tmp_path / "learned.sqlite3"
    store = LearnedStore(path, timeout=0.05)
    store.record(CORE, "docker", MISS)
    store.record(CORE, "docker", "the boxes will not start")
    store.record(CORE, "git", MISS.upper())
    assert store.forget(capability="docker", message="  The THING with the boxes   is slow again") == 1
    assert [(e.capability, e.message) for e in store.entries()] == [
        ("docker", "the boxes will not start"), ("git", MISS.upper())]
    with file_held(path):  # a correction held in memory is matched the same way
        store.record(CORE, "go", "Run The Go Tests")
        assert store.forget(message="run the go tests") == 1 and store.unsaved == 0
    store.close()
    result = CliRunner().invoke(main, ["learned", "forget", "git", "--message", MISS.title(),
                                       "--data-dir", str(tmp_path), "--port", "1", "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["forgotten"] == 1, result.output
    with closing(LearnedStore(path)) as reopened:
        assert [e.message for e in reopened.entries()] == ["the boxes will not start"]


def test_store_keeps_one_kind_per_message_the_latest(tmp_path: Path) -> None:
    store = LearnedStore.open(tmp_path)
    assert store.record(CORE, "memory", CHATTER, "memory", "s1", kind="abstain")
    assert not store.record(CORE, "memory", CHATTER, "memory", "s2", kind="abstain")  # known already
    assert store.for_tap(CORE) == {} and store.for_tap(CORE, "abstain") == {"memory": (CHATTER,)}
    assert store.record(CORE, "memory", CHATTER, "abstain", "s3")  # a later enable: now a trigger
    [entry] = store.entries()
    assert (entry.kind, entry.session) == ("trigger", "s3")
    with pytest.raises(ValueError, match="kind"):
        store.record(CORE, "memory", CHATTER, kind="maybe")


def test_each_capability_keeps_its_latest_corrections_of_each_kind(tmp_path: Path) -> None:
    """A stuck agent enabling docker after every turn adds at most ``limit`` docker triggers: the
    oldest go first; the capability's abstains and other capabilities' entries are untouched."""
    store = LearnedStore.open(tmp_path, limit=3)
    store.record(CORE, "docker", CHATTER, "memory", "s", kind="abstain")
    store.record(CORE, "git", "undo my last save point", "abstain", "s")
    for i in range(6):
        assert store.record(CORE, "docker", f"stuck agent turn {i}", "abstain", "s")
    assert not store.record(CORE, "docker", "stuck agent turn 5", "abstain", "s")  # known: nothing dropped
    assert store.for_tap(CORE) == {"docker": ("stuck agent turn 3", "stuck agent turn 4", "stuck agent turn 5"),
                                   "git": ("undo my last save point",)}
    # taught again, turn 3 is the latest: the next one drops turn 4, not the correction agents repeat
    assert not store.record(CORE, "docker", "stuck agent turn 3", "abstain", "s")
    assert store.record(CORE, "docker", "stuck agent turn 6", "abstain", "s")
    assert set(store.for_tap(CORE)["docker"]) == {"stuck agent turn 3", "stuck agent turn 5", "stuck agent turn 6"}
    assert store.for_tap(CORE, "abstain") == {"docker": (CHATTER,)}
    store.close()
    assert len(LearnedStore.open(tmp_path, limit=3).entries()) == 5  # durable, as trimmed
    with pytest.raises(ValueError, match="at least 1"):
        LearnedStore(None, limit=0)


def test_a_correction_made_after_the_clock_went_back_is_kept(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """"Latest" is by the time recorded: with the clock set back (NTP, a VM resumed) a new correction
    was dated before the ones kept, so at the limit it was the oldest and dropped at once, though
    `record` said it was stored. Also across a restart, and for one process's consecutive corrections."""
    with closing(LearnedStore.open(tmp_path, limit=2)) as store:
        store.record(CORE, "docker", "turn 1")
        store.record(CORE, "docker", "turn 2")
    now = time.time()
    monkeypatch.setattr("capd.learned.time.time", lambda: now - 3600)
    with closing(LearnedStore.open(tmp_path, limit=2)) as store:
        assert store.record(CORE, "docker", "turn 3")
        assert store.for_tap(CORE) == {"docker": ("turn 2", "turn 3")}
        monkeypatch.setattr("capd.learned.time.time", lambda: now - 7200)
        assert store.record(CORE, "docker", "turn 4")
        assert store.for_tap(CORE) == {"docker": ("turn 3", "turn 4")}


def test_the_daemon_keeps_as_many_corrections_as_learn_max(settings_factory: SettingsFactory) -> None:
    assert load_settings(env={"CAPD_LEARN_MAX": "7"}).learn_max == 7
    with pytest.raises(ConfigError, match="learn_max"):
        load_settings(env={"CAPD_LEARN_MAX": "0"})
    with closing(Service(settings_factory(taps=(CORE,), learn_max=7), sessions=True).start()) as service:
        assert service.learned is not None and service.learned.limit == 7


def test_a_store_from_before_abstains_opens_with_its_entries_as_triggers(tmp_path: Path) -> None:
    with sqlite3.connect(tmp_path / "learned.sqlite3") as conn:
        conn.execute("CREATE TABLE learned (tap TEXT NOT NULL, capability TEXT NOT NULL, message TEXT NOT NULL, "
                     "previous TEXT, session TEXT, created REAL NOT NULL, PRIMARY KEY (tap, capability, message))")
        conn.execute("INSERT INTO learned VALUES (?, 'docker', ?, 'abstain', 'a', 1.0)", (str(CORE), MISS))
    conn.close()
    store = LearnedStore.open(tmp_path)
    assert store.for_tap(CORE) == {"docker": (MISS,)}
    assert store.record(CORE, "docker", "stop the web container", "memory", "b", kind="abstain")
    assert [e.kind for e in store.entries()] == ["trigger", "abstain"]


def test_unusable_data_dir_keeps_learning_in_memory(tmp_path: Path) -> None:
    blocker = tmp_path / "data"
    blocker.write_text("a file where the data directory should be")  # fails for root too
    store = LearnedStore.open(blocker)
    assert store.error and "in memory" in store.error
    assert store.record(CORE, "docker", MISS)
    assert store.for_tap(CORE) == {"docker": (MISS,)}
    assert blocker.read_text().startswith("a file")  # nothing a user wrote is modified


def test_a_correction_the_locked_file_will_not_take_is_used_and_stored_later(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Another process's lock (or a full disk) used to drop a correction with an error line. It is now
    used from memory, named in the store's error (health), and stored by the daemon's next check."""
    path = tmp_path / "learned.sqlite3"
    store = LearnedStore(path, timeout=0.05)
    assert store.record(CORE, "docker", MISS, "abstain", "s1")
    with file_held(path):  # another writer holds the file
        with caplog.at_level(logging.WARNING, logger="capd.learned"):
            assert store.record(CORE, "git", "undo my last save point", "abstain", "s1")
            assert not store.record(CORE, "git", "undo my last save point", "abstain", "s2")  # held already
            assert not store.record(CORE, "docker", MISS, "abstain", "s2")  # in the file already
            assert store.record(CORE, "docker", CHATTER, "memory", "s1", kind="abstain")
            assert store.version() is not None  # a check while still locked keeps them held
        assert store.unsaved == 2
        assert store.error == (f"{path}: cannot store learned examples: database is locked; 2 new correction(s) "
                               "are used from memory until it can")
        assert caplog.text.count("cannot store learned examples") == 1  # said once, not per correction
        assert store.for_tap(CORE) == {"docker": (MISS,), "git": ("undo my last save point",)}
        assert store.for_tap(CORE, "abstain") == {"docker": (CHATTER,)}
        assert [e.message for e in store.entries(capability="docker")] == [MISS, CHATTER]  # triggers first
    assert store.version() is not None  # the daemon's periodic check: what was held back goes in
    assert store.unsaved == 0 and store.error is None
    assert store.close() == 0
    with closing(LearnedStore(path)) as reopened:
        assert sorted((e.capability, e.message, e.kind) for e in reopened.entries()) == sorted([
            ("docker", MISS, "trigger"), ("docker", CHATTER, "abstain"), ("git", "undo my last save point", "trigger")])


def test_while_the_file_refuses_corrections_they_do_not_wait_for_its_lock(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As with session state: a locked file costs one wait, not one per correction or per check
    (each would hold the store, and the manual enable that records it, for the whole wait)."""
    path = tmp_path / "learned.sqlite3"
    store = LearnedStore(path, timeout=0.05)
    waits: list[int] = []
    insert = LearnedStore._insert

    def observed(self: LearnedStore, conn: sqlite3.Connection, entry: Any) -> bool:
        waits.append(conn.execute("PRAGMA busy_timeout").fetchone()[0])
        return insert(self, conn, entry)

    monkeypatch.setattr(LearnedStore, "_insert", observed)
    store.record(CORE, "docker", MISS)
    with file_held(path):
        store.record(CORE, "git", "undo my last save point")  # meets the lock and waits
        store.record(CORE, "rust", "build the crate in release mode")
        store.version()
    store.version()  # stores both
    store.record(CORE, "go", "run the go tests")
    assert waits == [50, 50, 0, 0, 0, 0, 50]  # the retries: 1 of 2 (the lock), then both, then healthy
    assert store.close() == 0


def test_corrections_still_held_back_at_close_are_counted_and_forget_reaches_them(tmp_path: Path) -> None:
    path = tmp_path / "learned.sqlite3"
    store = LearnedStore(path, timeout=0.05)
    store.record(CORE, "docker", MISS)
    with file_held(path):
        store.record(CORE, "git", "undo my last save point")
        store.record(CORE, "rust", "build the crate in release mode")
        store.record(CORE, "go", "run the go tests")
    assert store.forget(capability="git") == 1 and store.unsaved == 2  # the file had none of git's
    with file_held(path):
        assert store.close() == 2  # what the caller warns about: lost with this process
    with closing(LearnedStore(path)) as reopened:
        assert [e.capability for e in reopened.entries()] == ["docker"]


def _refuse_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """learned.sqlite3 refuses to be opened for writing, as in a read-only data directory (chmod does not
    stop root, who may run the suite); opening it read-only (``mode=ro``) still works."""
    connect = sqlite3.connect

    def read_only(database: str | Path, *args: object, **kwargs: object) -> sqlite3.Connection:
        if str(database).endswith("learned.sqlite3"):  # opened for writing
            raise sqlite3.OperationalError("attempt to write a readonly database")
        return connect(database, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr("capd.learned.sqlite3.connect", read_only)


def test_a_file_that_cannot_be_written_still_lends_its_corrections(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A read-only data directory (refused here for writing only, as the suite may run as root) used
    to hide every stored correction: "0 learned", and `forget` said it forgot 0 of 3."""
    with closing(LearnedStore.open(tmp_path)) as store:
        store.record(CORE, "docker", MISS)
    _refuse_writes(monkeypatch)
    store = LearnedStore.open(tmp_path)
    assert store.for_tap(CORE) == {"docker": (MISS,)}
    assert store.error is not None and "the 1 it holds are used, read-only" in store.error
    result = CliRunner().invoke(main, ["learned", "forget", "docker", "--data-dir", str(tmp_path), "--port", "1"])
    assert result.exit_code == 1 and "cannot store learned examples" in result.stderr


def test_a_truly_read_only_data_directory_still_lends_its_corrections(tmp_path: Path) -> None:
    """In a real read-only directory (not a refused connect), a WAL file closed cleanly has no -shm,
    which SQLite cannot create there: `mode=ro` failed too, so every correction was hidden ("0
    learned", exports empty, the daemon routing without them). A '#' in the path cut the URI."""
    data = tmp_path / "data #1 ü"
    with closing(LearnedStore.open(data)) as store:
        store.record(CORE, "docker", MISS)
    assert not list(data.glob("*-shm"))
    try:
        if not _freeze(data):
            pytest.skip("cannot make a directory read-only here (root without chattr)")
        with closing(LearnedStore.open(data)) as store:
            assert not store.persistent
            assert store.for_tap(CORE) == {"docker": (MISS,)}
            assert store.error is not None and "the 1 it holds are used, read-only" in store.error
    finally:
        _thaw(data)


def _freeze(path: Path) -> bool:
    """Make a directory read-only even for root (chattr +i) if chmod does not stop us; False if impossible."""
    path.chmod(0o555)
    if not os.access(path, os.W_OK):
        return True
    return subprocess.run(["chattr", "+i", str(path)], capture_output=True, check=False).returncode == 0


def _thaw(path: Path) -> None:
    subprocess.run(["chattr", "-i", str(path)], capture_output=True, check=False)
    path.chmod(0o755)


def test_a_file_that_cannot_be_opened_says_what_to_do(tmp_path: Path) -> None:
    """The error named the file and SQLite's words ("file is not a database", "unable to open
    database file": a directory in its place) but not what to do about it."""
    damaged = tmp_path / "bad" / "learned.sqlite3"
    damaged.parent.mkdir()
    damaged.write_bytes(b"not a database" * 100)
    with closing(LearnedStore(damaged)) as store:
        assert store.error is not None and "the file is damaged" in store.error and "move it aside" in store.error
    assert damaged.read_bytes() == b"not a database" * 100
    directory = tmp_path / "dir" / "learned.sqlite3"
    directory.mkdir(parents=True)
    with closing(LearnedStore(directory)) as store:
        assert store.error is not None and "a directory is in the file's place" in store.error


def test_corrections_learned_while_the_file_could_not_be_opened_are_stored_at_the_stop(tmp_path: Path) -> None:
    """A file that cannot be opened at the start (a disk full then, a directory in its place) left the
    store in memory for the whole run: what it learned went with the process, and close() said 0 lost."""
    path = tmp_path / "learned.sqlite3"
    path.mkdir()
    store = LearnedStore(path)
    assert not store.persistent and store.record(CORE, "docker", MISS)
    assert store.record(CORE, "git", "undo my last save point") and store.forget(capability="git") == 1
    assert store.close() == 1  # said: the caller warns that it is lost
    store = LearnedStore(path)
    assert store.record(CORE, "docker", MISS)
    path.rmdir()  # fixed while the daemon ran
    assert store.close() == 0
    with closing(LearnedStore(path)) as reopened:
        assert [(e.capability, e.message) for e in reopened.entries()] == [("docker", MISS)]


def test_a_damaged_file_is_reported_in_health_and_left_alone(tmp_path: Path,
                                                            settings_factory: SettingsFactory) -> None:
    settings = settings_factory(data_dir=tmp_path / "data")
    settings.data_dir.mkdir(parents=True)
    damaged = settings.data_dir / "learned.sqlite3"
    damaged.write_bytes(b"not a database" * 100)
    with closing(Service(settings, sessions=True).start()) as service:
        (error,) = [e for e in service.health()["errors"] if e["file"] == str(damaged)]
        assert "keeping them in memory" in error["reason"] and "cannot be read either" in error["reason"]
    assert damaged.read_bytes() == b"not a database" * 100


def test_corrections_take_the_latest_miss_within_the_window() -> None:
    turns = Corrections(window=3)
    turns.routed("s", "first message", "abstain", "mysql")
    turns.routed("s", "second message", "activate", "postgres")
    correction = turns.enabled("s", "docker")
    assert correction is not None and correction.message == "second message"
    # Only the latest turn, once: enabling again (say after a disable) used to reach back to
    # "first message", so toggling a capability taught it every recent message.
    assert turns.enabled("s", "docker") is None and turns.enabled("s", "mysql") is None
    turns.routed("s", "list my containers", "activate", "docker")
    assert turns.enabled("s", "docker") is None  # routing chose it: nothing to learn
    turns.routed("s", "ls", "skipped", None)
    turns.routed("s", "show the slow queries", "abstain", None)
    assert turns.enabled("s", "mysql").message == "show the slow queries"  # type: ignore[union-attr]
    assert turns.enabled("unknown", "x") is None


def test_a_disable_refuses_only_the_turn_that_just_activated_it() -> None:
    turns = Corrections(window=3)
    turns.routed("s", "first message", "activate", "docker")
    turns.routed("s", "second message", "abstain", None)
    assert turns.disabled("s", "docker") is None  # another message came in between: the work may be done
    turns.routed("s", "ls", "skipped", None)
    turns.routed("s", "tell me about yourself", "activate", "memory")
    assert turns.disabled("s", "git") is None  # routing did not activate git
    refused = turns.disabled("s", "memory")
    assert refused is not None and refused.message == "tell me about yourself"
    assert turns.disabled("s", "memory") is None  # refused once
    correction = turns.enabled("s", "time")  # ... and the agent enabled what it wanted instead
    assert correction is not None and (correction.message, correction.capability) == ("tell me about yourself",
                                                                                      "memory")
    turns.routed("t", "what time is it in Oslo", "activate", "time")
    turns.disabled("t", "time")
    again = turns.enabled("t", "time")  # enabled again: the refusal is taken back
    assert again is not None and again.refused and again.decision == "activate"
    assert turns.disabled("unknown", "x") is None


def test_the_agents_last_word_on_what_routing_activated_wins() -> None:
    """Disable, enable, disable again: the second disable taught nothing, so the enable's trigger
    stayed although the agent's last word was a refusal. Each word on the winner now counts."""
    turns = Corrections(window=3)
    turns.routed("s", "open a pull request for this branch", "activate", "github")
    words = [("disable", True), ("enable", True), ("disable", True), ("disable", False), ("enable", True),
             ("enable", False)]
    for word, teaches in words:
        turn = turns.disabled("s", "github") if word == "disable" else turns.enabled("s", "github")
        assert (turn is not None) == teaches, word
    assert turns.enabled("s", "git") is None  # the turn was corrected already: no other capability learns


def test_enable_and_disable_teach_the_same_in_either_order() -> None:
    """Routing activated A and the agent wanted B: disabling A then enabling B recorded both, but
    enabling B first marked the turn corrected and the disable of A was no longer learned."""
    for order in (("disable", "enable"), ("enable", "disable")):
        turns = Corrections(window=3)
        turns.routed("s", "read the config file", "activate", "filesystem-read")
        taught = {step: (turns.disabled("s", "filesystem-read") if step == "disable"
                         else turns.enabled("s", "filesystem-write")) for step in order}
        assert all(turn is not None and turn.message == "read the config file" for turn in taught.values()), order


@pytest.fixture
def daemon(tmp_path: Path, model_settings: Settings) -> Iterator[TestClient]:
    settings = replace(isolated_data_dir(model_settings, tmp_path), taps=(CORE,), rule="fused")
    with local_client(create_app(settings, watch=False, warm_in_background=False)) as client:
        yield client


def test_a_manual_enable_after_a_miss_teaches_the_daemon(daemon: TestClient) -> None:
    service = daemon.app.state.service  # type: ignore[attr-defined]
    before = daemon.post("/v1/route", json={"session": "a", "message": MISS}).json()
    assert before["decision"] == "abstain"
    assert daemon.post("/v1/sessions/a/enable", json={"name": "docker"}).status_code == 200
    [entry] = service.learned.entries()
    assert (entry.capability, entry.message, entry.previous, entry.session) == ("docker", MISS, "abstain", "a")
    assert service.apply_learned() == 1
    after = daemon.post("/v1/route", json={"session": "b", "message": MISS}).json()
    assert (after["decision"], after["capability"]) == ("activate", "docker")
    # routing got it right this time: enabling it again teaches nothing new
    daemon.post("/v1/sessions/b/disable", json={"name": "docker"})
    daemon.post("/v1/sessions/b/enable", json={"name": "docker"})
    assert len(service.learned.entries()) == 1
    # the tap itself is never modified
    assert MISS not in (CORE / "capabilities" / "docker" / "config.toml").read_text()


def test_a_session_id_used_again_after_its_session_ended_learns_nothing_from_before(daemon: TestClient) -> None:
    """Agents reuse session ids ("default", one per repository): the first enable of a new
    conversation must not be learned as a correction of the last message of the one before."""
    service = daemon.app.state.service  # type: ignore[attr-defined]
    assert daemon.post("/v1/route", json={"session": "a", "message": MISS}).json()["decision"] == "abstain"
    assert daemon.delete("/v1/sessions/a").status_code == 200
    assert daemon.post("/v1/sessions/a/enable", json={"name": "docker"}).status_code == 200
    assert service.learned.entries() == []
    daemon.post("/v1/route", json={"session": "a", "message": MISS})  # within the new session it still learns
    daemon.post("/v1/sessions/a/enable", json={"name": "postgres"})
    assert [(e.capability, e.message) for e in service.learned.entries()] == [("postgres", MISS)]


def test_a_disable_right_after_an_activation_teaches_the_daemon_to_abstain(daemon: TestClient) -> None:
    service = daemon.app.state.service  # type: ignore[attr-defined]
    before = daemon.post("/v1/route", json={"session": "a", "message": LEAK}).json()
    assert (before["decision"], before["capability"]) == ("activate", "time")
    assert daemon.post("/v1/sessions/a/disable", json={"name": "time"}).status_code == 200
    [entry] = service.learned.entries()
    assert (entry.kind, entry.capability, entry.message, entry.previous) == ("abstain", "time", LEAK, "time")
    assert service.apply_learned() == 1
    for message in (LEAK, "time really flies"):  # the refused message and a paraphrase
        after = daemon.post("/v1/route", json={"session": "b", "message": message}).json()
        assert after["decision"] == "abstain" and after["capability"] == "time", after
        assert "vetoed" in after["reason"] and LEAK in after["reason"]
    wanted = daemon.post("/v1/route", json={"session": "c", "message": "what time is it in Tokyo"})
    assert (wanted.json()["decision"], wanted.json()["capability"]) == ("activate", "time")  # time still works
    # the agent disagrees with the veto: enabling memory now records the message as its trigger instead
    daemon.post("/v1/route", json={"session": "d", "message": LEAK})
    daemon.post("/v1/sessions/d/enable", json={"name": "time"})
    assert [(e.kind, e.message) for e in service.learned.entries()] == [("trigger", LEAK)]
    assert "flies" not in (CORE / "capabilities" / "time" / "config.toml").read_text()


def test_learned_examples_survive_a_restart_and_the_anchor_rule_ignores_them(tmp_path: Path,
                                                                             model_settings: Settings) -> None:
    settings = replace(isolated_data_dir(model_settings, tmp_path), taps=(CORE,))
    LearnedStore.open(settings.data_dir).record(CORE, "docker", MISS, "abstain", "a")
    best = {}
    for rule in ("fused", "capd", "anchor"):
        with local_client(create_app(replace(settings, rule=rule), watch=False, warm_in_background=False)) as client:
            result = client.post("/v1/route", json={"session": "s", "message": MISS}).json()
            best[rule] = result["candidates"][0]["name"], result["decision"]
    assert best["fused"] == ("docker", "activate")
    assert best["capd"][0] == "docker"  # the learned example is one of its triggers now
    assert best["anchor"][0] != "docker"  # the reference rule routes on the tap alone


def test_a_corrected_message_seen_again_goes_where_the_agent_sent_it(tmp_path: Path,
                                                                     model_settings: Settings) -> None:
    """A learned trigger is one example among the capability's others: the very message an agent
    corrected could still route elsewhere (docker's own triggers beat one learned example). Seen
    again, word for word (case and spacing aside), it goes where the agent sent it when routing got
    it wrong: the agent refused what it activated, or it abstained. An enable that kept what routing
    activated may only add tools, so it stays an example; a paraphrase is scored as before;
    corrections that disagree recall nothing; anchor ignores them."""
    settings = replace(isolated_data_dir(model_settings, tmp_path), taps=(CORE,))
    corrected, kept = "list my running docker containers", "show me the docker containers that run"
    with closing(LearnedStore.open(settings.data_dir)) as store:
        store.record(CORE, "docker", corrected, "docker", "a", kind="abstain")  # refused docker ...
        store.record(CORE, "kubernetes", corrected, "docker", "a")  # ... and enabled kubernetes instead
        store.record(CORE, "kubernetes", kept, "docker", "b")  # docker kept: kubernetes added, not a correction
    routed: dict[str, dict[str, Any]] = {}
    for rule in ("capd", "fused", "anchor"):
        with local_client(create_app(replace(settings, rule=rule), watch=False, warm_in_background=False)) as client:
            for message in (corrected, "  List my running DOCKER   containers", "which docker containers are up",
                            kept):
                routed[f"{rule}: {message}"] = client.post("/v1/route", json={"message": message}).json()
            active = client.post("/v1/route", json={"session": rule, "message": corrected}).json()
            again = client.post("/v1/route", json={"session": rule, "message": corrected}).json()
        if rule != "anchor":
            assert (active["decision"], again["decision"]) == ("activate", "already_active"), rule
    for rule in ("capd", "fused"):
        for message in (corrected, "  List my running DOCKER   containers"):
            result = routed[f"{rule}: {message}"]
            assert (result["decision"], result["capability"]) == ("activate", "kubernetes"), (rule, result)
            assert "enabled it for this very message before" in result["reason"]
        for message in ("which docker containers are up", kept):
            assert "this very message" not in routed[f"{rule}: {message}"]["reason"], (rule, message)
    assert routed[f"anchor: {corrected}"]["capability"] != "kubernetes"
    missed = "the thing with the boxes is slow again"  # abstains: two agents enabled two capabilities for it
    with closing(LearnedStore.open(settings.data_dir)) as store:
        store.record(CORE, "docker", missed, "abstain", "c")
        store.record(CORE, "kubernetes", missed, "abstain", "d")
    with local_client(create_app(settings, watch=False, warm_in_background=False)) as client:
        assert "this very message" not in client.post("/v1/route", json={"message": missed}).json()["reason"]
        assert "this very message" in client.post("/v1/route", json={"message": corrected}).json()["reason"]


def test_cli_lists_exports_and_forgets(tmp_path: Path) -> None:
    store = LearnedStore.open(tmp_path)
    store.record(CORE, "docker", MISS, "abstain", "a")
    store.record(CORE, "git", "undo my last save point", "mysql", "a")
    store.record(CORE, "memory", CHATTER, "memory", "a", kind="abstain")
    store.close()
    runner = CliRunner()
    listed = runner.invoke(main, ["learned", "list", "--data-dir", str(tmp_path), "--json"])
    assert listed.exit_code == 0 and json.loads(listed.output)["count"] == 3
    assert {e["kind"] for e in json.loads(listed.output)["learned"]} == {"trigger", "abstain"}
    text = runner.invoke(main, ["learned", "list", "--data-dir", str(tmp_path)]).output
    assert "-/-> memory" in text and "2 learned triggers, 1 learned abstain" in text
    exported = runner.invoke(main, ["learned", "export", "--data-dir", str(tmp_path), "--tap", str(CORE)])
    suggestions = tomllib.loads(exported.output)
    assert suggestions["docker"]["add_triggers"] == [MISS]
    assert suggestions["git"]["file"].endswith("capabilities/git")
    assert suggestions["memory"] == {"file": str(CORE / "capabilities" / "memory"), "refused_messages": [CHATTER]}
    refused = runner.invoke(main, ["learned", "forget", "--data-dir", str(tmp_path)])
    assert refused.exit_code == 2 and "--all" in refused.output
    both = runner.invoke(main, ["learned", "forget", "git", "--all", "--data-dir", str(tmp_path)])
    assert both.exit_code == 2 and "not both" in both.output  # --all would forget more than git
    forgot = runner.invoke(main, ["learned", "forget", "git", "--data-dir", str(tmp_path), "--json"],
                           env={"CAPD_PORT": "1"})  # no daemon there to reload
    assert forgot.exit_code == 0, forgot.output
    assert json.loads(forgot.output) == {"forgotten": 1, "daemon_reloaded": False}
    assert [e.capability for e in LearnedStore.open(tmp_path).entries()] == ["docker", "memory"]
    misspelt = runner.invoke(main, ["learned", "forget", "dokcer", "--data-dir", str(tmp_path)], env={"CAPD_PORT": "1"})
    assert misspelt.exit_code == 0 and misspelt.stdout == "forgot 0 learned examples\n"
    assert "nothing learned matches" in misspelt.stderr


def test_a_learning_pass_after_close_does_nothing(settings_factory: SettingsFactory, tmp_path: Path) -> None:
    """The learning timer may fire while the service closes: it must not touch the closed stores."""
    service = Service(settings_factory(taps=(octomind_tap(tmp_path / "tap"),), rule="fused"), sessions=True,
                      learn=True).start()
    assert service.registry is not None and service.learned is not None
    service.route("something the tap cannot place at all", "s")
    service.registry.activate("s", "filesystem-read", "manual")  # a correction: schedules a learning pass
    service.close()
    assert service.apply_learned() == 0


# -- corrections changed by another process (capd learned forget, a second daemon) --------------------------

PLACELESS = "something the tap cannot place at all"  # abstains on the octomind tap (hash model)


def _decision(service: Service, message: str = PLACELESS) -> tuple[str, str | None]:
    decision = service.route(message).decision
    return decision.decision, decision.capability if decision.decision == "activate" else None


def test_a_daemon_routes_with_corrections_another_process_changed(settings_factory: SettingsFactory,
                                                                  tmp_path: Path) -> None:
    """Two daemons on one data directory, and `capd learned forget` (a store of its own): each
    daemon used to route with what the others forgot, or without what they learned, until its own
    next learning pass or a restart."""
    settings = settings_factory(taps=(octomind_tap(tmp_path / "tap"),), rule="capd")
    with closing(Service(settings, sessions=True, learn=True).start()) as first, \
            closing(Service(settings, sessions=True, learn=True).start()) as second:
        assert first.registry is not None and _decision(first) == _decision(second) == ("abstain", None)
        first.route(PLACELESS, "s")
        first.registry.activate("s", "filesystem-read", "manual")  # a correction, recorded by the first
        assert not first.refresh_learned()  # its own write is no change from elsewhere: its learning pass ...
        assert first.apply_learned() == 1 and _decision(first) == ("activate", "filesystem-read")  # ... applies it
        assert not first.refresh_learned()
        assert second.refresh_learned() and _decision(second) == ("activate", "filesystem-read")
        assert not second.refresh_learned()  # nothing new since
        with closing(LearnedStore.open(settings.data_dir)) as cli:  # what `capd learned forget` does ...
            assert cli.forget(capability="filesystem-read") == 1
        first.reload()  # ... then it asks the daemon at its address to reload: that one re-reads at once
        assert not first.refresh_learned() and second.refresh_learned()
        assert _decision(first) == _decision(second) == ("abstain", None)
        with closing(LearnedStore.open(settings.data_dir)) as other:  # a daemon serving another tap
            other.record(tmp_path / "another-tap", "filesystem-read", PLACELESS)
        routers = first.router, second.router
        assert not first.refresh_learned() and not second.refresh_learned()  # nothing they route with
        assert first.router is routers[0] and second.router is routers[1]  # not even re-published


def test_stores_in_memory_and_services_without_learning_check_nothing(settings_factory: SettingsFactory,
                                                                      tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    assert LearnedStore(None).version() is None
    with closing(Service(settings_factory(), sessions=True, learn=False).start()) as unlearned:
        assert unlearned.learned is None and not unlearned.refresh_learned()
    with closing(LearnedStore.open(tmp_path)) as store:
        store.record(CORE, "docker", MISS)
    _refuse_writes(monkeypatch)
    copied = LearnedStore.open(tmp_path)  # the file's entries, copied once into memory
    monkeypatch.undo()
    with closing(LearnedStore.open(tmp_path)) as writer:  # whoever can write the file
        writer.forget()
    assert copied.version() is None and copied.for_tap(CORE) == {"docker": (MISS,)}  # read at the start only
    copied.close()
    closed = LearnedStore.open(tmp_path)
    closed.close()
    assert closed.version() is None


def test_a_file_that_cannot_be_checked_is_logged_once_and_routing_goes_on(settings_factory: SettingsFactory,
                                                                         tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    settings = settings_factory(taps=(octomind_tap(tmp_path / "tap"),), rule="capd")
    with closing(Service(settings, sessions=True, learn=True).start()) as service:
        assert service.learned is not None
        with closing(LearnedStore.open(settings.data_dir)) as other:
            other.record(service.capability("filesystem-read").tap, "filesystem-read", PLACELESS)

        def no_pragmas(action: int, *_: object) -> int:  # SQLite refuses the check: "not authorized"
            return sqlite3.SQLITE_DENY if action == sqlite3.SQLITE_PRAGMA else sqlite3.SQLITE_OK

        service.learned._conn.set_authorizer(no_pragmas)
        with caplog.at_level(logging.WARNING, logger="capd.learned"):
            assert not any(service.refresh_learned() for _ in range(5))
            assert caplog.text.count("cannot check") == 1 and "not authorized" in caplog.text
            assert _decision(service) == ("abstain", None)  # what it routed with before
            service.learned._conn.set_authorizer(None)
            assert service.refresh_learned() and _decision(service) == ("activate", "filesystem-read")
            assert "can be checked again" in caplog.text


# -- found by review (2026-11-26) ---------------------------------------------------------------------------

@pytest.mark.parametrize("rule", ["capd", "fused"])
def test_a_message_equal_to_a_trigger_is_never_vetoed(settings_factory: SettingsFactory, tmp_path: Path,
                                                      rule: str) -> None:
    """Refusing a trigger's exact text vetoed that trigger on 3 of 11 here (40 of the real model's on
    taps/core, 7 vetoed): the refused message scored 1.0 and the trigger 0.99999994."""
    tap = octomind_tap(tmp_path / "tap")
    settings = settings_factory(taps=(tap,), rule=rule)
    with closing(Service(settings, sessions=True, learn=True).start()) as service:
        assert service.registry is not None and service.learned is not None
        tried = 0
        for capability in service.catalog_now():
            for trigger in capability.triggers:
                decision = service.route(trigger, "s").decision
                if (decision.decision, decision.capability) != ("activate", capability.name):
                    continue
                service.registry.deactivate("s", capability.name)  # refuses exactly this text
                service.apply_learned()
                again = service.route(trigger).decision
                assert "vetoed" not in again.reason, (trigger, again.reason)
                tried += 1
                service.learned.forget()
                service.apply_learned()
        assert tried >= 5


def test_enabling_a_capability_without_triggers_leaves_the_turn_to_the_real_correction(
        settings_factory: SettingsFactory, tmp_path: Path) -> None:
    """It teaches nothing (no triggers to add to), but it marked the turn corrected, so the enable
    that followed was not learned."""
    tap = octomind_tap(tmp_path / "tap")
    (tap / "capabilities" / "manual-only").mkdir()
    (tap / "capabilities" / "manual-only" / "default.toml").write_text("[deps]\nrequire = [\"some/thing\"]\n")
    with closing(Service(settings_factory(taps=(tap,)), sessions=True, learn=True).start()) as service:
        assert service.registry is not None and service.learned is not None
        assert service.route(PLACELESS, "s").decision.decision == "abstain"
        service.registry.activate("s", "manual-only", "manual")
        service.registry.activate("s", "filesystem-read", "manual")
        assert [(e.capability, e.message) for e in service.learned.entries()] == [("filesystem-read", PLACELESS)]


def test_enabling_what_is_already_active_teaches_nothing(settings_factory: SettingsFactory, tmp_path: Path) -> None:
    """A model re-enabling an active capability out of habit taught it every abstained message
    (a "thanks!" learned as a trigger); the enable changed nothing in the session."""
    tap = octomind_tap(tmp_path / "tap")
    with closing(Service(settings_factory(taps=(tap,)), sessions=True, learn=True).start()) as service:
        assert service.registry is not None and service.learned is not None
        service.registry.activate("s", "filesystem-read", "manual")
        assert service.route(PLACELESS, "s").decision.decision == "abstain"
        service.registry.activate("s", "filesystem-read", "manual")
        assert service.learned.entries() == []
        service.registry.deactivate("s", "filesystem-read")
        service.registry.activate("s", "filesystem-read", "manual")  # now it changes the session: learned
        assert [e.message for e in service.learned.entries()] == [PLACELESS]


def test_a_lowered_learn_max_applies_to_what_is_stored(tmp_path: Path) -> None:
    """It was applied only at the capability's next correction: until then all 20 routed."""
    with closing(LearnedStore.open(tmp_path, 100)) as store:
        for i in range(20):
            store.record(CORE, "docker", f"stuck agent turn {i}", "abstain", "s")
    with closing(LearnedStore.open(tmp_path, 5)) as store:
        assert store.for_tap(CORE) == {"docker": tuple(f"stuck agent turn {i}" for i in range(15, 20))}


def test_a_tap_is_one_tap_however_its_path_is_spelled(tmp_path: Path) -> None:
    """`config/../taps/x`, `taps/x` and a link to it: corrections learned under one spelling were
    not used, listed, forgotten or exported under another."""
    real = octomind_tap(tmp_path / "taps")
    (tmp_path / "link").symlink_to(real)
    dotted = tmp_path / "config" / ".." / "taps" / real.name
    store = LearnedStore.open(tmp_path / "data")
    store.record(dotted, "filesystem-read", "open the notes file", "abstain", "s")
    store.record(tmp_path / "link", "filesystem-read", "show me the readme", "abstain", "s")
    assert [e.tap for e in store.entries()] == [str(real.resolve())] * 2
    assert store.for_tap(real) == {"filesystem-read": ("open the notes file", "show me the readme")}
    # a file written before taps were stored by their real path: its spellings are found too
    with closing(sqlite3.connect(tmp_path / "data" / "learned.sqlite3")) as conn, conn:
        conn.execute("INSERT INTO learned VALUES (?, 'git', 'undo that commit', 'abstain', 's', 1.0, 'trigger')",
                     (str(dotted),))
    assert store.for_tap(tmp_path / "link") == {"filesystem-read": ("open the notes file", "show me the readme"),
                                                 "git": ("undo that commit",)}
    assert store.forget(tap=real, capability="git") == 1
    store.close()
    # one tap named twice, under two spellings, is listed once
    twice = ["learned", "list", "--json", "--data-dir", str(tmp_path / "data"), "--tap", str(real),
             "--tap", str(tmp_path / "link")]
    assert json.loads(CliRunner().invoke(main, twice).output)["count"] == 2


def test_export_is_valid_toml_whatever_it_holds(tmp_path: Path) -> None:
    """Printed and exit 0, but not TOML: a capability learned for two taps gave the same table twice, a
    DEL in a message and a character outside the BMP in a tap path were written as TOML forbids."""
    first, second = octomind_tap(tmp_path / "one"), octomind_tap(tmp_path / "two \U0001f680")
    odd = "list \x7f the\tfiles \"quoted\" \\ back\nslash \u2028 ok"
    store = LearnedStore.open(tmp_path / "data")
    store.record(first, "filesystem-read", odd, "abstain", "s")
    store.record(second, "filesystem-read", "read the config", "abstain", "s")
    store.record(second, "git", "undo that commit", "abstain", "s")
    store.close()
    result = CliRunner().invoke(main, ["learned", "export", "--data-dir", str(tmp_path / "data")])
    assert result.exit_code == 0, result.output
    exported = tomllib.loads(result.output)
    assert exported[f"filesystem-read @ {first.resolve()}"]["add_triggers"] == [odd]
    assert exported[f"filesystem-read @ {second.resolve()}"]["file"] == str(second.resolve() / "capabilities"
                                                                             / "filesystem-read")
    assert exported["git"]["add_triggers"] == ["undo that commit"]  # a name learned for one tap keeps its plain key


def test_learned_commands_do_not_create_a_mistyped_data_directory(tmp_path: Path) -> None:
    """They created the directory and an empty learned.sqlite3 there, and reported 0 as if all was well."""
    typo = tmp_path / "no" / "such" / "dir"
    for args in (["list"], ["export"], ["forget", "docker"]):
        result = CliRunner().invoke(main, ["learned", *args, "--data-dir", str(typo)], env={"CAPD_PORT": "1"})
        assert result.exit_code == 0, result.output
        assert f"no learned corrections in {typo}" in result.stderr
    assert not (tmp_path / "no").exists()


def test_learned_commands_fail_on_a_file_they_cannot_read(tmp_path: Path) -> None:
    """A damaged learned.sqlite3 (or a directory in its place) listed "0 learned triggers" with exit
    0: a script could not tell it from nothing learned."""
    for name, make in (("damaged", lambda p: p.write_bytes(b"not a database " * 400)), ("folder", Path.mkdir)):
        data = tmp_path / name
        data.mkdir()
        make(data / "learned.sqlite3")
        for args in (["list"], ["export"], ["forget", "--all"]):
            result = CliRunner().invoke(main, ["learned", *args, "--data-dir", str(data)], env={"CAPD_PORT": "1"})
            assert result.exit_code == 1, (name, args, result.output)
            assert "learned.sqlite3" in result.stderr and "cannot be read" in result.stderr
    assert (tmp_path / "damaged" / "learned.sqlite3").read_bytes() == b"not a database " * 400  # left as it is


def test_learned_list_and_export_only_read_the_file(tmp_path: Path) -> None:
    """They opened the store for writing: a zero-length learned.sqlite3 (a data directory a daemon
    had not written yet) got the schema written into it by a command that only lists."""
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "learned.sqlite3").touch()
    held = tmp_path / "held"
    store = LearnedStore.open(held)
    store.record(CORE, "docker", MISS, "abstain", "a")
    store.close()
    before = (held / "learned.sqlite3").read_bytes()
    for args in (["list", "--json"], ["export", "--format", "json"]):
        result = CliRunner().invoke(main, ["learned", *args, "--data-dir", str(empty)])
        assert result.exit_code == 0, result.output
        assert json.loads(result.output) in ({"learned": [], "count": 0}, {"suggestions": []})
        listed = CliRunner().invoke(main, ["learned", *args, "--data-dir", str(held)])
        assert listed.exit_code == 0 and MISS in listed.output
    assert (empty / "learned.sqlite3").stat().st_size == 0
    assert (held / "learned.sqlite3").read_bytes() == before
    # nothing left beside the file either (a read-only connection left a -wal and a -shm)
    assert sorted(p.name for p in held.iterdir() if p.name.startswith("learned")) == ["learned.sqlite3"]
    assert sorted(p.name for p in empty.iterdir()) == ["learned.sqlite3"]


def test_a_correction_recorded_while_a_learning_pass_publishes_is_routed_with(
        settings_factory: SettingsFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second pass was not scheduled while the first one's thread was alive, and the first had
    read the corrections before this one came in: it stayed unused until the next correction (a
    daemon's own corrections do not count as a change of the file). A fused refit takes seconds,
    and the enable waited for it: scheduling took the lock the publish holds."""
    import threading
    import time

    from capd import corrections

    monkeypatch.setattr(corrections, "LEARN_DELAY", 0.05)
    tap = octomind_tap(tmp_path / "tap")
    with closing(Service(settings_factory(taps=(tap,)), sessions=True, learn=True).start()) as service:
        assert service.registry is not None
        publishing, go_on = threading.Event(), threading.Event()
        publish = service._publish

        def slow_publish(*args: Any, **kwargs: Any) -> Any:
            publishing.set()
            go_on.wait(5)
            return publish(*args, **kwargs)

        monkeypatch.setattr(service, "_publish", slow_publish)
        service.route(PLACELESS, "a")
        service.registry.activate("a", "filesystem-read", "manual")  # the first correction: a pass starts
        assert publishing.wait(5)
        service.route(PLACELESS, "b")
        enable = threading.Thread(target=service.registry.activate, args=("b", "filesystem-write", "manual"))
        enable.start()  # recorded while that pass publishes ...
        enable.join(3)
        assert not enable.is_alive()  # ... and it does not wait for the publish (it took the service's lock)
        go_on.set()
        deadline = time.monotonic() + 5
        while "filesystem-write" not in service._learned_in_use[0] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert service._learned_in_use[0] == {"filesystem-read": (PLACELESS,), "filesystem-write": (PLACELESS,)}


# -- damaged rows, and a file damaged while in use (robustness audit) -----------------------------------------

def _insert_damaged_rows(path: Path, tap: str) -> None:
    """Rows no capd writes, as a damaged or edited file holds them: a BLOB message, a ``created`` that is
    no number (beside a good correction of the same capability), text that is not UTF-8, an unknown kind."""
    with closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("INSERT INTO learned VALUES (?, 'filesystem-read', x'ff00fe', NULL, NULL, 1.0, 'trigger')",
                     (tap,))
        conn.execute("INSERT INTO learned VALUES (?, 'filesystem-read', 'yesterday it worked', NULL, NULL, "
                     "'yesterday', 'trigger')", (tap,))
        conn.execute("INSERT INTO learned VALUES (?, 'filesystem-read', CAST(x'eda080' AS TEXT), NULL, NULL, 1.0, "
                     "'abstain')", (tap,))
        conn.execute("INSERT INTO learned VALUES (?, 'filesystem-write', 'an odd one', NULL, NULL, 1.0, 'maybe')",
                     (tap,))


def test_rows_that_are_no_corrections_are_skipped_and_said(settings_factory: SettingsFactory, tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """One damaged row failed the daemon's start ("'bytes' object has no attribute 'encode'", "'<' not
    supported between 'str' and 'float'", "Could not decode to UTF-8 column 'message'"): every endpoint
    answered 503. `capd learned export` crashed, `capd learned list` said the file cannot be read. They
    are skipped, said once with the file's name and how many, and left in the file."""
    settings = settings_factory(taps=(octomind_tap(tmp_path / "tap"),), rule="capd")
    tap = canonical_tap(tmp_path / "tap" / "tap")
    with closing(LearnedStore.open(settings.data_dir)) as store:
        store.record(tap, "filesystem-read", PLACELESS)
    path = settings.data_dir / "learned.sqlite3"
    _insert_damaged_rows(path, tap)
    with caplog.at_level(logging.WARNING, logger="capd.learned"), \
            closing(Service(settings, sessions=True, learn=True).start()) as service:
        assert service.health()["status"] == "ok"
        assert _decision(service) == ("activate", "filesystem-read")  # the good correction is routed with
        assert service.learned is not None
        assert service.learned.record(tap, "filesystem-read", "open the notes I wrote")  # beside 'yesterday'
        assert service.apply_learned() == 2
    assert caplog.text.count("skipped") == 2  # once per read that found them (triggers, abstains), not per reload
    assert f"{path}: skipped 2 row(s) that cannot be read as learned corrections" in caplog.text
    for args in (["list", "--json"], ["export", "--format", "json"]):
        result = CliRunner().invoke(main, ["learned", *args, "--data-dir", str(settings.data_dir)])
        assert result.exit_code == 0, result.output
        assert PLACELESS in result.output and "yesterday" not in result.output
        assert f"{path}: skipped 4 row(s)" in result.stderr
    with closing(sqlite3.connect(path)) as conn:
        assert conn.execute("SELECT count(*) FROM learned").fetchone()[0] == 6  # left in the file


def test_a_file_damaged_while_the_daemon_runs_keeps_its_corrections_in_memory(
        settings_factory: SettingsFactory, tmp_path: Path) -> None:
    """learned.sqlite3 damaged under a running daemon failed every later reload (a tap edit, POST
    /v1/reload: "file is not a database"), while health said all was well. It is now taken as at the
    start: the store goes on in memory, with the corrections read before, and health names the file."""
    settings = settings_factory(taps=(octomind_tap(tmp_path / "tap"),), rule="capd")
    with closing(LearnedStore.open(settings.data_dir)) as store:
        store.record(tmp_path / "tap" / "tap", "filesystem-read", PLACELESS)
    path = settings.data_dir / "learned.sqlite3"
    with closing(Service(settings, sessions=True, learn=True).start()) as service:
        assert _decision(service) == ("activate", "filesystem-read")
        for damaged in (path, path.with_name(path.name + "-shm")):
            damaged.write_bytes(b"\0" * damaged.stat().st_size)
        before = path.read_bytes()
        assert service.reload()["errors"] == []
        assert _decision(service) == ("activate", "filesystem-read")  # the correction read before the damage
        (error,) = [e for e in service.health()["errors"] if e["file"] == str(path)]
        assert "keeping them in memory" in error["reason"] and "the file is damaged" in error["reason"]
        assert service.registry is not None and service.learned is not None
        service.route("nothing here fits at all, really", "s")
        service.registry.activate("s", "python-toolchain", "manual")  # learned in memory
        assert service.apply_learned() == 2
    assert path.read_bytes() == before  # left as it is


def test_a_learned_tap_path_that_is_not_there_is_warned_about(tmp_path: Path) -> None:
    """A mistyped --tap listed '0 learned triggers' and exited 0, as if the tap had learned nothing."""
    store = LearnedStore.open(tmp_path)
    store.record(CORE, "docker", MISS, "abstain", "a")
    store.close()
    gone = tmp_path / "taps" / "cor"
    for command in ("list", "export"):
        result = CliRunner().invoke(main, ["learned", command, "--tap", str(gone), "--data-dir", str(tmp_path)])
        assert result.exit_code == 0 and MISS not in result.stdout
        assert f"warning: {gone}: no such tap directory" in result.stderr
        result = CliRunner().invoke(main, ["learned", command, "--tap", str(CORE), "--data-dir", str(tmp_path)])
        assert MISS in result.stdout and result.stderr == ""
