"""Live reload: apply_changes directly, and a real watchdog observer end to end."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from capd import watcher as watcher_module
from capd.api import create_app
from capd.errors import Stopping
from capd.service import Service
from capd.settings import Settings
from capd.watcher import TapWatcher
from tests.conftest import HeldEncoder
from tests.taputil import POSTGRES_PROVIDER, local_client, octomind_tap, write_capability


def _service(tmp_path: Path) -> tuple[Service, Path]:
    tap = octomind_tap(tmp_path)
    settings = Settings(taps=(tap,), data_dir=tmp_path / "data", model="hash")
    return Service(settings, sessions=True).start(), tap


def _wait(condition: Callable[[], bool], timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_apply_changes_reembeds_only_changed_triggers(tmp_path: Path) -> None:
    service, tap = _service(tmp_path)
    watcher = TapWatcher(service)
    config = tap / "capabilities" / "smalltalk" / "config.toml"
    config.write_text(config.read_text().replace("weather today", "weather this weekend"))
    report = watcher.apply_changes([config])
    assert report["changed"] == ["smalltalk"] and report["embedded"] == 1  # one new trigger text, nothing else


def test_the_report_names_capabilities_without_triggers_too(tmp_path: Path) -> None:
    """What changed is the catalog's difference (by content), not the trigger index's: a capability
    with only a provider (no config.toml, so no triggers) was missing from added / changed / removed."""
    service, tap = _service(tmp_path)
    watcher = TapWatcher(service)
    folder = write_capability(tap, "pg-tools", providers={"postgres": POSTGRES_PROVIDER}, default="postgres")
    assert watcher.apply_changes([folder / "postgres.toml"])["added"] == ["pg-tools"]
    (folder / "postgres.toml").write_text(POSTGRES_PROVIDER.replace("npx", "uvx"))
    assert watcher.apply_changes([folder / "postgres.toml"])["changed"] == ["pg-tools"]
    shutil.rmtree(folder)
    assert watcher.apply_changes([folder])["removed"] == ["pg-tools"]


def test_broken_file_keeps_last_good_version(tmp_path: Path) -> None:
    service, tap = _service(tmp_path)
    watcher = TapWatcher(service)
    config = tap / "capabilities" / "smalltalk" / "config.toml"
    good = config.read_text()
    config.write_text("triggers = [\n  'unterminated\n")
    watcher.apply_changes([config])
    assert "smalltalk" in service.catalog_now()
    assert service.catalog_now().capabilities["smalltalk"].triggers[0] == "tell me about the weather today"
    errors = service.health()["errors"]
    assert len(errors) == 1 and errors[0]["file"].endswith("smalltalk/config.toml") and errors[0]["line"] == 2
    config.write_text(good)
    watcher.apply_changes([config])
    assert service.health()["errors"] == []


def test_an_edit_reaches_the_folders_that_link_to_it(tmp_path: Path) -> None:
    """Watchers report the target's path: a folder that is a link, or has a file that is one, used
    to keep the old triggers until a full rescan."""
    service, tap = _service(tmp_path)
    watcher = TapWatcher(service)
    caps = tap / "capabilities"
    os.symlink("smalltalk", caps / "smalltalk-alias")
    (caps / "smalltalk-copy").mkdir()
    os.symlink("../smalltalk/config.toml", caps / "smalltalk-copy" / "config.toml")
    watcher.apply_changes([caps / "smalltalk-alias", caps / "smalltalk-copy"])
    config = caps / "smalltalk" / "config.toml"
    config.write_text('triggers = ["how fast can an ostrich run"]\n')
    report = watcher.apply_changes([config])
    assert sorted(report["changed"]) == ["smalltalk", "smalltalk-alias", "smalltalk-copy"]
    catalog = service.catalog_now()
    assert {catalog.capabilities[n].triggers for n in report["changed"]} == {("how fast can an ostrich run",)}


def test_retargeting_a_link_in_the_middle_of_a_chain_reloads_what_ends_there(tmp_path: Path) -> None:
    """A file (``default.toml``) and a capability folder, each a link to a link that is retargeted:
    the event names the middle link, whose old and new targets are neither link's old real path."""
    service, tap = _service(tmp_path)
    watcher = TapWatcher(service)
    for version in ("v1", "v2"):
        (tap / "versions" / f"cap-{version}").mkdir(parents=True)
        (tap / "versions" / f"{version}.toml").write_text(f"# Title: Postgres {version}\n{POSTGRES_PROVIDER}")
        (tap / "versions" / f"cap-{version}" / "config.toml").write_text(f'triggers = ["release {version} notes"]\n')
    (tap / "shared").mkdir()
    os.symlink("../versions/v1.toml", tap / "shared" / "current.toml")
    os.symlink("../versions/cap-v1", tap / "shared" / "cap-current")
    folder = write_capability(tap, "pg", ["query the postgres database"])
    os.symlink("../../shared/current.toml", folder / "default.toml")
    os.symlink("../shared/cap-current", tap / "capabilities" / "notes")
    watcher.apply_changes([folder, tap / "capabilities" / "notes"])
    assert service.catalog_now().capabilities["pg"].title == "Postgres v1"
    for link, target in (("current.toml", "../versions/v2.toml"), ("cap-current", "../versions/cap-v2")):
        (tap / "shared" / link).unlink()
        os.symlink(target, tap / "shared" / link)
    report = watcher.apply_changes([tap / "shared" / "current.toml", tap / "shared" / "cap-current"])
    assert sorted(report["changed"]) == ["notes", "pg"]
    catalog = service.catalog_now()
    assert catalog.capabilities["pg"].title == "Postgres v2"
    assert catalog.capabilities["notes"].triggers == ("release v2 notes",)


def test_an_edit_of_the_taps_vetoes_alone_reloads_them(tmp_path: Path) -> None:
    """vetoes.jsonl is neither a .toml nor a folder: the watcher's filter let it by all the same, and
    a bad line shows in health on its line while the good ones are in force."""
    service, tap = _service(tmp_path)
    watcher = TapWatcher(service)
    vetoes = tap / "vetoes.jsonl"
    vetoes.write_text('{"message": "tell me a joke", "expect": null}\n{oops\n')
    assert watcher.apply_changes([vetoes]) != {}
    assert service.router.vetoes.taps[tap][0] == ("tell me a joke",)
    (error,) = service.health()["errors"]
    assert error["file"] == str(vetoes) and error["line"] == 2 and "vetoes nothing" in error["reason"]
    vetoes.unlink()
    watcher.apply_changes([vetoes])
    assert tap not in service.router.vetoes.taps and service.health()["errors"] == []
    (tap / "notes.jsonl").write_text("{}\n")
    assert watcher.apply_changes([tap / "notes.jsonl"]) == {}  # other files of the tap still reload nothing


def test_a_broken_capd_toml_keeps_the_last_good_gates(tmp_path: Path) -> None:
    service, tap = _service(tmp_path)
    watcher = TapWatcher(service)
    gates = tap / "capd.toml"
    gates.write_text("[gates]\nthreshold = 0.99\n")
    watcher.apply_changes([gates])
    assert service.router.gates.for_tap(tap).threshold == 0.99
    gates.write_text("[gates\nthreshold = 0.99\n")
    watcher.apply_changes([gates])
    assert service.router.gates.for_tap(tap).threshold == 0.99  # not the model's 0.45 meanwhile
    (error,) = service.health()["errors"]
    assert error["file"].endswith("capd.toml") and error["line"] == 1
    gates.unlink()
    watcher.apply_changes([gates])
    assert service.router.gates.for_tap(tap).threshold != 0.99 and service.health()["errors"] == []


def test_a_folder_that_cannot_be_listed_keeps_its_last_good_version(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """It used to fail the whole reload, so later edits elsewhere in the tap were ignored too
    (``os.listdir`` refuses here: the suite may run as root, which chmod does not stop)."""
    service, tap = _service(tmp_path)
    watcher = TapWatcher(service)
    smalltalk = tap / "capabilities" / "smalltalk"
    listdir = os.listdir

    def guarded(path: str | os.PathLike[str]) -> list[str]:
        if Path(path) == smalltalk:
            raise PermissionError(13, "Permission denied", str(path))
        return listdir(path)

    monkeypatch.setattr("capd.taps.os.listdir", guarded)
    watcher.apply_changes([smalltalk])
    assert "smalltalk" in service.catalog_now()
    (error,) = service.health()["errors"]
    assert "Permission denied" in error["reason"]
    write_capability(tap, "zebra", ["feed the zebras at the zoo"])
    assert watcher.apply_changes([tap / "capabilities" / "zebra"])["added"] == ["zebra"]


def test_real_observer_add_edit_break_fix_delete(tmp_path: Path) -> None:
    service, tap = _service(tmp_path)
    assert service.registry is not None
    watcher = TapWatcher(service, debounce=0.1)
    watcher.start()
    try:
        write_capability(tap, "database-mysql", ["query the mysql database", "show mysql tables"],
                         {"mysql": POSTGRES_PROVIDER.replace("postgres", "mysql")}, default="mysql")
        assert _wait(lambda: "database-mysql" in service.catalog_now())
        plan = service.registry.activate("sess", "database-mysql", "manual")
        assert plan.active == ("database-mysql",) or list(plan.active) == ["database-mysql"]

        config = tap / "capabilities" / "database-mysql" / "config.toml"
        config.write_text('triggers = ["query the mysql database", "list the mysql schemas"]\n')
        assert _wait(lambda: "list the mysql schemas" in service.catalog_now().capabilities["database-mysql"]
                     .triggers)

        config.write_text("triggers = 42\n")
        assert _wait(lambda: len(service.health()["errors"]) == 1)
        assert "database-mysql" in service.catalog_now()  # last good version kept

        config.write_text('triggers = ["query the mysql database", "list the mysql schemas"]\n')
        assert _wait(lambda: service.health()["errors"] == [])

        shutil.rmtree(tap / "capabilities" / "database-mysql")
        assert _wait(lambda: "database-mysql" not in service.catalog_now())
        # The session holding the deleted capability gets its teardown in the next plan.
        after = service.route("hello there, lovely to see you again", session="sess")
        assert after.plan is not None
        torn = after.plan.as_dict()["teardown"]
        assert [t["capability"] for t in torn] == ["database-mysql"] and torn[0]["kill"] is True
    finally:
        watcher.stop()


def test_tap_directory_removed_and_restored(tmp_path: Path) -> None:
    service, tap = _service(tmp_path)
    watcher = TapWatcher(service, debounce=0.1)
    watcher.start()
    try:
        moved = tmp_path / "moved"
        tap.rename(moved)
        assert _wait(lambda: any("missing" in e["reason"] for e in service.health()["errors"]))
        assert len(service.catalog_now()) == 5  # the last good capabilities keep serving
        assert service.route("please run a query on the postgres database").decision.decision != "skipped"
        shutil.rmtree(moved / "capabilities" / "smalltalk")
        moved.rename(tap)
        assert _wait(lambda: service.health()["errors"] == [])
        assert len(service.catalog_now()) == 4
    finally:
        watcher.stop()


def test_tap_deleted_and_created_anew_is_watched_again(tmp_path: Path) -> None:
    service, tap = _service(tmp_path)
    watcher = TapWatcher(service, debounce=0.1)
    watcher.start()
    try:
        backup = tmp_path / "backup"
        shutil.copytree(tap, backup, symlinks=True)
        shutil.rmtree(tap)
        assert _wait(lambda: any("missing" in e["reason"] for e in service.health()["errors"]))
        shutil.copytree(backup, tap, symlinks=True)
        assert _wait(lambda: service.health()["errors"] == [])
        write_capability(tap, "late-arrival", ["a capability added after the tap came back"])
        assert _wait(lambda: "late-arrival" in service.catalog_now())
    finally:
        watcher.stop()


def test_a_tap_deleted_and_created_again_at_once_is_watched_again(tmp_path: Path) -> None:
    """Created again at once, the folder got the inode number of the deleted one back (ext4 reuses
    it), so the watcher took it for the folder it watched, whose watch had gone with it: every later
    edit was ignored until a restart."""
    service, tap = _service(tmp_path)
    backup = tmp_path / "backup"
    shutil.copytree(tap, backup, symlinks=True)
    watcher = TapWatcher(service, debounce=0.1)
    watcher.start()
    try:
        for round_ in range(3):
            inode = tap.stat().st_ino
            shutil.rmtree(tap)
            tap.mkdir()  # before the watcher's next check sees the tap gone
            shutil.copytree(backup, tap, symlinks=True, dirs_exist_ok=True)
            name = f"late-arrival-{round_}"
            time.sleep(0.5)  # the re-created tap is seen (an event, or the next check)
            write_capability(tap, name, [f"a capability added after round {round_}"])
            assert _wait(lambda name=name: name in service.catalog_now()), (round_, inode, tap.stat().st_ino)
            shutil.rmtree(backup)
            shutil.copytree(tap, backup, symlinks=True)
    finally:
        watcher.stop()


def test_a_tap_gone_again_before_its_watch_is_set_is_watched_at_the_next_check(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Deleted between the check's stat and its watch (ENOENT from inotify): that was taken for the
    watch limit reached, and the watcher scanned every tap from then on, advising a sysctl."""
    service, tap = _service(tmp_path)
    watcher = TapWatcher(service, debounce=0.1)
    watcher.start()
    try:
        schedule = watcher._observer.schedule
        calls = {"refused": 0}

        def gone_once(handler: object, path: str, **kwargs: object) -> object:
            if path == str(tap) and not calls["refused"]:
                calls["refused"] += 1
                raise OSError(errno.ENOENT, os.strerror(errno.ENOENT))  # what inotify_add_watch raises
            return schedule(handler, path, **kwargs)

        monkeypatch.setattr(watcher._observer, "schedule", gone_once)
        watcher.renew([tap])  # as after a delete event: the tap is watched anew at the next check
        assert _wait(lambda: calls["refused"] == 1)
        write_capability(tap, "late-arrival", ["a capability added after the watch was set again"])
        assert _wait(lambda: "late-arrival" in service.catalog_now())
        assert not watcher.polling and service.health()["errors"] == []
    finally:
        watcher.stop()


def test_edits_under_a_linked_capabilities_folder_go_live(tmp_path: Path) -> None:
    """``capabilities/`` a link to a folder of the tap: watchers report edits under the real path,
    which matched no capability folder, so they never went live (a rescan found them)."""
    service, tap = _service(tmp_path)
    (tap / "capabilities").rename(tap / "src")
    os.symlink("src", tap / "capabilities")
    watcher = TapWatcher(service)
    watcher.apply_changes([tap / "capabilities"])
    assert len(service.catalog_now()) == 5
    (tap / "src" / "smalltalk" / "config.toml").write_text('triggers = ["tell me a joke", "say something funny"]\n')
    report = watcher.apply_changes([tap / "src" / "smalltalk" / "config.toml"])
    assert report["changed"] == ["smalltalk"]
    assert service.catalog_now().capabilities["smalltalk"].triggers == ("tell me a joke", "say something funny")


def test_retargeting_a_folder_link_on_the_way_to_a_file_reloads_it(tmp_path: Path) -> None:
    """``default.toml -> ../../links/prov/pg.toml`` with ``links/prov -> ../releases/p1``: retargeting
    ``links/prov`` changed what the capability reads, but neither path was recorded as its link."""
    service, tap = _service(tmp_path)
    watcher = TapWatcher(service)
    for release in ("p1", "p2"):
        (tap / "releases" / release).mkdir(parents=True)
        (tap / "releases" / release / "pg.toml").write_text(f"# Title: Postgres {release}\n{POSTGRES_PROVIDER}")
    (tap / "links").mkdir()
    os.symlink("../releases/p1", tap / "links" / "prov")
    folder = write_capability(tap, "pg", ["query the postgres database"])
    os.symlink("../../links/prov/pg.toml", folder / "default.toml")
    watcher.apply_changes([folder])
    assert service.catalog_now().capabilities["pg"].title == "Postgres p1"
    (tap / "links" / "prov").unlink()
    os.symlink("../releases/p2", tap / "links" / "prov")
    assert watcher.apply_changes([tap / "links" / "prov"])["changed"] == ["pg"]
    assert service.catalog_now().capabilities["pg"].title == "Postgres p2"
    (tap / "releases" / "p2" / "pg.toml").write_text(f"# Title: Postgres p2.1\n{POSTGRES_PROVIDER}")
    assert watcher.apply_changes([tap / "releases" / "p2" / "pg.toml"])["changed"] == ["pg"]
    assert service.catalog_now().capabilities["pg"].title == "Postgres p2.1"


def test_a_capability_folder_link_that_breaks_keeps_the_last_good_version(tmp_path: Path) -> None:
    """A folder link retargeted to nothing (a typo) dropped the capability, where a broken file keeps
    the last good version; the error names the link either way."""
    service, tap = _service(tmp_path)
    watcher = TapWatcher(service)
    (tap / "shared" / "notes-v1").mkdir(parents=True)
    (tap / "shared" / "notes-v1" / "config.toml").write_text('triggers = ["read my release notes"]\n')
    os.symlink("../shared/notes-v1", tap / "capabilities" / "notes")
    watcher.apply_changes([tap / "capabilities" / "notes"])
    assert "notes" in service.catalog_now()
    (tap / "capabilities" / "notes").unlink()
    os.symlink("../shared/notes-v2", tap / "capabilities" / "notes")
    watcher.apply_changes([tap / "capabilities" / "notes"])
    assert service.catalog_now().capabilities["notes"].triggers == ("read my release notes",)
    assert any("notes-v2" in e["reason"] and "does not exist" in e["reason"] for e in service.health()["errors"])
    (tap / "capabilities" / "notes").unlink()  # removed on purpose: gone
    watcher.apply_changes([tap / "capabilities" / "notes"])
    assert "notes" not in service.catalog_now() and service.health()["errors"] == []


@pytest.mark.parametrize("at_start", ["present", "missing"])
def test_a_tap_whose_parent_is_deleted_and_created_again_is_watched_again(tmp_path: Path, at_start: str) -> None:
    """The repository holding a tap cloned afresh (the tap's parent deleted and created again), or a
    tap whose parent did not exist at the start: the watcher lost the tap for good, and its edits
    were ignored until a restart."""
    tap = octomind_tap(tmp_path / "repo")
    backup = tmp_path / "backup"
    shutil.copytree(tmp_path / "repo", backup, symlinks=True)
    if at_start == "missing":
        shutil.rmtree(tmp_path / "repo")
    service = Service(Settings(taps=(tap,), data_dir=tmp_path / "data", model="hash"), sessions=True).start()
    watcher = TapWatcher(service, debounce=0.1)
    watcher.start()
    try:
        if at_start == "present":
            shutil.rmtree(tmp_path / "repo")
            assert _wait(lambda: any("missing" in e["reason"] for e in service.health()["errors"]))
        shutil.copytree(backup, tmp_path / "repo", symlinks=True)
        assert _wait(lambda: service.health()["errors"] == [] and len(service.catalog_now()) == 5)
        write_capability(tap, "late-arrival", ["a capability added after the tap came back"])
        assert _wait(lambda: "late-arrival" in service.catalog_now())
    finally:
        watcher.stop()


def test_a_capability_moved_out_and_back_is_reloaded_without_warnings(tmp_path: Path,
                                                                       recwarn: pytest.WarningsRecorder) -> None:
    """watchdog keeps the watch of a folder moved out of the tap; moved back, it watches it again and
    warned "Callback with id … already exists for watch" (from its inotify thread: ``recwarn``
    records warnings of every thread while the test runs) into the daemon's log."""
    service, tap = _service(tmp_path)
    watcher = TapWatcher(service, debounce=0.1)
    watcher.start()
    try:
        folder, outside = tap / "capabilities" / "smalltalk", tmp_path / "smalltalk"
        for _ in range(2):
            folder.rename(outside)
            assert _wait(lambda: "smalltalk" not in service.catalog_now())
            outside.rename(folder)
            assert _wait(lambda: "smalltalk" in service.catalog_now())
        (folder / "config.toml").write_text('triggers = ["tell me about the weather tomorrow"]\n')
        assert _wait(lambda: service.catalog_now().capabilities["smalltalk"].triggers
                     == ("tell me about the weather tomorrow",))  # still watched
    finally:
        watcher.stop()
    assert [str(w.message) for w in recwarn if issubclass(w.category, RuntimeWarning)] == []


def test_an_edit_made_while_the_daemon_starts_is_applied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon watches the taps before it loads them: a capability written after the load read
    the folder but before the service was ready (a fused first start on a large tap takes minutes)
    still goes live, through a real observer."""
    tap = octomind_tap(tmp_path)
    settings = Settings(taps=(tap,), data_dir=tmp_path / "data", model="hash")
    start = Service.start

    def start_then_edit(service: Service) -> Service:
        started = start(service)
        write_capability(tap, "database-mysql", ["query the mysql database", "show mysql tables"])
        return started

    monkeypatch.setattr(Service, "start", start_then_edit)
    with local_client(create_app(settings, warm_in_background=False)) as client:
        assert _wait(lambda: "database-mysql" in {c["name"] for c in client.get("/v1/capabilities").json()
                                                  ["capabilities"]})


def _refuse_inotify(monkeypatch: pytest.MonkeyPatch, limit: str) -> None:
    """The kernel refusing inotify as it does once a user's limit is reached (editors and other
    watchers get there): no new instance (EMFILE) or no new watch (ENOSPC). Faked at the edge,
    watchdog's ctypes calls, since reaching the real limit would break every other process."""
    from watchdog.observers import inotify_c

    def refused(code: int) -> Callable[..., int]:
        def call(*_: object) -> int:
            ctypes.set_errno(code)
            return -1
        return call

    if limit == "instances":
        monkeypatch.setattr(inotify_c.InotifyFD, "_instance", None)  # else the shared one is reused
        monkeypatch.setattr(inotify_c, "inotify_init", refused(errno.EMFILE))
    else:
        monkeypatch.setattr(inotify_c, "inotify_add_watch", refused(errno.ENOSPC))


@pytest.mark.parametrize("limit", ["instances", "watches"])
def test_without_inotify_the_daemon_scans_the_taps_and_edits_still_go_live(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limit: str) -> None:
    """The daemon used to stay "starting" for good (every route "skipped: warming up") when the
    inotify limit was reached, and its shutdown raised. It now scans the taps instead and says so."""
    _refuse_inotify(monkeypatch, limit)
    monkeypatch.setattr(watcher_module, "POLL_INTERVAL", 0.25)
    tap = octomind_tap(tmp_path)
    settings = Settings(taps=(tap,), data_dir=tmp_path / "data", model="hash")
    with local_client(create_app(settings, warm_in_background=False)) as client:
        health = client.get("/v1/health").json()
        assert health["status"] == "ok" and health["ready"]
        [note] = health["errors"]
        assert note["file"] == str(tap) and "limit reached" in note["reason"] and "scanned every" in note["reason"]
        assert client.post("/v1/route", json={"session": "s", "message": "run a query on the postgres database"}
                           ).json()["decision"] != "skipped"
        write_capability(tap, "database-mysql", ["query the mysql database", "show mysql tables"])
        assert _wait(lambda: "database-mysql" in {c["name"] for c in client.get("/v1/capabilities").json()
                                                  ["capabilities"]})


def test_a_tap_that_appears_once_the_watch_limit_is_reached_is_scanned(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Watched with inotify from the start; the limit is reached before the tap is created. Its
    watch is refused, and the watcher turns to scanning every tap instead of losing that one."""
    tap = octomind_tap(tmp_path / "repo")
    backup = tmp_path / "backup"
    shutil.copytree(tmp_path / "repo", backup, symlinks=True)
    shutil.rmtree(tmp_path / "repo")
    service = Service(Settings(taps=(tap,), data_dir=tmp_path / "data", model="hash"), sessions=True).start()
    watcher = TapWatcher(service, debounce=0.1)
    watcher.start()
    try:
        assert not watcher.polling
        _refuse_inotify(monkeypatch, "watches")
        monkeypatch.setattr(watcher_module, "POLL_INTERVAL", 0.25)
        shutil.copytree(backup, tmp_path / "repo", symlinks=True)
        assert _wait(lambda: len(service.catalog_now()) == 5)
        assert watcher.polling and "limit reached" in service.health()["errors"][0]["reason"]
        write_capability(tap, "late-arrival", ["a capability added after the tap came back"])
        assert _wait(lambda: "late-arrival" in service.catalog_now())
    finally:
        watcher.stop()


def test_taps_that_can_be_neither_watched_nor_scanned_still_serve(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Live reload is a convenience: when no observer starts at all, the daemon serves the taps as
    loaded and health says that edits need a reload."""
    _refuse_inotify(monkeypatch, "instances")

    def refused(self: object) -> None:
        raise OSError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(watcher_module.PollingObserver, "start", refused)
    tap = octomind_tap(tmp_path)
    settings = Settings(taps=(tap,), data_dir=tmp_path / "data", model="hash")
    with local_client(create_app(settings, warm_in_background=False)) as client:
        health = client.get("/v1/health").json()
        assert health["ready"] and "live reload is off" in health["errors"][0]["reason"]
        write_capability(tap, "database-mysql", ["query the mysql database", "show mysql tables"])
        assert client.post("/v1/reload").status_code == 200
        assert "database-mysql" in {c["name"] for c in client.get("/v1/capabilities").json()["capabilities"]}


def test_watch_poll_scans_the_taps_without_notifications(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``watch = "poll"`` (taps on a network file system, where an edit made on another machine
    raises no notification here): the taps are scanned from the start; no inotify is needed, and
    since it is what the user asked for, health shows no error."""
    _refuse_inotify(monkeypatch, "instances")
    monkeypatch.setattr(watcher_module, "POLL_INTERVAL", 0.25)
    tap = octomind_tap(tmp_path)
    settings = Settings(taps=(tap,), data_dir=tmp_path / "data", model="hash", watch="poll")
    with local_client(create_app(settings, warm_in_background=False)) as client:
        assert client.get("/v1/health").json()["errors"] == []
        write_capability(tap, "database-mysql", ["query the mysql database", "show mysql tables"])
        assert _wait(lambda: "database-mysql" in {c["name"] for c in client.get("/v1/capabilities").json()
                                                  ["capabilities"]})


def test_watch_off_applies_edits_on_reload_only(tmp_path: Path) -> None:
    tap = octomind_tap(tmp_path)
    settings = Settings(taps=(tap,), data_dir=tmp_path / "data", model="hash", watch="off")
    with local_client(create_app(settings, warm_in_background=False)) as client:
        write_capability(tap, "database-mysql", ["query the mysql database", "show mysql tables"])
        time.sleep(1.0)  # a watcher would have applied it by now (0.25 s debounce)

        def names() -> set[str]:
            return {c["name"] for c in client.get("/v1/capabilities").json()["capabilities"]}

        assert "database-mysql" not in names()
        assert client.post("/v1/reload").json()["added"] == ["database-mysql"]
        assert "database-mysql" in names()


def test_an_inotify_queue_overflow_reloads_every_tap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tens of thousands of files changed at once overflow the kernel's queue: the events are lost
    and watchdog only logs it (it rebuilds its watches). A capability written while its events were
    lost used to stay unseen until its folder changed again; now every tap is reloaded."""
    from watchdog.observers import inotify_c

    service, tap = _service(tmp_path)
    watcher = TapWatcher(service, debounce=0.1)
    watcher.start()
    try:
        with monkeypatch.context() as lost:  # the events of this write never reach capd
            lost.setattr(watcher, "notify", lambda paths: None)
            write_capability(tap, "database-mysql", ["query the mysql database", "show mysql tables"])
            time.sleep(0.5)
        assert "database-mysql" not in service.catalog_now()
        # the kernel's IN_Q_OVERFLOW, handed to watchdog's own handling of it
        overflow = inotify_c.InotifyEvent(inotify_c.WatchDescriptor(-1), inotify_c.InotifyConstants.IN_Q_OVERFLOW,
                                          0, b"")
        inotify_c.InotifyFD.get_instance().handle_event(overflow)
        assert _wait(lambda: "database-mysql" in service.catalog_now())
    finally:
        watcher.stop()


def test_a_reload_cut_short_by_the_shutdown_is_not_an_error(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A daemon stopped while the watcher reloaded logged "reload after file changes failed; serving
    the previous catalog" with a traceback: neither is true of a stop."""
    service, tap = _service(tmp_path)
    watcher = TapWatcher(service)
    service.close()  # as the daemon's shutdown does while the reload runs
    with caplog.at_level("INFO", logger="capd.watcher"):
        report = watcher.apply_changes([tap / "capabilities" / "smalltalk" / "config.toml"])
    assert report == {"error": "stopping"}
    assert [r.levelname for r in caplog.records] == ["INFO"] and "stopping" in caplog.records[0].getMessage()


def test_a_watcher_stopped_before_it_observes_never_starts(tmp_path: Path) -> None:
    """A daemon stopping as it started could stop its watcher before the warm-up thread set it
    observing: the observer then started after the stop and watched the taps for good."""
    service, _ = _service(tmp_path)
    watcher = TapWatcher(service)
    watcher.stop()
    watcher.observe()
    watcher.apply()
    assert watcher._observer is None and watcher._thread is None
    live = [t.name for t in threading.enumerate() if t.name == "capd-watcher" or "Observer" in type(t).__name__]
    assert not live, live
    service.close()


def test_a_log_file_inside_a_tap_does_not_reload_it_without_end(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """``capd serve --tap . 2> capd.log`` from a tap's folder: each reload logged a line, the line
    was a change in the tap, which reloaded it, four times a second for as long as the daemon ran.
    A change to a file that is not a tap file (nor a folder, nor gone) reloads nothing."""
    service, tap = _service(tmp_path)
    caplog.set_level(logging.INFO, logger="capd.watcher")  # the daemon's level
    handler = logging.FileHandler(tap / "capd.log")
    logging.getLogger("capd.watcher").addHandler(handler)
    watcher = TapWatcher(service, debounce=0.05)
    watcher.start()
    try:
        (tap / "capabilities" / "smalltalk" / "config.toml").touch()
        assert _wait(lambda: watcher.applied >= 1)
        time.sleep(1.0)  # the loop reloaded about every 0.1 s here
        assert watcher.applied <= 2, watcher.applied
    finally:
        watcher.stop()
        logging.getLogger("capd.watcher").removeHandler(handler)
        handler.close()


def test_files_created_next_to_a_tap_do_not_reload_it(tmp_path: Path) -> None:
    """The folder above a tap is watched for the tap coming or going; creating or removing a file
    beside the tap (``2> capd.log`` in it, an editor's swap file) modifies that folder too, and
    reloaded the whole tap each time (on 10,000 capabilities: seconds of reading TOML files)."""
    service, tap = _service(tmp_path)
    watcher = TapWatcher(service, debounce=0.05)
    watcher.start()
    try:
        sibling = tap.parent / "capd.log"
        sibling.write_text("a line\n")
        (tap.parent / "notes").mkdir()
        sibling.unlink()
        time.sleep(0.5)  # ten debounces: long enough for the reloads the old code made
        (tap / "capabilities" / "smalltalk" / "config.toml").touch()  # the watcher still sees the tap
        assert _wait(lambda: watcher.applied >= 1)
        time.sleep(0.3)
        assert watcher.applied == 1, watcher.applied
    finally:
        watcher.stop()


def test_a_stop_during_a_reload_ends_it_before_the_next_batch(tmp_path: Path) -> None:
    """A SIGTERM during the reload of an edited 1,140-capability tap waited 26-30 s for every batch
    to be embedded (the daemon's grace is 10 s): the stop now ends the reload at its next batch."""
    tap = octomind_tap(tmp_path)
    encoder = HeldEncoder()
    service = Service(Settings(taps=(tap,), data_dir=tmp_path / "data", model="hash"), encoder=encoder).start()
    write_capability(tap, "many", [f"trigger number {i} of a large capability" for i in range(640)])  # 10 batches
    encoder.hold.set()
    outcome: list[BaseException | dict[str, object]] = []

    def reload() -> None:
        try:
            outcome.append(service.reload())
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=reload)
    thread.start()
    try:
        assert encoder.reached.wait(30)
        service.interrupt()  # as the daemon's shutdown does before joining the watcher
        encoder.release.set()
        thread.join(30)
        assert not thread.is_alive()
        assert isinstance(outcome[0], Stopping) and encoder.texts <= 64  # one batch of 640 texts, not all
    finally:
        encoder.release.set()
        service.close()
