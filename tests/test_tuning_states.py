"""What the service and the CLI do around a tuning (capd/service.py): the health ``tuning``
status, a damaged tuned model, an edit during a tuning, a failed tuning in a one-shot command,
a daemon that failed to start. The training itself is replaced by a copy of the base model
published under the key (the real training is tests/test_tuning.py's); loading it is real."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import capd.model_switch as model_switch
import capd.tuner as tuner_module
import capd.tuning as tuning_module
from capd.cli import main
from capd.encoder import Encoder
from capd.errors import CapdError
from capd.service import Service
from capd.settings import Settings
from capd.taps import load_catalog
from capd.tuned_models import MARKER, in_use, is_tuned, remove, tuned_dir
from capd.tuner import target_for
from tests.conftest import SettingsFactory, isolated_data_dir
from tests.taputil import write_capability

TRIGGERS = {
    "postgres": ["run a SQL query on the database", "show the tables in postgres", "explain this slow query"],
    "docker": ["start a container from this image", "list running containers", "build the docker image"],
    "calendar": ["schedule a meeting with Ana tomorrow", "what is on my calendar today", "cancel the standup"],
}


def write_tap(root: Path) -> Path:
    for name, texts in TRIGGERS.items():
        write_capability(root, name, texts)
    return root


def fake_tuning(trained: list[str], gate: threading.Event | None = None) -> Callable[..., dict[str, Any]]:
    """Stands in for run_child: publishes the base model (symlinked files) as the tuned one."""
    def run_child(base: Path, groups: Any, out: Path, recipe: Any = None, **_: Any) -> dict[str, Any]:
        if gate is not None:
            assert gate.wait(10)
        out.mkdir(parents=True)
        for item in base.iterdir():
            os.symlink(item, out / item.name)
        (out / MARKER).write_text(json.dumps({"seconds": 0.1}), encoding="utf-8")
        trained.append(out.name)
        return {"seconds": 0.1}
    return run_child


@pytest.fixture
def tuned_settings(model_settings: Settings, real_encoder: Encoder, tmp_path: Path) -> Settings:
    """The real model (its ONNX export shared), ``tune = true``, a small tap."""
    return replace(isolated_data_dir(model_settings, tmp_path), taps=(write_tap(tmp_path / "tap"),), tune=True)


def wait_idle(service: Service, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while service.tuner.busy:
        assert time.monotonic() < deadline, "the tuning thread did not finish"
        time.sleep(0.05)


def test_a_damaged_tuned_model_is_set_aside_and_tuned_again(tuned_settings: Settings,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    service = Service(tuned_settings)
    key = service.tuner.target(load_catalog(tuned_settings.taps)).key
    damaged = tuned_dir(tuned_settings.data_dir, key)
    damaged.mkdir(parents=True)
    (damaged / "config.json").write_text("{not json", encoding="utf-8")
    (damaged / MARKER).write_text("{}", encoding="utf-8")  # marked complete, but no model in it
    trained: list[str] = []
    monkeypatch.setattr(tuner_module, "run_child", fake_tuning(trained))
    service.start()
    try:
        assert service.tuning.status == "ready" and service.tuning.key == key, service.tuning
        assert trained == [key]
        aside = [p.name for p in damaged.parent.iterdir() if p.name.startswith(f"{key}.broken-")]
        assert len(aside) == 1 and (damaged.parent / aside[0] / "config.json").read_text() == "{not json"
    finally:
        service.close()


def test_health_says_untuned_while_starting_and_stale_after_an_edit(tuned_settings: Settings,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tuner_module, "TUNE_DELAY", 60.0)  # the retune stays pending during the test
    monkeypatch.setattr(tuner_module, "run_child", fake_tuning([]))
    service = Service(tuned_settings, sessions=True)
    try:
        assert service.health()["tuning"]["status"] == "untuned"  # enabled: never "off"
        service.start()
        wait_idle(service)
        first = service.tuning.key
        assert service.tuning.status == "ready" and first is not None, service.tuning
        write_capability(tuned_settings.taps[0], "docker", [*TRIGGERS["docker"], "remove dangling images"])
        service.reload()
        state = service.health()["tuning"]
        assert state["status"] == "stale" and state["key"] == first and state["wanted"] not in (None, first)
    finally:
        service.close()


def test_a_restart_after_a_tap_edit_routes_with_the_last_tuned_model_while_it_retunes(
        tuned_settings: Settings, real_encoder: Encoder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A restart after a tap edit routed untuned until the tuning for the taps as they are was done
    (minutes), where a daemon edited live keeps its previous tuned model meanwhile. It now adopts the
    one it last used for these taps (stale), and only for these taps."""
    trained: list[str] = []
    monkeypatch.setattr(tuner_module, "run_child", fake_tuning(trained))
    with contextlib.closing(Service(tuned_settings, sessions=True).start()) as service:
        wait_idle(service)
        first = service.tuning.key
        assert service.tuning.status == "ready" and first is not None
    write_capability(tuned_settings.taps[0], "docker", [*TRIGGERS["docker"], "remove dangling images"])
    gate = threading.Event()
    monkeypatch.setattr(tuner_module, "run_child", fake_tuning(trained, gate))
    service = Service(tuned_settings, sessions=True).start()
    try:
        state = service.health()["tuning"]
        assert state["key"] == first and state["wanted"] not in (None, first), state
        assert state["status"] in ("tuning", "stale") and service.health()["model"] != real_encoder.model_id
        assert service.route("list running containers").decision.capability == "docker"
        gate.set()
        wait_idle(service)
        assert service.tuning.status == "ready" and service.tuning.key == state["wanted"] == trained[-1]
    finally:
        gate.set()
        service.close()
    other = replace(tuned_settings, taps=(write_tap(tmp_path / "other"),))  # the same data directory
    write_capability(other.taps[0], "calendar", [*TRIGGERS["calendar"], "book a room for friday"])  # its own key
    monkeypatch.setattr(tuner_module, "run_child", fake_tuning(trained, threading.Event()))  # never done
    service = Service(other, sessions=True).start()
    try:
        assert service.tuning.key is None and service.health()["model"] == real_encoder.model_id
    finally:
        service.close()


def test_a_tuning_outdated_by_an_edit_while_it_ran_is_not_loaded(tuned_settings: Settings, real_encoder: Encoder,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tuner_module, "TUNE_DELAY", 60.0)
    gate = threading.Event()
    trained: list[str] = []
    monkeypatch.setattr(tuner_module, "run_child", fake_tuning(trained, gate))
    service = Service(tuned_settings, sessions=True).start()
    try:
        assert service.tuning.status == "tuning"
        first = service.tuning.wanted
        write_capability(tuned_settings.taps[0], "docker", [*TRIGGERS["docker"], "remove dangling images"])
        service.reload()
        assert service.tuning.status == "stale" and service.tuning.wanted != first
        gate.set()
        wait_idle(service)
        assert trained == [first] and is_tuned(tuned_dir(tuned_settings.data_dir, str(first)))  # kept for later
        assert service.tuning.key is None and service.tuning.status == "untuned", service.tuning
        assert service.health()["model"] == real_encoder.model_id  # not swapped in for nothing
    finally:
        gate.set()
        service.close()


def test_a_tuned_model_that_fails_to_publish_leaves_the_served_model_in_place(
        tuned_settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """Publishing with the tuned model can fail after the switch (e.g. it gives non-finite
    vectors): the encoder, embedder and index used to stay switched while the served snapshot
    still routed with the old model, which was closed 30 s later."""
    monkeypatch.setattr(tuner_module, "TUNE_DELAY", 60.0)
    gate = threading.Event()
    monkeypatch.setattr(tuner_module, "run_child", fake_tuning([], gate))
    service = Service(tuned_settings, sessions=True).start()
    try:
        before, publish = service.encoder, service._publish

        def failing(catalog: Any) -> Any:
            if service.encoder is not before:  # the tuned model is switched in
                raise CapdError("the model gave non-finite vectors")
            return publish(catalog)

        monkeypatch.setattr(service, "_publish", failing)
        gate.set()
        wait_idle(service)
        assert service.tuning.status == "failed" and service.tuning.key is None, service.tuning
        assert "cannot route with the tuned model" in str(service.tuning.error)
        assert service.encoder is before and service.route("list running containers").decision.capability == "docker"
    finally:
        gate.set()
        service.close()


def test_a_service_holds_the_tuned_model_it_routes_with_and_lets_go_when_done(
        tuned_settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a service routes with a tuned model, no other process prunes or removes it; the
    model it switched away from, and the one it had at close, are let go of."""
    monkeypatch.setattr(tuner_module, "TUNE_DELAY", 0.05)
    monkeypatch.setattr(model_switch, "RETIRE_DELAY", 0.0)
    monkeypatch.setattr(tuner_module, "run_child", fake_tuning([]))
    service = Service(tuned_settings, sessions=True).start()
    try:
        wait_idle(service)
        first = tuned_dir(tuned_settings.data_dir, str(service.tuning.key))
        assert service.tuning.status == "ready" and in_use(first)
        with pytest.raises(CapdError, match="in use by a running capd process"):
            remove(tuned_settings.data_dir, first.name)
        write_capability(tuned_settings.taps[0], "docker", [*TRIGGERS["docker"], "remove dangling images"])
        service.reload()
        deadline = time.monotonic() + 10
        while service.tuning.key == first.name or in_use(first):
            assert time.monotonic() < deadline, service.tuning
            time.sleep(0.05)
        second = tuned_dir(tuned_settings.data_dir, str(service.tuning.key))
        assert in_use(second) and remove(tuned_settings.data_dir, first.name) == first
    finally:
        service.close()
    assert not in_use(second)


def test_one_shot_commands_fail_when_the_tuning_asked_for_does_not_happen(tuned_settings: Settings) -> None:
    (tuned_settings.data_dir / "tuned").write_text("a file where the tuned models go", encoding="utf-8")
    result = CliRunner().invoke(main, ["route", "list running containers", "--tap", str(tuned_settings.taps[0]),
                                       "--data-dir", str(tuned_settings.data_dir), "--backend", "onnx"],
                                env={"CAPD_TUNE": "true"})
    assert result.exit_code == 1, result.output
    assert "tuning was asked for" in result.output and "did not happen" in result.output


def test_a_daemon_that_failed_to_start_says_so_when_asked_to_route(settings_factory: SettingsFactory) -> None:
    service = Service(settings_factory(model="nosuch"))
    with pytest.raises(CapdError):
        service.start()
    decision = service.route("list the running containers").decision
    assert decision.decision == "skipped"
    assert decision.reason.startswith("failed to start: ") and service.startup_error is not None
    assert service.startup_error in decision.reason


def test_route_says_warming_up_while_the_model_loads(settings_factory: SettingsFactory) -> None:
    decision = Service(settings_factory()).route("list the running containers").decision
    assert decision.decision == "skipped" and decision.reason.startswith("warming up")


def test_index_stores_the_tuned_models_vectors_when_tuning_is_on(tuned_settings: Settings,
                                                                  real_encoder: Encoder) -> None:
    target = target_for(tuned_settings, load_catalog(tuned_settings.taps))
    path = tuned_dir(tuned_settings.data_dir, target.key)
    fake_tuning([])(target.base, None, path)  # cached: index uses it without tuning
    result = CliRunner().invoke(main, ["index", "--tap", str(tuned_settings.taps[0]), "--data-dir",
                                       str(tuned_settings.data_dir), "--backend", "onnx", "--json"],
                                env={"CAPD_TUNE": "true"})
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["tuned"] == str(path) and report["model_id"] != real_encoder.model_id
    assert report["stored"] == report["triggers"] > 0


def test_lint_embeddings_names_the_untuned_model_it_checks_with(tmp_path: Path, model_settings: Settings) -> None:
    from capd.lint_embed import near_duplicates

    tap = tmp_path / "tap"
    write_capability(tap, "github", ["open a pull request", "review the open issues"])
    write_capability(tap, "gitlab", ["create a pull request", "show the pipeline status"])
    settings = replace(model_settings, taps=(tap,), tune=True)
    (problem,) = near_duplicates(load_catalog([tap]), settings)
    assert "all-minilm-l6-v2, untuned" in problem.reason


def test_stopping_while_tuning_is_not_a_failure(tuned_settings: Settings, monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """close() kills the training child: every daemon stopped mid-tuning logged "ERROR tuning
    failed (exit -9); the untuned model stays in use" and said ``failed``."""
    import subprocess
    import sys

    real_popen = subprocess.Popen

    def popen(argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:  # a child that trains for a long time
        return real_popen([sys.executable, "-c", "import time; time.sleep(60)"], **kwargs)

    monkeypatch.setattr(subprocess, "Popen", popen)
    relay = tuning_module._relay

    def slow_relay(*args: Any) -> None:  # the run's cleanup takes a moment after the kill, as on a busy machine
        relay(*args)
        time.sleep(1.0)

    monkeypatch.setattr(tuning_module, "_relay", slow_relay)
    caplog.set_level("INFO", logger="capd.tuner")
    service = Service(tuned_settings, sessions=True).start()
    try:
        deadline = time.monotonic() + 10
        while not service.tuner._children:
            assert time.monotonic() < deadline, "the tuning child did not start"
            time.sleep(0.05)
    finally:
        service.close()
    # close() waits for the killed run's own cleanup: a daemon stopping right after left the run's
    # spec file behind and never logged that the tuning stopped
    assert service.tuner._thread is not None and not service.tuner._thread.is_alive()
    assert not list((tuned_settings.data_dir / "tuned").glob(".*.spec.json"))
    assert "stopped: capd is stopping" in caplog.text
    wait_idle(service)
    assert service.tuning.status == "tuning" and service.tuning.error is None, service.tuning
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text


def test_health_drops_the_reason_of_a_past_failure_once_the_tuned_model_fits_again(
        tuned_settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """An edit leaves too few examples (the reason is shown), an edit back restores the tuned
    model's taps: health said ``ready`` with the error "nothing to tune on" still in it."""
    import shutil

    monkeypatch.setattr(tuner_module, "TUNE_DELAY", 0.05)
    monkeypatch.setattr(tuner_module, "run_child", fake_tuning([]))
    tap = tuned_settings.taps[0]
    service = Service(tuned_settings, sessions=True).start()
    try:
        wait_idle(service)
        first = service.tuning.key
        assert service.tuning.status == "ready" and first is not None, service.tuning
        for name in ("docker", "calendar"):
            shutil.rmtree(tap / "capabilities" / name)
        service.reload()
        deadline = time.monotonic() + 10
        while service.tuning.error is None:
            assert time.monotonic() < deadline, service.tuning
            time.sleep(0.05)
        assert service.tuning.status == "stale" and "nothing to tune on" in str(service.tuning.error)
        write_tap(tap)
        service.reload()
        time.sleep(0.3)  # the retune timer fires and finds the model in use
        wait_idle(service)
        state = service.health()["tuning"]
        assert (state["status"], state["key"], state["error"]) == ("ready", first, None), state
    finally:
        service.close()


def test_a_retune_that_fires_as_a_tuning_ends_is_not_lost(tuned_settings: Settings,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A second edit's retune timer fired while the first edit's tuning ran: it left the catalog to
    that run, and the run, ending while the timer's thread was still returning, left it to the
    timer. Nobody tuned for the second edit; health said ``stale`` until the next edit."""
    monkeypatch.setattr(tuner_module, "TUNE_DELAY", 60.0)  # the retunes below are started by hand
    trained: list[str] = []
    monkeypatch.setattr(tuner_module, "run_child", fake_tuning(trained))
    service = Service(tuned_settings, sessions=True).start()
    gate, skipped, release = threading.Event(), threading.Event(), threading.Event()
    try:
        wait_idle(service)
        monkeypatch.setattr(tuner_module, "run_child", fake_tuning(trained, gate))
        tap = tuned_settings.taps[0]
        write_capability(tap, "docker", [*TRIGGERS["docker"], "remove dangling images"])
        service.reload()
        service.tuner.ensure(background=True)  # the first edit's timer: a tuning starts, held at the gate
        running = service.tuner._thread
        write_capability(tap, "docker", [*TRIGGERS["docker"], "remove dangling images", "prune the volumes"])
        service.reload()
        second = service.tuner.state.wanted
        assert service.tuner._timer is not None
        service.tuner._timer.cancel()

        def timer_fires() -> None:  # the second edit's timer, firing now and still returning when the run ends
            service.tuner.ensure(background=True)
            skipped.set()
            release.wait(10)

        fired = threading.Timer(0, timer_fires)
        monkeypatch.setattr(service.tuner, "_timer", fired)
        fired.start()
        assert skipped.wait(10)
        gate.set()
        assert running is not None
        running.join(10)
        release.set()
        fired.join(10)
        wait_idle(service)
        assert trained[-1] == second, trained
        state = service.health()["tuning"]
        assert (state["status"], state["key"]) == ("ready", second), state
    finally:
        gate.set()
        release.set()
        service.close()


@pytest.mark.parametrize("fails", [False, True], ids=["tuned", "failed"])
def test_an_edit_undone_while_its_tuning_ran_leaves_health_ready(
        tuned_settings: Settings, monkeypatch: pytest.MonkeyPatch, fails: bool) -> None:
    """An edit starts a retune; the edit is undone (the tuned model in use fits the taps again)
    before it ends: health said ``stale`` (or ``failed``, if that tuning failed) until the next
    retune timer, though the model in use is the one the taps ask for."""
    monkeypatch.setattr(tuner_module, "TUNE_DELAY", 60.0)  # the retunes below are started by hand
    gate = threading.Event()
    trained: list[str] = []
    monkeypatch.setattr(tuner_module, "run_child", fake_tuning(trained))
    service = Service(tuned_settings, sessions=True).start()
    try:
        wait_idle(service)
        first = service.tuning.key
        assert service.tuning.status == "ready" and first is not None, service.tuning
        retune = fake_tuning(trained, gate)

        def run_child(*args: Any, **kwargs: Any) -> dict[str, Any]:
            summary = retune(*args, **kwargs)
            if fails:
                raise CapdError("tuning failed (No space left on device); the untuned model stays in use")
            return summary

        monkeypatch.setattr(tuner_module, "run_child", run_child)
        write_capability(tuned_settings.taps[0], "docker", [*TRIGGERS["docker"], "remove dangling images"])
        service.reload()
        service.tuner.ensure(background=True)  # the retune timer firing
        assert service.tuning.status == "tuning", service.tuning
        write_capability(tuned_settings.taps[0], "docker", TRIGGERS["docker"])  # undone
        service.reload()
        assert service.tuning.status == "ready"
        gate.set()
        wait_idle(service)
        assert len(trained) == 2 and service.tuning.key == first, (trained, service.tuning)
        state = service.health()["tuning"]
        assert (state["status"], state["error"]) == ("ready", None), state
    finally:
        gate.set()
        service.close()


def nan_tuning(trained: list[str]) -> Callable[..., dict[str, Any]]:
    """Stands in for run_child: publishes the base model with every weight NaN, a model that loads
    and gives non-finite vectors."""
    def run_child(base: Path, groups: Any, out: Path, recipe: Any = None, **_: Any) -> dict[str, Any]:
        from safetensors.numpy import load_file, save_file

        out.mkdir(parents=True)
        for item in base.iterdir():
            if item.name != "model.safetensors":
                os.symlink(item, out / item.name)
        weights = load_file(str(base / "model.safetensors"))
        save_file({name: np.full_like(w, np.nan) if w.dtype.kind == "f" else w for name, w in weights.items()},
                  str(out / "model.safetensors"))
        (out / MARKER).write_text(json.dumps({"seconds": 0.1}), encoding="utf-8")
        trained.append(out.name)
        return {"seconds": 0.1}
    return run_child


def broken(settings: Settings, key: str) -> list[str]:
    return [p.name for p in tuned_dir(settings.data_dir, key).parent.iterdir() if p.name.startswith(f"{key}.broken-")]


def test_a_tuned_model_routing_cannot_use_is_set_aside_and_a_restart_serves(
        tuned_settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """It stayed in the cache: the next start adopted it, its first publish failed, and that start
    and every one after it failed ("reinstall the model in …/tuned/KEY") until someone deleted it.
    (The torch backend: under ONNX the export's own check refuses such a model before routing.)"""
    settings = replace(tuned_settings, backend="torch")
    trained: list[str] = []
    monkeypatch.setattr(tuner_module, "run_child", nan_tuning(trained))
    for start in (1, 2):
        service = Service(settings, sessions=True).start()
        try:
            wait_idle(service, 60)
            assert service.tuning.status == "failed" and service.tuning.key is None, service.tuning
            assert service.route("list running containers").decision.capability == "docker"
        finally:
            service.close()
        assert len(trained) == start and len(broken(settings, trained[0])) == start


def test_a_cached_tuned_model_routing_cannot_use_is_set_aside_and_tuned_again(
        tuned_settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """A start that finds such a model cached (left by an older capd, or damaged in place) serves,
    sets it aside and tunes again, instead of failing to start."""
    settings = replace(tuned_settings, backend="torch")
    target = target_for(settings, load_catalog(settings.taps))
    nan_tuning([])(target.base, target.groups, tuned_dir(settings.data_dir, target.key))
    trained: list[str] = []
    monkeypatch.setattr(tuner_module, "run_child", fake_tuning(trained))
    service = Service(settings, sessions=True).start()
    try:
        wait_idle(service, 60)
        assert service.tuning.status == "ready" and service.tuning.key == target.key, service.tuning
        assert trained == [target.key] and len(broken(settings, target.key)) == 1
        assert service.route("list running containers").decision.capability == "docker"
    finally:
        service.close()
